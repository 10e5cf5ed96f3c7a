"""The batching policy chosen by measurement (``xema_ray.scheduling.batch_key``): ``by_key`` (a batch
takes one key only) against ``mixed`` (a batch takes every guidance of its step count, one sub-batch
per guidance, priced as it runs), on the simulator and live on the emulated reference box.

The load: the emulated box's Flux.2 group (plans/a6000x8.json: 4 emulated A6000s, SP 2; time_scale
50), open-loop Poisson arrivals over its templates uniformly (the paper's default mix): the
templates planned at a batch above one (256², 512², 768²: batches of 3, 2, 2), where the policy
decides anything, and, simulated, all six (1024², 1280², 2048² run alone whatever the policy). Each request's guidance is drawn from ``GUIDANCE_MIX``:
most requests leave the model's default (Flux.2-dev: 4.0, sent as no ``guidance_scale``), a
minority ask for one of three other values — the shape of a UI's presets or of a few clients
tuning their prompts, not a uniform spread (every request its own value would make both policies
run batches of one).

The simulated half: ``xema_ray.sim.simulate`` first over a rate sweep (both policies; where they
part), then on each live run's recorded arrivals (the times the requests were actually sent, with
their guidance), charged what the live run measured outside the plan, as ``bench_emulated.py``
does: each request's front end (its latency minus its time in the model group) and the median
batch overhead (a sub-batch's worker time minus its planned latency).

The live half: the app served on the emulated box (``deployments.emulated_box``, only the Flux.2
group), once per policy (``models[].batching``), a warm-up request per template first.

    PYTHONPATH=. python bench/bench_batch_key.py --out bench/results/batch_key.json
    PYTHONPATH=. python bench/bench_batch_key.py --sim-only   # the sweep alone, in seconds
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, Field

from bench.bench_emulated import _box_args
from bench.scenarios.open_loop import Outcome, drive
from deployments.emulated_box import start_box, stop_box
from xema_ray.net import free_port
from xema_ray.plan import PlanTable
from xema_ray.runtime.emulated import scale_table
from xema_ray.scheduling.batch_key import BatchPolicy
from xema_ray.serving.config import ServeConfig
from xema_ray.sim.simulate import Arrival, SimResult, SimulationConfig, poisson_arrivals, simulate, template_weights
from xema_ray.templates import RequestTemplate

ROOT = Path(__file__).resolve().parents[1]
MODEL = "flux2"
TIME_SCALE = 50.0
POLICIES: tuple[BatchPolicy, ...] = ("by_key", "mixed")
#: guidance_scale -> share of requests (None: the model's default, no guidance_scale sent)
GUIDANCE_MIX: dict[float | None, float] = {None: 0.7, 2.5: 0.1, 3.5: 0.1, 5.0: 0.1}
#: the sweep's rates (requests per minute on the reference box) per template set
SWEEP = {"batched": (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0), "all": (0.3, 0.45, 0.6, 0.75, 0.9)}


class PolicyRun(BaseModel):
    policy: BatchPolicy
    sent: int
    lost: int = Field(description="requests without a successful answer")
    live_attainment: float
    live_goodput_rpm: float = Field(description="reference-box requests per minute that met their SLO (live)")
    simulated_attainment: float = Field(description="the simulator on the recorded arrivals, each request charged "
                                        "its measured front end")
    simulated_goodput_rpm: float
    frontend_overhead_s: float = Field(description="mean latency - time in the model group (emulated s)")
    batch_overhead_s: float = Field(description="median sub-batch time - planned latency (emulated s)")
    mean_batch_size: float = Field(description="requests per sub-batch, live")
    outcomes: list[Outcome] = Field(default_factory=list, description="every live request as the client saw it")
    guidance: dict[str, float | None] = Field(default_factory=dict, description="request id -> its guidance_scale")


class SweepPoint(BaseModel):
    templates: str = Field(description="batched: the templates planned at a batch above one; all: the six")
    rate_req_per_min: float = Field(description="reference box")
    attainment: dict[str, float]
    goodput_rpm: dict[str, float]


class Result(BaseModel):
    model: str
    time_scale: float
    guidance_mix: dict[str, float]
    rate_req_per_min: float = Field(description="the live runs' rate on the reference box (the batched templates)")
    duration_s: float = Field(description="seconds of arrivals per live run (emulated clock)")
    sweep: list[SweepPoint]
    runs: list[PolicyRun]
    machine: str
    wall_s: float


def _table(args: dict) -> tuple[PlanTable, dict[str, RequestTemplate]]:
    cfg = ServeConfig.model_validate(args)
    from deployments.planning import load_or_plan
    from xema_ray.serving.startup import served_templates

    templates = {t.shape_key: t for t in served_templates(cfg) if t.model == MODEL}
    reference, _ = load_or_plan(cfg, list(templates.values()))
    table = scale_table(reference, {MODEL: TIME_SCALE})
    return table.model_copy(update={
        "entries": {k: e for k, e in table.entries.items() if k in templates},
        "group_gpus": {MODEL: table.group_gpus[MODEL]},
        "residency": {k: v for k, v in table.residency.items() if k == MODEL}}), templates


def arrivals(templates: dict[str, RequestTemplate], rate_ref: float, duration_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals on the emulated clock (``rate_ref`` per minute on the reference box), templates
    uniform, guidance drawn from ``GUIDANCE_MIX``."""
    w = template_weights({k: t.latent_length for k, t in templates.items()}, "uniform")
    rng = random.Random(seed + 7)
    values, shares = list(GUIDANCE_MIX), list(GUIDANCE_MIX.values())
    return [a.model_copy(update={"guidance_scale": rng.choices(values, shares)[0]})
            for a in poisson_arrivals(rate_ref * TIME_SCALE, duration_s, w, seed=seed)]


