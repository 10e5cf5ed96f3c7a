"""Wan2.2-T2V-A14B's expert switch under a 48 GB budget: the planned switch against offloading the
whole inactive expert every request, on the reference box (RTX A6000 48 GB, 25 GB/s host link).

The trace is the analyzer's (meta device, exact bytes); latencies are the roofline cost model's
(an estimate) and the copies are priced at the hardware profile's host-link bandwidth. On 2 and 4
GPUs every split is priced: one request sequence-parallel over all of them (SP = GPUs), or one
GPU per request with the group serving 2 or 4 at once (replicas), or in between; the planner
keeps the best goodput (no SLO here), and each split's row is written.

Example:
    python bench/bench_expert_switch.py --out bench/results/expert_switch.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from xema_ray.profiling.hardware import get_hardware
from xema_ray.templates import RequestTemplate

from xema_ray.analyzer.run import trace_template

from planner.expert_switch import describe, expert_switch_plans, plan_expert_switch

GB = 10**9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--budget-gb", type=float, default=48.0)
    args = p.parse_args()
    hw = get_hardware("a6000x8")
    rows = []
    for height, width in ((480, 832), (720, 1280)):
        t = RequestTemplate(model="wan2.2-t2v-a14b", height=height, width=width, frames=81, steps=40)
        trace = trace_template(t)
        for gpus in (1, 2, 4):
            t0 = time.perf_counter()
            (best,) = expert_switch_plans([t], int(args.budget_gb * GB), hw, {}, gpus, traces={t.key: trace})
            elapsed = time.perf_counter() - t0
            print(describe(best))
            for sp in [s for s in (1, 2, 4) if gpus % s == 0]:
                plan = plan_expert_switch(t, trace, int(args.budget_gb * GB), hw, gpus=sp)
                replicas = gpus // sp
                chosen, base = plan.cost(plan.chosen), plan.cost("offload_whole_expert")
                rows.append({"template": t.key, "gpus": gpus, "sp": sp, "replicas": replicas,
                             "kept": sp == best.gpus, "chosen": plan.chosen,
                             "latency_s": round(chosen.latency_s, 2), "baseline_latency_s": round(base.latency_s, 2),
                             "stall_s": round(chosen.stall_s, 3), "baseline_stall_s": round(base.stall_s, 3),
                             "peak_gb": round(chosen.peak_bytes / GB, 2), "live_peak_gb":
                             round((chosen.live_peak_bytes or 0) / GB, 2), "both_experts_peak_gb":
                             round(plan.cost("hold_both").peak_bytes / GB, 2),
                             "prefetch_gb": round(chosen.prefetch_bytes / GB, 2),
                             "prefetch_blocks": chosen.prefetch_blocks, "decode_blocks": chosen.decode_blocks,
                             "goodput_per_hour": round(3600 * replicas / chosen.latency_s, 3),
                             "baseline_goodput_per_hour": round(3600 * replicas / base.latency_s, 3),
                             "plan_s": round(elapsed, 1)})
    result = {"machine": platform.node(), "python": platform.python_version(), "hardware": hw.name,
              "budget_gb": args.budget_gb, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
