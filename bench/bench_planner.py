"""Planner benchmark (issue #6): plan the paper's templates for 8× RTX A6000 48 GB with the cost
model, and compare with exhaustive grid search over the same space.

Reports wall time and candidates profiled for Xema (Ray tasks, cold trace cache) and for grid
search (per-template time limit), whether the chosen plans match grid search's best goodput where
grid search finished, and the plans chosen for LTX-2 (the paper's Figure 1).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from planner.baselines import SearchSpace, run_baseline
from planner.driver import PlanOptions, TemplateResult, plan_all
from planner.latency import LatencyModel
from planner.trace_model import TracePlannerModel
from planner.traces import TraceCache
from xema_ray.memory.analysis import parse_bytes
from xema_ray.templates import RequestTemplate, paper_templates


def _grid_picks(templates: list[RequestTemplate], spec: str) -> list[RequestTemplate]:
    """"flux2,cogvideox-5b:1280x720x49,..." — a model name takes all its templates."""
    out = []
    for item in spec.split(","):
        out += [t for t in templates if t.model == item or t.shape_key.startswith(item.replace(":", "/"))]
    return out


def _grid_row(job: tuple[str, TemplateResult, str, int, int, float]) -> dict:
    template_json, xr, cache_dir, budget, gpus, time_limit = job
    t = RequestTemplate.model_validate_json(template_json)
    if xr.slo_s is None:
        return {"template": t.shape_key, "finished": False, "note": "no feasible configuration (Xema)"}
    model = TracePlannerModel(t, LatencyModel("a6000").seconds, TraceCache(Path(cache_dir)))
    space = SearchSpace(gpus=gpus, budget=budget, slo_s=xr.slo_s, max_batch=8)
    g0 = time.perf_counter()
    entry, counted, finished = run_baseline("grid", model, t, space, time_limit_s=time_limit)
    xe = xr.entry
    return {
        "template": t.shape_key, "finished": finished, "seconds": time.perf_counter() - g0,
        "profiled": len(counted.counter.profiled), "xema_profiled": xr.profiled,
        "grid_goodput_rpm": entry.prediction.goodput_rps * 60 if entry else 0.0,
        "xema_goodput_rpm": xe.prediction.goodput_rps * 60 if xe else 0.0,
        "grid_plan": entry.config.describe() if entry else None, "xema_plan": xe.config.describe() if xe else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/planner.json"))
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--budget", default="48GB")
    ap.add_argument("--grid-time-limit", type=float, default=600.0, help="seconds per template for grid search")
    # the video templates first: they run to the time limit, the Flux.2 ones fill the other core
    ap.add_argument("--grid-templates",
                    default="ltx2,cogvideox-5b,flux2",
                    help="templates grid search runs on: model names or MODEL:WxHxF, comma-separated")
    ap.add_argument("--trace-cache", default=None, help="reuse traces (default: a fresh, cold cache)")
    args = ap.parse_args()
    templates = paper_templates()
    cache_dir = args.trace_cache or tempfile.mkdtemp(prefix="xema-traces-")
    budget = parse_bytes(args.budget)
    opts = PlanOptions(hardware="a6000", budget=budget, gpus=args.gpus, slo_scale=1.0, max_batch=8, planner="xema",
                       trace_cache=cache_dir, time_limit_s=None, profile_store=None)
    t0 = time.perf_counter()
    results = plan_all(templates, opts, use_ray=True)
    xema_wall = time.perf_counter() - t0
    xema_profiled = sum(r.profiled for r in results)
    import ray

    ray.shutdown()  # the grid runs in plain processes; free the planning workers

    # grid search over the same space, template by template in parallel processes (its wall time
    # is not the claim; its candidate count and best goodput are), with a time limit each
    picks = _grid_picks(templates, args.grid_templates)
    jobs = [(t.model_dump_json(), next(r for r in results if r.template == t.shape_key), cache_dir, budget,
             args.gpus, args.grid_time_limit) for t in picks]
    grid_rows = []
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(_grid_row, job): job for job in jobs}
        for fut in as_completed(futures):
            try:
                row = fut.result()
            except Exception as e:  # e.g. a worker killed for memory: record it, keep the others
                key = RequestTemplate.model_validate_json(futures[fut][0]).shape_key
                row = {"template": key, "finished": False, "note": f"grid search failed: {type(e).__name__}: {e}"}
            print(row, flush=True)
            grid_rows.append(row)
    order = {t.shape_key: i for i, t in enumerate(templates)}
    grid_rows.sort(key=lambda r: order[r["template"]])
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
    data = {"machine": machine, "xema_wall_s": xema_wall, "xema_profiled": xema_profiled,
            "xema": [r.model_dump(mode="json") for r in results], "grid": grid_rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))

    print(f"\nmachine: {machine}\n")
    print(f"Xema: {len(templates)} templates in {xema_wall:.0f} s (cold trace cache, Ray tasks), {xema_profiled} candidates profiled\n")
    print("| template | Xema plan | latency s | goodput /min | peak GB | profiled |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if r.entry is None:
            print(f"| {r.template} | infeasible | | | | {r.profiled} |")
            continue
        e = r.entry
        print(f"| {r.template} | {e.config.describe()} | {e.prediction.latency_s:.1f} | "
              f"{e.prediction.goodput_rps * 60:.2f} | {e.prediction.peak_bytes / 1e9:.1f} | {r.profiled} |")
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
