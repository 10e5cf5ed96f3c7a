"""Step-level preemption: SLO attainment with and without it, simulated on the reference box, and
a short request's latency behind long ones, measured through the Serve app on this CPU.

simulated: the CogVideoX-5B model group of ``plans/a6000x8.json`` (``make plan``: 2 A6000s, DP 2),
short 720p×49 and long 1080p×65 / 1080p×81 requests, Poisson arrivals at the paper's CogVideoX
rate (0.2 req/min) and at rates the group can carry (the cost model's latencies put its capacity
near 0.011 req/min for this mix: at 0.2 it is ~18× overloaded), half of them short, cost-model latencies from the plan
table, each entry's pause bytes from its trace (``planner.pause_state``), the same simulator and
Dispatcher policy as ``xema simulate`` and the live group.

live: one tiny-cogvideox worker on this CPU, two long requests (200 steps) and a short one
0.5 s later (``bench/scenarios/preemption.py``), with ``max_preemptions`` 2 and 0 (off).
The tiny models' seconds hide what preemption buys at the paper's scale, so ``live_emulated`` asks
the same of the emulated reference box (``docs/emulated.md``): CogVideoX-5B's 2 A6000s busy with
two 1080p x 81 requests (6.6 h planned), a 720p x 49 one (36 min) arriving after them.

Example:
    PYTHONPATH=. python bench/bench_preemption.py --out bench/results/preemption.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from planner.pause_state import with_pause_bytes
from planner.traces import TraceCache
from xema_ray.plan import PlanTable
from xema_ray.sim.simulate import SimulationConfig, poisson_arrivals, simulate

ROOT = Path(__file__).resolve().parents[1]
SHORT = "cogvideox-5b/1280x720x49"
LONGS = ("cogvideox-5b/1920x1088x65", "cogvideox-5b/1920x1088x81")
PAPER_RATE = 0.2  # req/min, the paper's default CogVideoX-5B rate (§9.1)


def cogvideox_table(path: Path) -> PlanTable:
    table = PlanTable.load(str(path))
    cache = TraceCache()
    entries = {k: with_pause_bytes(table.entries[k], cache) for k in (SHORT, *LONGS)}
    return table.model_copy(update={"entries": entries, "group_gpus": {"cogvideox-5b": table.group_gpus["cogvideox-5b"]},
                                    "residency": {k: v for k, v in table.residency.items() if k == "cogvideox-5b"}})


RATES = (0.002, 0.005, 0.01, PAPER_RATE)


def simulated(table: PlanTable, requests: int, seeds: int) -> dict:
    weights = {SHORT: 2.0, LONGS[0]: 1.0, LONGS[1]: 1.0}
    mean_s = sum(w * table.entries[k].prediction.latency_s for k, w in weights.items()) / sum(weights.values())
    workers = table.group_gpus["cogvideox-5b"]
    out: dict = {"rates": {}, "capacity_req_per_min": workers / mean_s * 60}
    for rate in RATES:
        runs = {"with_preemption": [], "without_preemption": []}
        hours = requests / (rate * 60)  # about ``requests`` arrivals per run at any rate
        for seed in range(seeds):
            arr = poisson_arrivals(rate, hours * 3600, weights, seed=seed)
            for name, on in (("with_preemption", True), ("without_preemption", False)):
                r = simulate(table, arr, SimulationConfig(preemption=on))
                short = r.per_template.get(SHORT)
                runs[name].append({"attainment": r.attainment, "sent": r.sent, "preemptions": r.preemptions,
                                   "short_attainment": short.met / short.sent if short and short.sent else None})
        out["rates"][str(rate)] = {
            name: {"attainment": sum(x["attainment"] for x in v) / len(v),
                   "short_attainment": sum(x["short_attainment"] or 0 for x in v) / len(v),
                   "preemptions": sum(x["preemptions"] for x in v) / len(v), "requests": sum(x["sent"] for x in v) / len(v)}
            for name, v in runs.items()}
    at_paper = out["rates"][str(PAPER_RATE)]
    out["with_preemption"], out["without_preemption"] = at_paper["with_preemption"], at_paper["without_preemption"]
    out["setup"] = {"requests_per_run": requests, "seeds": seeds, "rate_req_per_min": PAPER_RATE, "mix": weights,
                    "workers": table.group_gpus["cogvideox-5b"],
                    "latency_s": {k: table.entries[k].prediction.latency_s for k in weights},
                    "slo_s": {k: table.entries[k].prediction.slo_s for k in weights},
                    "pause_bytes": {k: table.entries[k].prediction.pause_bytes for k in weights}}
    return out


def live() -> dict:
    from deployments.planning import machine_fingerprint
    from bench.scenarios import preemption as sc
    from xema_ray.serving.config import ServeConfig

    latency = sc.measure_latencies()
    table = sc.plan_table(latency, machine_fingerprint(ServeConfig.model_validate(sc.serve_args(2)), 1))
    trace = sc.arrivals(latency)
    runs = {}
    for name, bound in (("with", 2), ("without", 0)):
        runs[name] = sc.run_live(table, trace, Path(tempfile.mkdtemp()), max_preemptions=bound)
    short = next(a.request_id for a in trace if a.template == sc.SHORT.shape_key)
    longs = [a.request_id for a in trace if a.template == sc.LONG.shape_key]
    return {
        "short_latency_with_s": runs["with"].latencies_s[short],
        "short_latency_without_s": runs["without"].latencies_s[short],
        "long_latency_with_s": [runs["with"].latencies_s[r] for r in longs],
        "long_latency_without_s": [runs["without"].latencies_s[r] for r in longs],
        "decisions_with": runs["with"].decisions,
        "simulated_decisions": sc.simulated_decisions(table, trace),
        "measured_batch_latency_s": latency, "short_slo_s": table.entries[sc.SHORT.shape_key].prediction.slo_s,
        "arrivals": [a.model_dump() for a in trace], "stats_with": runs["with"].stats,
    }


#: the emulated box's clock for CogVideoX-5B: a 1080p x 81 request (23,702 s planned) takes 5.9 s
EMULATED_SCALE = 4000.0
EMULATED_LONG = "cogvideox-5b/1920x1088x81"


def live_emulated(plan_table: Path, time_scale: float = EMULATED_SCALE) -> dict:
    """The same question on the emulated reference box (docs/emulated.md), where the requests are
    the paper's, minutes to hours long: CogVideoX-5B's group of 2 emulated A6000s, both busy with a
    1080p x 81 request, and a 720p x 49 one arriving 1 s (emulated) later, with preemption
    (max_preemptions 2) and without (0); two apps on one box, the simulator on the same arrivals."""
    import asyncio

    from bench.scenarios.open_loop import drive
    from deployments.emulated_box import serve_app, start_box, stop_box
    from xema_ray.net import free_port
    from xema_ray.runtime.emulated import DEFAULT_HOST_BANDWIDTH, scale_table
    from xema_ray.sim.simulate import Arrival
    from xema_ray.templates import RequestTemplate

    def args(bound: int) -> dict:
        return {"device": "emulated", "time_scale": time_scale, "plan_table": str(plan_table),
                "jobs": {"backend": "sqlite", "path": tempfile.mkdtemp(prefix="xema-pre-")},
                "models": [{"model": "cogvideox-5b", "workers": 2, "max_preemptions": bound,
                            "templates": [{"width": 1280, "height": 720, "frames": 49},
                                          {"width": 1920, "height": 1088, "frames": 81}]}]}

    templates = {t.shape_key: t for t in (RequestTemplate(model="cogvideox-5b", width=1280, height=720, frames=49),
                                          RequestTemplate(model="cogvideox-5b", width=1920, height=1088, frames=81))}
    trace = [Arrival(t=0.0, template=EMULATED_LONG, request_id="long0"),
             Arrival(t=0.1, template=EMULATED_LONG, request_id="long1"),
             Arrival(t=1.0, template=SHORT, request_id="short")]
    port = free_port()
    start_box(args(2), port=port, num_gpus=4, app_name="with")
    out: dict = {"time_scale": time_scale, "arrivals": [a.model_dump() for a in trace]}
    try:
        serve_app(args(0), "without", "/without")
        for name, base in (("with", f"http://127.0.0.1:{port}"), ("without", f"http://127.0.0.1:{port}/without")):
            # a warm path first (the first request of each template pays start-up costs)
            asyncio.run(drive(base, [Arrival(t=0.0, template=k, request_id=f"w{i}") for i, k in enumerate(templates)],
                              templates))
            got = {o.request_id: o for o in asyncio.run(drive(base, trace, templates))}
            out[name] = {rid: o.latency_s for rid, o in got.items()}
            out[f"{name}_sent_at"] = {rid: o.t_sent for rid, o in got.items()}
    finally:
        stop_box()
    ref = PlanTable.load(str(plan_table))
    table = scale_table(ref, time_scale)
    table = table.model_copy(update={"entries": {k: table.entries[k] for k in templates},
                                     "group_gpus": {"cogvideox-5b": 2},
                                     "residency": {k: v for k, v in table.residency.items() if k == "cogvideox-5b"}})
    recorded = [Arrival(t=out["with_sent_at"][a.request_id], template=a.template, request_id=a.request_id) for a in trace]
    for name, on in (("with", True), ("without", False)):
        r = simulate(table, recorded, SimulationConfig(preemption=on, host_bandwidth=DEFAULT_HOST_BANDWIDTH * time_scale))
        out[f"simulated_{name}"] = {k: v.latencies_s for k, v in r.per_template.items()}
        out[f"simulated_{name}_preemptions"] = r.preemptions
    out["short_slo_s"] = table.entries[SHORT].prediction.slo_s
    out["long_slo_s"] = table.entries[EMULATED_LONG].prediction.slo_s
    out["planned_s"] = {k: table.entries[k].prediction.latency_s for k in templates}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in result["simulated"]["rates"] if float(r) != PAPER_RATE]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for i, name in enumerate(("without_preemption", "with_preemption")):
        vals = [result["simulated"]["rates"][r][name]["attainment"] * 100 for r in rates]
        ax1.bar([j + 0.38 * i for j in range(len(rates))], vals, width=0.38, label=name.replace("_", " "))
    ax1.set_xticks([j + 0.19 for j in range(len(rates))], [f"{r}/min" for r in rates])
    ax1.set_ylabel("SLO attainment (%)")
    ax1.set_title("CogVideoX-5B group, 2× A6000 (simulated)")
    ax1.legend(fontsize=8)
    lv = result["live"]
    ax2.bar(["without", "with"], [lv["short_latency_without_s"], lv["short_latency_with_s"]], color=["C0", "C1"])
    ax2.axhline(lv["short_slo_s"], color="k", ls="--", lw=1, label="short SLO")
    ax2.set_ylabel("short request latency (s)")
    ax2.set_title("tiny-cogvideox on CPU (live)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-table", type=Path, default=ROOT / "plans/a6000x8.json")
    ap.add_argument("--requests", type=int, default=300, help="arrivals per simulated run (about)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--skip-live", action="store_true")
    ap.add_argument("--skip-emulated", action="store_true", help="skip the emulated reference box's live run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/preemption.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result: dict = {"machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs",
                    "date": time.strftime("%Y-%m-%d")}
    result["simulated"] = simulated(cogvideox_table(args.plan_table), args.requests, args.seeds)
    if not args.skip_live:
        result["live"] = live()
        plot(result, args.out.with_suffix(".png"))
    if not args.skip_emulated:
        result["live_emulated"] = live_emulated(args.plan_table)
    result["seconds"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    sim = result["simulated"]
    for rate, r in sim["rates"].items():
        print(f"simulated (CogVideoX-5B, {sim['setup']['workers']} A6000s, {rate} req/min): attainment with preemption "
              f"{r['with_preemption']['attainment']:.3f}, without {r['without_preemption']['attainment']:.3f}")
    if "live" in result:
        lv = result["live"]
        print(f"live (tiny-cogvideox, CPU): short request latency with preemption {lv['short_latency_with_s']:.2f} s, "
              f"without {lv['short_latency_without_s']:.2f} s")
    if "live_emulated" in result:
        em = result["live_emulated"]
        print(f"live (emulated 2x A6000, time_scale {em['time_scale']:g}): 720p latency with preemption "
              f"{em['with']['short']:.2f} s, without {em['without']['short']:.2f} s (SLO {em['short_slo_s']:.2f} s; "
              f"simulated {em['simulated_with'][SHORT][0]:.2f} / {em['simulated_without'][SHORT][0]:.2f} s)")
    print(f"wrote {args.out} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
