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

``xema plan`` does this for every entry by default (``--no-layouts`` skips it), after the group
residencies and text encoders are placed (both change the worker's stream), as a second wave of
Ray tasks on the planning workers (their imports and model specs are warm): one task per entry,
in parallel. The solve is deterministic (a layout's id is its content hash), so ``xema layouts``
rebuilds a table's layout files exactly from the table alone.
"""

from __future__ import annotations

import time
from pathlib import Path

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


def attach_layouts(entries: dict[str, PlanEntry], table_path: str | Path, gpu: str, use_ray: bool
                   ) -> tuple[dict[str, PlanEntry], dict[str, float], float]:
    """Every entry's layout, solved in parallel Ray tasks (or here, in turn), saved next to
    ``table_path``: (entries with their ``layout_ref``, reserved / lower bound per entry, CPU
    seconds the solves took)."""
    folder = layouts_dir(table_path)
    keys = sorted(entries, key=lambda k: entries[k].config.template.latent_length, reverse=True)  # longest first
    if use_ray:
        import ray

        task = ray.remote(num_gpus=0, max_calls=0)(solve_one)
        refs = {k: task.remote(entries[k].model_dump_json(), gpu, str(folder)) for k in keys}
        done = {k: ray.get(r) for k, r in refs.items()}
    else:
        done = {k: solve_one(entries[k].model_dump_json(), gpu, str(folder)) for k in keys}
    out, ratios, cpu = dict(entries), {}, 0.0
    folder.mkdir(parents=True, exist_ok=True)
    for k, (art_json, _, cpu_s) in done.items():
        art = LayoutArtifact.model_validate_json(art_json)
        (folder / f"{art.layout_id}.json").write_text(art_json)  # as save_artifact writes it, not dumped again
        out[k], ratios[k] = with_layout(entries[k], art)
        cpu += cpu_s
    return {k: out[k] for k in entries}, ratios, cpu
