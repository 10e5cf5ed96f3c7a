"""A decode stage of its own on the reference box, simulated: the planner's choice (``--stages
auto``) against every decode in place (``joint``, the default) and a pool wherever one fits
(``split``), at a loaded rate.

Each video group of ``deployments/xema-a6000x8.yaml`` (the groups ``plans/a6000x8.json`` is planned
for: CogVideoX-5B and LTX-2 on 2 GPUs each, RTX A6000 48 GB) is planned three times with the cost
model (``planner.pipeline.plan``, no layouts: the simulator reads latencies), at the templates' own
50 steps and at 8 steps (the few-step regime, where the decode is a larger share of a request).
The rate is ``--load`` x the in-place plans' capacity (uniform mix over the group's templates);
``auto`` is planned for that rate (each template's share of it, as ``--load`` hands the planner:
both sides simulated there). Each table then serves the same Poisson arrivals in the simulator
(``xema_ray.sim``: the serving dispatcher in virtual time; a pooled template runs as two stages with
the same dispatcher code), 3 seeds.

Example:
    python bench/bench_decode_stage.py --out bench/results/decode_stage.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from xema_ray.plan import PlanTable
from xema_ray.sim.simulate import SimulationConfig, poisson_arrivals, simulate

from planner.cli import ROOT, deployment_groups
from planner.driver import PlanOptions
from planner.pipeline import PlanRequest, plan

DEPLOYMENT = ROOT / "deployments/xema-a6000x8.yaml"
STAGES = ("joint", "split", "auto")
SEEDS = (0, 1, 2)


def tables(steps: int, load: float, box: str) -> dict[str, PlanTable]:
    """The video groups' tables at ``steps`` denoising steps, one per ``--stages`` (``auto`` planned
    for ``load`` x each group's in-place capacity). ``box``: ``reference`` (the deployment's groups)
    or ``8-gpu`` (each model on all eight GPUs, as ``xema plan --gpus 8`` plans it)."""
    group_gpus, served, _ = deployment_groups(DEPLOYMENT)
    video = tuple(t.with_(steps=steps) for t in served if t.spec.decode_components())
    opts = PlanOptions(hardware="a6000", budget=48 * 10**9, gpus=sum(group_gpus.values()),
                       group_gpus=group_gpus if box == "reference" else {}, measure="never", text_encoder="plan")
    out = {s: plan(PlanRequest(video, opts.model_copy(update={"stages": s}), layouts=False, use_ray=False)).table
           for s in ("joint", "split")}
    rates = {}
    for model in {t.model for t in video}:
        g = group_table(out["joint"], model)
        for k in g.entries:
            rates[k] = load * capacity_per_min(g) / 60 / len(g.entries)
    loaded = opts.model_copy(update={"stages": "auto", "template_loads": rates})
    out["auto"] = plan(PlanRequest(video, loaded, layouts=False, use_ray=False)).table
    return out


def group_table(table: PlanTable, model: str) -> PlanTable:
    return table.model_copy(update={"entries": {k: e for k, e in table.entries.items()
                                                if e.config.template.model == model}})


def capacity_per_min(table: PlanTable) -> float:
    """Requests/min a group's plans serve under a uniform mix (each template at its plan's goodput)."""
    g = [e.prediction.goodput_rps for e in table.entries.values()]
    return 0.0 if min(g) <= 0 else 60.0 / statistics.mean(1 / x for x in g)


def run(steps: int, load: float, horizon: int, box: str) -> list[dict[str, object]]:
    planned = tables(steps, load, box)
    rows = []
    for model in sorted({e.config.template.model for e in planned["joint"].entries.values()}):
        per = {s: group_table(planned[s], model) for s in STAGES}
        rate = load * capacity_per_min(per["joint"])
        mean_latency = statistics.mean(e.prediction.latency_s for e in per["joint"].entries.values())
        duration = horizon * mean_latency
        for s in STAGES:
            t = per[s]
            results = [simulate(t, poisson_arrivals(rate, duration, {k: 1.0 for k in t.entries}, seed=seed),
                                SimulationConfig()) for seed in SEEDS]
            lat = sorted(x for r in results for st in r.per_template.values() for x in st.latencies_s)
            rows.append({
                "box": box, "steps": steps, "model": model, "stages": s, "rate_per_min": round(rate, 3),
                "plans": {k: e.config.describe() for k, e in t.entries.items()},
                "choices": {k: d.stage for k, d in t.provenance.decode_stages.items() if k in t.entries},
                "reasons": {k: d.reason for k, d in t.provenance.decode_stages.items() if k in t.entries},
                "capacity_per_min": round(capacity_per_min(t), 3),
                "attainment": round(statistics.mean(r.attainment for r in results), 4),
                "goodput_per_min": round(statistics.mean(r.goodput_rpm for r in results), 3),
                "p50_s": round(lat[len(lat) // 2], 1) if lat else None,
                "p90_s": round(lat[int(len(lat) * 0.9)], 1) if lat else None,
                "sent": sum(r.sent for r in results),
            })
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--load", type=float, default=0.8, help="arrival rate as a share of the in-place capacity")
    p.add_argument("--runs", nargs="+", default=["reference:50", "reference:8", "8-gpu:4"],
                   help="BOX:STEPS, BOX one of reference (the deployment's 2-GPU video groups) and 8-gpu")
    p.add_argument("--horizon", type=int, default=300, help="simulated duration in mean in-place latencies")
    args = p.parse_args()
    t0 = time.perf_counter()
    runs = [(box, int(steps)) for box, steps in (x.split(":") for x in args.runs)]
    rows = [r for box, steps in runs for r in run(steps, args.load, args.horizon, box)]
    print(f"{'box':<9} {'steps':>5} {'model':<14} {'stages':<6} {'rate/min':>9} {'capacity':>9} {'attain':>7} {'goodput':>8} "
          f"{'p50 s':>7} {'p90 s':>7}  plans")
    for r in rows:
        print(f"{r['box']:<9} {r['steps']:>5} {r['model']:<14} {r['stages']:<6} {r['rate_per_min']:>9} {r['capacity_per_min']:>9} "
              f"{r['attainment']:>7.1%} {r['goodput_per_min']:>8} {r['p50_s']!s:>7} {r['p90_s']!s:>7}  "
              f"{'; '.join(r['plans'].values())}")  # type: ignore[union-attr]
    for r in rows:
        if r["stages"] == "auto":
            for k, why in r["reasons"].items():  # type: ignore[union-attr]
                print(f"auto, {r['box']}, {r['steps']} steps, {k}: {why}")
    print(f"{time.perf_counter() - t0:.0f} s on {platform.machine()}, {platform.python_version()}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d", time.gmtime()), "load": args.load,
                                        "machine": "2-core CPU VM", "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
