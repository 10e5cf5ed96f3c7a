"""What a reused (step-cached) denoising step costs, in process, and the fast tier's ratio priced
with it as ``planner.tiers`` prices it (``docs/quality.md`` "Planning"): tiny-flux2 128x128 at
50 steps through ``ExecutionEngine.run_pipeline``, lossless, ``fast`` and every step after the
first reused (``REUSE_ALL``, what calibration times), interleaved, ``--reps`` of each, medians;
one torch thread by default (a descheduled second thread stalls whole regions on a shared box).
Wall-clock figures (the share) mean something on a quiet machine only; the CPU-time ratio and
its pricing (``priced_ratio_cpu``: the saving of a skipped step from lossless - all-reused) hold
on a loaded one.

    python -m bench.bench_step_reuse [--reps 7] [--threads 1] [--out bench/results/step-reuse.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from xema_ray.measure.profiler import REUSE_ALL
from xema_ray.models import BuildOptions
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.engine import ExecutionEngine
from xema_ray.templates import RequestTemplate
from xema_ray.tier_plan import DEFAULT_TIERS
from xema_ray.vocabulary import Phase


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t = RequestTemplate(model="tiny-flux2", height=128, width=128, steps=a.steps)
    pipe = t.spec.build_pipeline(BuildOptions(device="cpu", dtype=torch.float32))
    engine = ExecutionEngine(pipe, t.spec, torch.device("cpu"), torch.float32)
    fast = DEFAULT_TIERS["fast"].cache
    configs = {"lossless": ExecutionConfig(template=t), "fast": ExecutionConfig(template=t, step_cache=fast),
               "reuse_all": ExecutionConfig(template=t, step_cache=REUSE_ALL)}
    for c in configs.values():  # the first calls pay one-off costs
        engine.run_pipeline(c, ["warm-up"], [0], output_type="np", steps=a.steps)
    load = os.getloadavg()[0]
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in configs}
    for i in range(a.reps):
        for name, c in configs.items():
            gc.collect()
            gc.disable()
            w0, c0 = time.perf_counter(), time.process_time()
            phases = engine.run_pipeline(c, ["a red fox in the snow"], [100 + i], output_type="np", steps=a.steps).phases
            runs[name].append((time.perf_counter() - w0, time.process_time() - c0, phases[Phase.DENOISE]))
            gc.enable()
    med = {k: [statistics.median(r[j] for r in v) for j in range(3)] for k, v in runs.items()}
    n, c = a.steps, fast.computed_steps(a.steps)
    step = med["lossless"][2] / n
    reused = (med["reuse_all"][2] - step) / (n - 1)
    other = med["lossless"][0] - med["lossless"][2]
    priced = (other + c * step + (n - c) * reused) / med["lossless"][0]
    at_zero = (other + c * step) / med["lossless"][0]
    # in CPU time (robust on a loaded machine): lossless - reuse_all = (n - 1) skipped steps' saving
    saved_cpu = (med["lossless"][1] - med["reuse_all"][1]) / (n - 1)
    priced_cpu = (med["lossless"][1] - (n - c) * saved_cpu) / med["lossless"][1]
    out = {"template": t.key, "steps": n, "computed": c, "reps": a.reps, "threads": a.threads,
           "load_average_start": round(load, 2), "load_average_end": round(os.getloadavg()[0], 2),
           "median_wall_s": {k: round(v[0], 4) for k, v in med.items()},
           "median_cpu_s": {k: round(v[1], 4) for k, v in med.items()},
           "step_s": round(step, 5), "reused_step_s": round(reused, 5), "reused_step_share": round(reused / step, 3),
           "ratio_wall": round(med["fast"][0] / med["lossless"][0], 3),
           "ratio_cpu": round(med["fast"][1] / med["lossless"][1], 3),
           "priced_ratio": round(priced, 3), "priced_ratio_cpu": round(priced_cpu, 3), "priced_ratio_reuse_free": round(at_zero, 3), "runs": runs}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