def _planned(table: PlanTable, key: str, n: int) -> float:
    p = table.entries[key].prediction
    return p.latency_by_batch.get(n, p.latency_s)


def _sim(table: PlanTable, arrs: list[Arrival], policy: BatchPolicy, front: dict[str, float] | None = None,
         batch_over: float = 0.0) -> SimResult:
    return simulate(table, arrs, SimulationConfig(batching=policy, request_overhead_s=front,
                                                  batch_latency=lambda k, n: _planned(table, k, n) + batch_over))


def batched(table: PlanTable, templates: dict[str, RequestTemplate]) -> dict[str, RequestTemplate]:
    """The templates planned at a batch above one: the only ones a batching policy changes."""
    return {k: t for k, t in templates.items() if table.entries[k].config.batch > 1}


def sweep(table: PlanTable, templates: dict[str, RequestTemplate], duration_s: float) -> list[SweepPoint]:
    """Both policies on the simulator over ``SWEEP`` (3 seeds each, ideal front end)."""
    out = []
    for name, rate in [(n, r) for n, rates in SWEEP.items() for r in rates]:
        keys = batched(table, templates) if name == "batched" else templates
        att: dict[str, float] = {}
        good: dict[str, float] = {}
        for policy in POLICIES:
            runs = [_sim(table, arrivals(keys, rate, duration_s, seed), policy) for seed in (1, 2, 3)]
            att[policy] = statistics.fmean(r.attainment for r in runs)
            good[policy] = statistics.fmean(r.goodput_rpm for r in runs) / TIME_SCALE
        out.append(SweepPoint(templates=name, rate_req_per_min=rate, attainment=att, goodput_rpm=good))
        print(f"{name} rate {rate:g}/min: " + "  ".join(f"{p} {100 * att[p]:.1f} % ({good[p]:.2f}/min)" for p in POLICIES),
              flush=True)
    return out


def _start(box: dict, port: int, attempts: int = 3) -> None:
    """The box started; on a loaded machine Serve's proxy may miss its start-up timeout: again, from scratch."""
    for attempt in range(1, attempts + 1):
        try:
            start_box(box, port=port)
            return
        except Exception as e:  # noqa: BLE001 - Ray's actor errors: retried, the last one raised
            print(f"box start {attempt} failed ({type(e).__name__}); load {os.getloadavg()}", flush=True)
            stop_box()
            if attempt == attempts:
                raise


def _live(args: dict, policy: BatchPolicy, arrs: list[Arrival], templates: dict[str, RequestTemplate]) -> list[Outcome]:
    box = {**args, "models": [{**g, "batching": policy} for g in args["models"]]}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        _start(box, port)
        warm = [Arrival(t=0.05 * i, template=k, request_id=f"warm{i}") for i, k in enumerate(sorted(templates))]
        asyncio.run(drive(base, warm, templates))
        return asyncio.run(drive(base, arrs, templates))
    finally:
        stop_box()


