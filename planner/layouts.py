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
"""

from __future__ import annotations

from pathlib import Path

from xema_ray.plan import PlanEntry
from xema_ray.allocator.margins import reserved_with_layout
from xema_ray.runtime.layouts import layouts_dir, save_artifact, solve_entry_layout


def attach_layout(entry: PlanEntry, table_path: str | Path, gpu: str) -> tuple[PlanEntry, float]:
    """``entry`` with its layout solved, saved and referenced; and the layout's reserved / lower bound."""
    folder = layouts_dir(table_path)
    # GPU-only allocations recorded on this GPU model (folder/device-allocs/<gpu>.json) go in first
    art = solve_entry_layout(entry.config, gpu, folder)
    save_artifact(art, folder)
    peak = reserved_with_layout(art.loaded_bytes, art.reserved_bytes, art.dynamic_fraction)
    cfg = entry.config.model_copy(update={"layout_ref": art.layout_id})
    pred = entry.prediction.model_copy(update={"peak_bytes": peak})
    ratio = art.reserved_bytes / max(1, art.layout.lower_bound_bytes)
    return entry.model_copy(update={"config": cfg, "prediction": pred}), ratio
