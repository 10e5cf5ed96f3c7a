"""The ``layouts`` pass (``planner.pipeline.PASSES``): a static layout per plan entry, written next
to the plan table (paper §6).

Each chosen configuration's layout is solved from the serving worker's own allocation stream
for that configuration (its mitigations and text-encoder placement applied:
``xema_ray.measure.layout_solve.solve_entry_layout``), saved as ``<table>.layouts/<layout_id>.json``
and named by the entry's ``layout_ref``. The entry's predicted peak becomes what the static
allocator will hold: the weights the worker places at load, plus the solved static region, plus
the dynamic region (``margins.DYNAMIC_FRACTION`` of it) — the solver's number, not the memory
model's ``LAYOUT_OVERHEAD`` allowance. Where the layouts folder holds a record of the GPU-only
allocations taken on that GPU model (``xema_ray.allocator.device_allocs``, written by ``make
gpu-check``), they are included before solving, so the predicted peak counts them too.

``xema plan`` does this for every entry by default (``--no-layouts`` skips it), after its group's
residency and text encoders are placed (both change the worker's stream), as Ray tasks on the
planning workers (their imports and model specs are warm): one task per entry, submitted as soon
as the last template of its model group is planned (``LayoutWave``), so one group's layouts run
while the other groups still plan and no core waits for the slowest planning task. The solve is
deterministic (a layout's id is its content hash), so ``xema layouts`` rebuilds a table's layout
files exactly from the table alone, and the order the groups finish in changes nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.plan import PlanEntry
from xema_ray.allocator.margins import entry_peak_bytes, fits_with_layout, group_dynamic_bytes, reserved_with_layout
from xema_ray.allocator.artifact import LayoutArtifact, layouts_dir, save_artifact
from xema_ray.measure.layout_solve import solve_entry_layout


class SolvedLayout(BaseModel):
    """What one layout task sends back (``solve_one``; Ray pickles it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    artifact: LayoutArtifact
    seconds: float = Field(description="the task's wall time")
    cpu_s: float = Field(description="the task's CPU time")


def solve_one(entry: PlanEntry, gpu: str, folder: str) -> SolvedLayout:
    """One entry's layout (runs inside a Ray task or in-process), with the task's wall and CPU seconds."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    # GPU-only allocations recorded on this GPU model (folder/device-allocs/<gpu>.json) go in first
    art = solve_entry_layout(entry.config, gpu, Path(folder))
    return SolvedLayout(artifact=art, seconds=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0)


def with_layout(entry: PlanEntry, art: LayoutArtifact, dynamic_bytes: int | None = None) -> tuple[PlanEntry, float]:
    """``entry`` referencing ``art``, its predicted peak what the worker holds with it armed (its
    weights, its static region and the group's dynamic region, ``dynamic_bytes``; None: the
    layout's own ``dynamic_fraction``, an entry alone); and the layout's reserved / lower bound."""
    peak = (reserved_with_layout(art.loaded_bytes, art.reserved_bytes, art.dynamic_fraction) if dynamic_bytes is None
            else entry_peak_bytes(art.loaded_bytes, art.reserved_bytes, dynamic_bytes))
    cfg = entry.config.model_copy(update={"layout_ref": art.layout_id})
    pred = entry.prediction.model_copy(update={"peak_bytes": peak})
    ratio = art.reserved_bytes / max(1, art.lower_bound_bytes)
    return entry.model_copy(update={"config": cfg, "prediction": pred}), ratio


def attach_layout(entry: PlanEntry, table_path: str | Path, gpu: str) -> tuple[PlanEntry, float]:
    """``entry`` with its layout solved, saved and referenced; and the layout's reserved / lower bound."""
    folder = layouts_dir(table_path)
    art = solve_one(entry, gpu, str(folder)).artifact
    save_artifact(art, folder)
    return with_layout(entry, art)


class LayoutWave:
    """Layout tasks submitted per group of final entries (``submit``, any number of times; Ray
    tasks, or solved at once in this process), gathered and saved by ``collect``."""

    def __init__(self, table_path: str | Path, gpu: str, use_ray: bool, num_cpus: float = 1.0) -> None:
        self.folder, self.gpu, self.use_ray = layouts_dir(table_path), gpu, use_ray
        self.num_cpus = num_cpus  # per task: what the planning tasks ask for (planner.cluster_fit)
        self._entries: dict[str, PlanEntry] = {}
        self._pending: dict[str, Any] = {}  # shape key -> Ray ref, or the solve's result
        self._task: Any = None
        #: after ``collect``: model -> its workers' one dynamic region; shape key -> why it keeps no layout
        self.dynamic_bytes: dict[str, int] = {}
        self.not_armed: dict[str, str] = {}
        self._skipped: dict[str, str] = {}  # shape key -> why no layout is solved for it
        self._kept: dict[str, PlanEntry] = {}  # those entries, as they were submitted

    def submit(self, entries: dict[str, PlanEntry]) -> None:
        """Start solving these entries' layouts (longest first: fewer idle cores at the end)."""
        for k in sorted(entries, key=lambda k: entries[k].config.template.latent_length, reverse=True):
            if entries[k].config.decode is not None:
                # the DiT workers' stream ends at the last step and the pool's is one decode: the
                # worker arms a layout over its whole pipeline call, which neither of them runs
                self._skipped[k] = ("its decode runs on a pool of its own (--stages): the DiT workers and "
                                    "the decode workers run with the dynamic allocator")
                self._kept[k] = entries[k]
                continue
            self._entries[k] = entries[k]
            args = (entries[k], self.gpu, str(self.folder))
            if not self.use_ray:
                self._pending[k] = solve_one(*args)
                continue
            if self._task is None:
                import ray

                self._task = ray.remote(num_cpus=self.num_cpus, num_gpus=0, max_calls=0)(solve_one)
            self._pending[k] = self._task.remote(*args)

    def collect(self, budget_bytes: int | None = None) -> tuple[dict[str, PlanEntry], dict[str, float], float]:
        """Every submitted entry with its layout saved and referenced: (entries, reserved / lower
        bound per entry, CPU seconds the solves took).

        A model group's worker keeps one dynamic region for all its templates while the static
        region follows the template run (``xema_ray.runtime.arena``), so each entry's predicted
        peak is its weights + its static region + the group's dynamic region
        (``margins.group_dynamic_bytes`` with ``budget_bytes``: ``dynamic_bytes`` per model after
        this). An entry that does not fit the budget even so keeps no layout (``not_armed`` says
        why) and its memory-model peak: its worker would run it unarmed."""
        if self.use_ray and self._pending:
            import ray

            done = dict(zip(self._pending, ray.get(list(self._pending.values())), strict=True))
        else:
            done = dict(self._pending)
        out, ratios, cpu = {}, {}, 0.0
        self.folder.mkdir(parents=True, exist_ok=True)
        arts: dict[str, LayoutArtifact] = {}
        for k, solved in done.items():
            arts[k] = solved.artifact
            save_artifact(arts[k], self.folder)
            cpu += solved.cpu_s
        by_model: dict[str, list[str]] = {}
        for k in arts:
            by_model.setdefault(self._entries[k].config.template.model, []).append(k)
        self.dynamic_bytes = {m: group_dynamic_bytes([(arts[k].loaded_bytes, arts[k].reserved_bytes) for k in keys],
                                                     budget_bytes) for m, keys in sorted(by_model.items())}
        self.not_armed = dict(self._skipped)
        out.update(self._kept)
        for m, keys in by_model.items():
            dyn = self.dynamic_bytes[m]
            for k in keys:
                art = arts[k]
                ratios[k] = art.reserved_bytes / max(1, art.lower_bound_bytes)
                if fits_with_layout(art.loaded_bytes, art.reserved_bytes, dyn, budget_bytes):
                    out[k] = with_layout(self._entries[k], art, dyn)[0]
                    continue
                out[k] = self._entries[k]
                self.not_armed[k] = (f"weights {art.loaded_bytes / 1e9:.2f} GB + static region {art.reserved_bytes / 1e9:.2f} GB"
                                     f" + the group's dynamic region {dyn / 1e9:.2f} GB exceed the "
                                     f"{(budget_bytes or 0) / 1e9:.2f} GB budget")
        return out, ratios, cpu


def attach_layouts(entries: dict[str, PlanEntry], table_path: str | Path, gpu: str, use_ray: bool,
                   budget_bytes: int | None = None) -> tuple[dict[str, PlanEntry], dict[str, float], float]:
    """Every entry's layout, solved in parallel Ray tasks (or here, in turn), saved next to
    ``table_path``: (entries with their ``layout_ref``, reserved / lower bound per entry, CPU
    seconds the solves took); peaks as ``LayoutWave.collect`` predicts them."""
    wave = LayoutWave(table_path, gpu, use_ray)
    wave.submit(entries)
    out, ratios, cpu = wave.collect(budget_bytes)
    return {k: out[k] for k in entries}, ratios, cpu
