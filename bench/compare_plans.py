"""Check that two plan tables choose the same plans: per template the same configuration (SP,
DP, batch, every mitigation with its blocks / modules / intensity, text-encoder placement), the
same predicted peak, latency and goodput, runner-up and candidate count; and the same group
residencies. Used to check that planner speed-ups leave plans unchanged (issue #16, item 3):

    python bench/compare_plans.py bench/results/planner-reference-main.json plans/new.json

Exit status 0 when every entry matches, 1 otherwise (each difference printed). Floats match
within ``--rel`` (default 0: bit for bit).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from xema_ray.plan import PlanTable


def _close(a: float, b: float, rel: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


def compare(ref: PlanTable, new: PlanTable, rel: float = 0.0, ignore_layouts: bool = False) -> list[str]:
    """Differences between two plan tables, one line each (empty: same plans). ``ignore_layouts``:
    the static layouts' own fields (``layout_ref``, and the peak the layout sets) are not compared."""
    diffs: list[str] = []
    for k in sorted(set(ref.entries) | set(new.entries)):
        a, b = ref.entries.get(k), new.entries.get(k)
        if a is None or b is None:
            diffs.append(f"{k}: planned in {'new' if a is None else 'reference'} only")
            continue
        if ignore_layouts:
            a = a.model_copy(update={"config": a.config.model_copy(update={"layout_ref": None})})
            b = b.model_copy(update={"config": b.config.model_copy(update={"layout_ref": None})})
        if a.config != b.config:
            diffs.append(f"{k}: configuration {a.config.describe()} (text encoder {a.config.text_encoder}) "
                         f"-> {b.config.describe()} (text encoder {b.config.text_encoder})")
        pa, pb = a.prediction, b.prediction
        for name in ("peak_bytes", "latency_s", "goodput_rps", "slo_s")[int(ignore_layouts):]:
            va, vb = getattr(pa, name), getattr(pb, name)
            if not _close(float(va), float(vb), rel):
                diffs.append(f"{k}: {name} {va} -> {vb}")
        if pa.latency_source != pb.latency_source:
            diffs.append(f"{k}: latency_source {pa.latency_source} -> {pb.latency_source}")
        if set(pa.latency_by_batch) != set(pb.latency_by_batch) or any(
                not _close(pa.latency_by_batch[n], pb.latency_by_batch[n], rel) for n in pa.latency_by_batch):
            diffs.append(f"{k}: latency_by_batch {pa.latency_by_batch} -> {pb.latency_by_batch}")
        if a.runner_up != b.runner_up:
            diffs.append(f"{k}: runner-up {a.runner_up!r} -> {b.runner_up!r}")
        if a.candidates_profiled != b.candidates_profiled:
            diffs.append(f"{k}: candidates profiled {a.candidates_profiled} -> {b.candidates_profiled}")
    for model in sorted(set(ref.residency) | set(new.residency)):
        if ref.residency.get(model) != new.residency.get(model):
            diffs.append(f"residency {model}: {ref.residency.get(model)} -> {new.residency.get(model)}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rel", type=float, default=0.0, help="relative tolerance on floats (default: exact)")
    ap.add_argument("--only-new", action="store_true", help="compare only the templates the new table plans")
    ap.add_argument("--ignore-layouts", action="store_true",
                    help="leave out layout_ref and the predicted peak (the static layout sets it)")
    args = ap.parse_args(argv)
    ref, new = PlanTable.load(args.reference), PlanTable.load(args.new)
    if args.only_new:
        # a group's residency depends on all its templates: not comparable on a subset
        ref = ref.model_copy(update={"entries": {k: v for k, v in ref.entries.items() if k in new.entries},
                                     "residency": {}})
        new = new.model_copy(update={"residency": {}})
    diffs = compare(ref, new, args.rel, args.ignore_layouts)
    for d in diffs:
        print(d)
    print(f"{len(new.entries)} entries compared with {len(ref.entries)}: "
          f"{'same plans' if not diffs else f'{len(diffs)} differences'}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