def compare(table: PlanTable, policy: BatchPolicy, arrs: list[Arrival], outcomes: list[Outcome],
            duration_s: float) -> PolicyRun:
    """A live run's figures beside the simulator's on its recorded arrivals."""
    done = [o for o in outcomes if o.latency_s is not None]
    met = sum(1 for o in done if o.latency_s <= table.entries[o.template].prediction.slo_s)  # type: ignore[operator]
    own = {o.request_id: o.latency_s - o.group_s for o in done if o.group_s is not None}  # type: ignore[operator]
    batches = {(o.template, o.batch_s): (o.batch_s - _planned(table, o.template, o.batch_size), o.batch_size)
               for o in done if o.batch_s is not None and o.batch_size is not None}
    batch_over = statistics.median(v for v, _ in batches.values()) if batches else 0.0
    guidance = {a.request_id: a.guidance_scale for a in arrs}
    recorded = [Arrival(t=o.t_sent, template=o.template, request_id=o.request_id, guidance_scale=guidance[o.request_id])
                for o in sorted(outcomes, key=lambda o: o.t_sent)]
    sim = _sim(table, recorded, policy, own, batch_over)
    per_min = 60.0 / duration_s / TIME_SCALE
    return PolicyRun(policy=policy, sent=len(outcomes), lost=len(outcomes) - len(done),
                     live_attainment=met / len(outcomes) if outcomes else 0.0, live_goodput_rpm=met * per_min,
                     simulated_attainment=sim.attainment, simulated_goodput_rpm=sim.met * per_min,
                     frontend_overhead_s=statistics.fmean(own.values()) if own else 0.0, batch_overhead_s=batch_over,
                     mean_batch_size=statistics.fmean(n for _, n in batches.values()) if batches else 0.0,
                     outcomes=outcomes, guidance=guidance)


def markdown(result: Result) -> str:
    rows = ["| policy | sent | lost | live attainment | simulated | live - sim (pp) | live goodput (req/min) "
            "| simulated goodput | requests per call (live) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result.runs:
        rows.append(f"| {r.policy} | {r.sent} | {r.lost} | {100 * r.live_attainment:.1f} % | "
                    f"{100 * r.simulated_attainment:.1f} % | {100 * (r.live_attainment - r.simulated_attainment):+.1f} | "
                    f"{r.live_goodput_rpm:.2f} | {r.simulated_goodput_rpm:.2f} | {r.mean_batch_size:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/batch_key.json")
    ap.add_argument("--config", type=Path, default=ROOT / "deployments/xema-a6000x8-emulated.yaml")
    ap.add_argument("--rate", type=float, default=2.5, help="the live runs' requests per minute on the reference box")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per live run (emulated clock)")
    ap.add_argument("--sweep-duration", type=float, default=300.0, help="seconds of arrivals per simulated sweep point")
    ap.add_argument("--sim-only", action="store_true", help="the simulated sweep alone (no live runs)")
    ap.add_argument("--resimulate", action="store_true", help="no live run: the simulated half again on the "
                    "outcomes --out recorded (its live figures unchanged)")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    args = _box_args(a.config, Path(tempfile.mkdtemp(prefix="xema-batch-key-")))
    args["models"] = [{**g, "time_scale": TIME_SCALE} for g in args["models"] if g["model"] == MODEL]
    table, templates = _table(args)
    if a.resimulate:
        old = Result.model_validate_json(a.out.read_text())
        runs = [compare(table, r.policy, [Arrival(t=o.t_sent, template=o.template, request_id=o.request_id,
                                                  guidance_scale=r.guidance[o.request_id]) for o in r.outcomes],
                        r.outcomes, old.duration_s) for r in old.runs]
        result = old.model_copy(update={"runs": runs})
        a.out.write_text(result.model_dump_json() + "\n")
        print(markdown(result))
        return
    points = sweep(table, templates, a.sweep_duration)
    runs: list[PolicyRun] = []
    if not a.sim_only:
        arrs = arrivals(batched(table, templates), a.rate, a.duration, seed=11)
        for policy in POLICIES:
            t0 = time.monotonic()
            run = compare(table, policy, arrs, _live(args, policy, arrs, templates), a.duration)
            runs.append(run)
            print(f"{policy}: live {100 * run.live_attainment:.1f} % sim {100 * run.simulated_attainment:.1f} % "
                  f"(sent {run.sent}, lost {run.lost}) in {time.monotonic() - t0:.0f} s", flush=True)
    result = Result(model=MODEL, time_scale=TIME_SCALE, guidance_mix={str(k): v for k, v in GUIDANCE_MIX.items()},
                    rate_req_per_min=a.rate, duration_s=a.duration, sweep=points, runs=runs,
                    machine=f"{platform.node()} {os.cpu_count()} CPUs", wall_s=time.monotonic() - t_start)
    if runs:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(result.model_dump_json() + "\n")
        print(markdown(result))
        print(f"wrote {a.out} ({result.wall_s:.0f} s)")


if __name__ == "__main__":
    main()
