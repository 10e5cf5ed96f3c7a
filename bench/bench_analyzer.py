"""Analyzer benchmark: whole-request shape-only analysis of real-size templates on this CPU.

Claim checked (issue #2): CogVideoX-5B 1280x720x49 with 50 steps analyses in <= 10 s on the
2-core machine. Writes JSON (--out) and prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from xema_ray.memory.analysis import summarize
from xema_ray.analyzer.run import trace_template
from xema_ray.templates import RequestTemplate

CASES = [
    dict(model="cogvideox-5b", height=720, width=1280, frames=49, steps=50),
    dict(model="cogvideox-5b", height=480, width=720, frames=49, steps=50),
    dict(model="flux2", height=1024, width=1024, steps=50),
    dict(model="ltx2", height=704, width=1280, frames=49, steps=50),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/analyzer.json"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=48e9)
    args = ap.parse_args()
    rows = []
    for case in CASES:
        t = RequestTemplate(**case)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            trace = trace_template(t)
            times.append(time.perf_counter() - t0)
        s = summarize(trace, int(args.budget))
        rows.append({
            "template": t.key, "seconds_min": min(times), "seconds_median": sorted(times)[len(times) // 2],
            "allocations": len(trace), "events": trace.n_events, "peak_gb": s.peak_bytes / 1e9,
            "weights_gb": s.weight_bytes / 1e9, "activations_at_peak_gb": s.activation_bytes_at_peak / 1e9,
            "peak_phase": s.peak_phase, "pressure_intervals_48gb": len(s.pressure_intervals),
            "pressure_event_pct": 100 * s.pressure_event_fraction,
        })
        print(f"{t.key}: {min(times):.2f} s", flush=True)
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    print(f"\nmachine: {machine}\n")
    print("| template | analysis time (min / median of %d) | allocations | peak GB | weights GB | activations at peak GB | peak in | intervals > 48 GB | events > 48 GB |" % args.repeats)
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['template']} | {r['seconds_min']:.1f} s / {r['seconds_median']:.1f} s | {r['allocations']:,} | "
              f"{r['peak_gb']:.2f} | {r['weights_gb']:.2f} | {r['activations_at_peak_gb']:.2f} | {r['peak_phase']} | "
              f"{r['pressure_intervals_48gb']} | {r['pressure_event_pct']:.2f}% |")


if __name__ == "__main__":
    main()
