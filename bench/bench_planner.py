"""Planner benchmark (issue #6): plan the paper's templates for 8× RTX A6000 48 GB with the cost
model, and compare with exhaustive grid search over the same space.

Reports wall time and candidates profiled for Xema (Ray tasks, cold trace cache) and for grid
search (per-template time limit), whether the chosen plans match grid search's best goodput where
grid search finished, and the plans chosen for LTX-2 (the paper's Figure 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from planner.baselines import SearchSpace, run_baseline
from planner.cli import _run_all
from planner.latency import LatencyModel
from planner.trace_model import TracePlannerModel
from planner.traces import TraceCache
from xema_ray.memory.analysis import parse_bytes
from xema_ray.plan import PlanEntry
from xema_ray.templates import paper_templates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/planner.json"))
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--budget", default="48GB")
    ap.add_argument("--grid-time-limit", type=float, default=60.0, help="seconds per template for grid search")
    ap.add_argument("--grid-templates", type=int, default=6, help="how many templates grid search is run on")
    ap.add_argument("--trace-cache", default=None, help="reuse traces (default: a fresh, cold cache)")
    args = ap.parse_args()
    templates = paper_templates()
    cache_dir = args.trace_cache or tempfile.mkdtemp(prefix="xema-traces-")
    budget = parse_bytes(args.budget)
    opts = {"hardware": "a6000", "budget": budget, "gpus": args.gpus, "slo_scale": 1.0, "max_batch": 8,
            "planner": "xema", "trace_cache": cache_dir, "time_limit_s": None, "profile_store": None}
    t0 = time.perf_counter()
    results = _run_all(templates, opts, use_ray=True)
    xema_wall = time.perf_counter() - t0
    xema_profiled = sum(r["profiled"] for r in results)

    # grid search over the same space, on a spread of templates, with a time limit each
    latency = LatencyModel("a6000")
    cache = TraceCache(Path(cache_dir))
    picks = templates[:: max(1, len(templates) // args.grid_templates)][: args.grid_templates]
    grid_rows = []
    for t in picks:
        xr = next(r for r in results if r["template"] == t.shape_key)
        if xr["slo_s"] is None:
            grid_rows.append({"template": t.shape_key, "finished": False, "note": "no feasible configuration (Xema)"})
            continue
        model = TracePlannerModel(t, latency.seconds, cache)
        space = SearchSpace(gpus=args.gpus, budget=budget, slo_s=xr["slo_s"], max_batch=8)
        g0 = time.perf_counter()
        entry, counted, finished = run_baseline("grid", model, t, space, time_limit_s=args.grid_time_limit)
        xe = PlanEntry.model_validate_json(xr["entry"]) if xr["entry"] else None
        grid_rows.append({
            "template": t.shape_key, "finished": finished, "seconds": time.perf_counter() - g0,
            "profiled": len(counted.counter.profiled), "xema_profiled": xr["profiled"],
            "grid_goodput_rpm": entry.prediction.goodput_rps * 60 if entry else 0.0,
            "xema_goodput_rpm": xe.prediction.goodput_rps * 60 if xe else 0.0,
            "grid_plan": entry.config.describe() if entry else None, "xema_plan": xe.config.describe() if xe else None,
        })
        print(grid_rows[-1], flush=True)
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
    data = {"machine": machine, "xema_wall_s": xema_wall, "xema_profiled": xema_profiled, "xema": results, "grid": grid_rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))

    print(f"\nmachine: {machine}\n")
    print(f"Xema: {len(templates)} templates in {xema_wall:.0f} s (cold trace cache, Ray tasks), {xema_profiled} candidates profiled\n")
    print("| template | Xema plan | latency s | goodput /min | peak GB | profiled |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if r["entry"] is None:
            print(f"| {r['template']} | infeasible | | | | {r['profiled']} |")
            continue
        e = PlanEntry.model_validate_json(r["entry"])
        print(f"| {r['template']} | {e.config.describe()} | {e.prediction.latency_s:.1f} | "
              f"{e.prediction.goodput_rps * 60:.2f} | {e.prediction.peak_bytes / 1e9:.1f} | {r['profiled']} |")
    print("\n| template | grid finished | grid s | grid profiled | Xema profiled | ratio | grid goodput | Xema goodput |")
    print("|---|---|---|---|---|---|---|---|")
    for g in grid_rows:
        if "profiled" not in g:
            print(f"| {g['template']} | – | | | | | | {g['note']} |")
            continue
        ratio = g["profiled"] / max(1, g["xema_profiled"])
        print(f"| {g['template']} | {'yes' if g['finished'] else 'no (time limit)'} | {g['seconds']:.0f} | {g['profiled']} | "
              f"{g['xema_profiled']} | {ratio:.0f}× | {g['grid_goodput_rpm']:.2f} | {g['xema_goodput_rpm']:.2f} |")


if __name__ == "__main__":
    main()
