"""Stage 5: a static layout per plan entry, written next to the plan table (paper §6).

Each chosen configuration's layout is solved from the serving worker's own allocation stream
for that configuration (its mitigations and text-encoder placement applied:
``xema_ray.runtime.layouts.solve_entry_layout``), saved as ``<table>.layouts/<layout_id>.json``
and named by the entry's ``layout_ref``. The entry's predicted peak becomes what the static
allocator will hold: the weights the worker places at load, plus the solved static region, plus
the dynamic region (``DEFAULT_DYNAMIC_FRACTION`` of it) — the solver's number, not a constant
overhead.
"""

from __future__ import annotations

import math
from pathlib import Path

from xema_ray.plan import PlanEntry
from xema_ray.runtime.allocator import DEFAULT_DYNAMIC_FRACTION
from xema_ray.runtime.layouts import layouts_dir, save_artifact, solve_entry_layout


def attach_layout(entry: PlanEntry, table_path: str | Path, gpu: str) -> tuple[PlanEntry, float]:
    """``entry`` with its layout solved, saved and referenced; and the layout's reserved / lower bound."""
    art = solve_entry_layout(entry.config, gpu)
    save_artifact(art, layouts_dir(table_path))
    peak = art.loaded_bytes + art.reserved_bytes + math.ceil(art.reserved_bytes * DEFAULT_DYNAMIC_FRACTION)
    cfg = entry.config.model_copy(update={"layout_ref": art.layout_id})
    pred = entry.prediction.model_copy(update={"peak_bytes": peak})
    ratio = art.reserved_bytes / max(1, art.layout.lower_bound_bytes)
    return entry.model_copy(update={"config": cfg, "prediction": pred}), ratio
