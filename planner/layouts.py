"""Stage 5: a static layout per plan entry, written next to the plan table (paper §6).

Each chosen configuration's layout is solved from the serving worker's own allocation stream
for that configuration (its mitigations and text-encoder placement applied:
``xema_ray.runtime.layouts.solve_entry_layout``), saved as ``<table>.layouts/<layout_id>.json``
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

from xema_ray.plan import PlanEntry
from xema_ray.allocator.margins import reserved_with_layout
from xema_ray.runtime.layouts import LayoutArtifact, layouts_dir, save_artifact, solve_entry_layout


def solve_one(entry_json: str, gpu: str, folder: str) -> tuple[str, float, float]:
    """One entry's layout (runs inside a Ray task or in-process): the artifact as JSON, and the
    task's wall and CPU seconds."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    entry = PlanEntry.model_validate_json(entry_json)
    # GPU-only allocations recorded on this GPU model (folder/device-allocs/<gpu>.json) go in first
    art = solve_entry_layout(entry.config, gpu, Path(folder))
    return art.model_dump_json(), time.perf_counter() - t0, time.process_time() - cpu0


def with_layout(entry: PlanEntry, art: LayoutArtifact) -> tuple[PlanEntry, float]:
    """``entry`` referencing ``art``, its predicted peak what the static allocator holds; and the
    layout's reserved / lower bound."""
    peak = reserved_with_layout(art.loaded_bytes, art.reserved_bytes, art.dynamic_fraction)
    cfg = entry.config.model_copy(update={"layout_ref": art.layout_id})
    pred = entry.prediction.model_copy(update={"peak_bytes": peak})
    ratio = art.reserved_bytes / max(1, art.lower_bound_bytes)
    return entry.model_copy(update={"config": cfg, "prediction": pred}), ratio


def attach_layout(entry: PlanEntry, table_path: str | Path, gpu: str) -> tuple[PlanEntry, float]:
    """``entry`` with its layout solved, saved and referenced; and the layout's reserved / lower bound."""
    folder = layouts_dir(table_path)
    art = LayoutArtifact.model_validate_json(solve_one(entry.model_dump_json(), gpu, str(folder))[0])
    save_artifact(art, folder)
    return with_layout(entry, art)


class LayoutWave:
    """Layout tasks submitted per group of final entries (``submit``, any number of times; Ray
    tasks, or solved at once in this process), gathered and saved by ``collect``."""

    def __init__(self, table_path: str | Path, gpu: str, use_ray: bool) -> None:
        self.folder, self.gpu, self.use_ray = layouts_dir(table_path), gpu, use_ray
        self._entries: dict[str, PlanEntry] = {}
        self._pending: dict[str, Any] = {}  # shape key -> Ray ref, or the solve's result
        self._task: Any = None

    def submit(self, entries: dict[str, PlanEntry]) -> None:
        """Start solving these entries' layouts (longest first: fewer idle cores at the end)."""
        for k in sorted(entries, key=lambda k: entries[k].config.template.latent_length, reverse=True):
            self._entries[k] = entries[k]
            args = (entries[k].model_dump_json(), self.gpu, str(self.folder))
            if not self.use_ray:
                self._pending[k] = solve_one(*args)
                continue
            if self._task is None:
                import ray

                self._task = ray.remote(num_gpus=0, max_calls=0)(solve_one)
            self._pending[k] = self._task.remote(*args)

    def collect(self) -> tuple[dict[str, PlanEntry], dict[str, float], float]:
        """Every submitted entry with its layout saved and referenced: (entries, reserved / lower
        bound per entry, CPU seconds the solves took)."""
        if self.use_ray and self._pending:
            import ray

            done = dict(zip(self._pending, ray.get(list(self._pending.values())), strict=True))
        else:
            done = dict(self._pending)
        out, ratios, cpu = {}, {}, 0.0
        self.folder.mkdir(parents=True, exist_ok=True)
        for k, (art_json, _, cpu_s) in done.items():
            art = LayoutArtifact.model_validate_json(art_json)
            (self.folder / f"{art.layout_id}.json").write_text(art_json)  # as save_artifact writes it, not dumped again
            out[k], ratios[k] = with_layout(self._entries[k], art)
            cpu += cpu_s
        return out, ratios, cpu


def attach_layouts(entries: dict[str, PlanEntry], table_path: str | Path, gpu: str, use_ray: bool
                   ) -> tuple[dict[str, PlanEntry], dict[str, float], float]:
    """Every entry's layout, solved in parallel Ray tasks (or here, in turn), saved next to
    ``table_path``: (entries with their ``layout_ref``, reserved / lower bound per entry, CPU
    seconds the solves took)."""
    wave = LayoutWave(table_path, gpu, use_ray)
    wave.submit(entries)
    out, ratios, cpu = wave.collect()
    return {k: out[k] for k in entries}, ratios, cpu
