"""Live versus simulated SLO attainment on the emulated reference box (``make bench-emulated``).

The live half: ``deployments/xema-a6000x8-emulated.yaml`` (8 emulated A6000s: Flux.2 on 4,
CogVideoX-5B on 2, LTX-2 on 2, plans/a6000x8.json) served by the real app on this machine
(``deployments.emulated_box``), preemption on (the YAML's ``max_preemptions``). For each of three
rates, Flux.2 and CogVideoX-5B get open-loop Poisson arrivals at the same time, each model's
templates uniformly mixed (the paper's default mix) at the rates of ``make figures`` (the paper's
rate axis × ``bench/results/figures.json``'s ``rate_scale``), on the emulated clock (rate ×
time_scale). Each group has its own time scale: Flux.2's requests take tens of seconds on the
reference box, CogVideoX-5B's up to hours.

The simulated half: ``xema_ray.sim.simulate`` on the recorded arrivals (the times the requests were
actually sent), the same scaled plans, dispatcher, preemption policy and wait window, charged what
the live run measured outside the plan: the front end (each request's latency minus its time in the
model group, ``X-Xema-Group-Seconds``), and the batch overhead (a batch's time in the group's worker
call, ``X-Xema-Batch-Seconds``, minus its planned latency: Ray's actor calls).

Writes ``--out`` (JSON: ``time_scale`` and ``points``) and a plot next to it.

    PYTHONPATH=. python bench/bench_emulated.py --out bench/results/emulated.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from bench.scenarios.open_loop import Outcome, drive
from deployments.emulated_box import read_deployment, start_box, stop_box
from xema_ray.net import free_port
from xema_ray.plan import PlanTable
from xema_ray.runtime.emulated import DEFAULT_HOST_BANDWIDTH, scale_table
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.group.preemption import ParkOverhead
from xema_ray.sim.simulate import Arrival, SimulationConfig, poisson_arrivals, simulate, template_weights
from xema_ray.templates import RequestTemplate

ROOT = Path(__file__).resolve().parents[1]
#: the paper's rate axis of ``make figures`` (bench/figures.py RATES), its three lowest rates per
#: model (the highest ones saturate the box: attainment near 0 on both sides tells nothing)
PAPER_RATES = {"flux2": (2.0, 5.0, 8.0), "cogvideox-5b": (0.1, 0.2, 0.3)}
#: figures' rates are for a model on 4 GPUs; a group of g GPUs gets g/4 of them (figures' "9-gpus")
FIGURES_GPUS = 4
TIME_SCALES = {"flux2": 100.0, "cogvideox-5b": 6000.0}


class Point(BaseModel):
    model: str
    rate_req_per_min: float = Field(description="on the reference box: paper rate x figures' rate_scale x the group's GPUs / 4")
    paper_rate_req_per_min: float
    emulated_rate_req_per_min: float = Field(description="what the emulated box received: rate x time_scale")
    time_scale: float
    live_attainment: float
    simulated_attainment: float = Field(description="the simulator on the recorded arrivals, each request charged its measured front end")
    simulated_attainment_mean_front_end: float | None = Field(default=None, description="the same, every request charged its template's mean front end")
    sent: int
    lost: int = Field(description="requests without a successful answer")
    frontend_overhead_s: float = Field(description="mean of latency - time in the model group (emulated s); the simulator "
                                                   "is charged its mean per template (frontend_overhead_by_template_s)")
    frontend_overhead_by_template_s: dict[str, float]
    frontend_overhead_p95_s: float
    batch_overhead_s: float = Field(description="median of batch time - planned latency (emulated s), added to every simulated batch")
    park_overhead_s: float = Field(default=0.0, description="median of the live preempting batches' wait for their victims "
                                   "to park beyond the dispatcher's prediction (the pause handshake, emulated s), charged "
                                   "to every simulated preemption")
    live_park_overheads: int = Field(default=0, description="preempting batches that measure went over")
    live_preemptions: int
    simulated_preemptions: int


class Result(BaseModel):
    time_scale: dict[str, float] = Field(description="per model group: reference seconds per emulated second")
    duration_s: float = Field(description="seconds of arrivals per rate (emulated clock)")
    machine: str
    load_avg_before: list[float]
    load_avg_after: list[float]
    wall_s: float
    points: list[Point]


def _rate_scale() -> dict[str, float]:
    return json.loads((ROOT / "bench/results/figures.json").read_text())["rate_scale"]


def _rate(model: str, i: int, scale: dict[str, float], table: PlanTable) -> float:
    """The reference box's req/min of ``model``'s i-th rate (figures' axis, scaled to its group's GPUs)."""
    return PAPER_RATES[model][i] * scale[model] * table.group_gpus[model] / FIGURES_GPUS


def _box_args(config: Path, jobs_dir: Path) -> dict:
    _, args = read_deployment(config)
    for g in args["models"]:
        if g["model"] in TIME_SCALES:
            g["time_scale"] = TIME_SCALES[g["model"]]
    args["jobs"] = {"backend": "sqlite", "path": str(jobs_dir)}
    return args


class _LivePreemption(BaseModel):
    """A model group's preemption counters as ``/v1/stats`` reports them."""

    decisions: int = 0
    park_overhead: ParkOverhead | None = None

    def since(self, before: _LivePreemption) -> tuple[int, list[float]]:
        """Decisions and park overheads (the pause handshakes) measured after ``before``."""
        po, pb = self.park_overhead, before.park_overhead
        new = (po.total - (pb.total if pb else 0)) if po else 0
        return self.decisions - before.decisions, (po.recent_s[-new:] if po and new > 0 else [])


def _live_preemptions(base: str) -> dict[str, _LivePreemption]:
    import urllib.request

    with urllib.request.urlopen(f"{base}/v1/stats", timeout=60) as r:
        stats = json.loads(r.read())
    return {m: _LivePreemption.model_validate(v) for m, v in stats.get("preemption", {}).items()}


def _planned(table: PlanTable, key: str, n: int) -> float:
    p = table.entries[key].prediction
    return p.latency_by_batch.get(n, p.latency_s)


def _point(model: str, paper_rate: float, rate: float, ts: float, table: PlanTable, outcomes: list[Outcome],
           host_bytes: int, max_preemptions: int, live_preempt: int, parks: list[float]) -> Point:
    sub = table.model_copy(update={
        "entries": {k: e for k, e in table.entries.items() if e.config.template.model == model},
        "group_gpus": {model: table.group_gpus[model]},
        "residency": {k: v for k, v in table.residency.items() if k == model}})
    mine = [o for o in outcomes if o.template in sub.entries]
    done = [o for o in mine if o.latency_s is not None]
    met = sum(1 for o in done if o.latency_s <= sub.entries[o.template].prediction.slo_s)  # type: ignore[operator]
    front = [o.latency_s - o.group_s for o in done if o.group_s is not None]  # type: ignore[operator]
    batches = {}
    for o in done:
        if o.batch_s is not None and o.batch_size is not None:
            batches[(o.template, o.batch_s)] = o.batch_s - _planned(sub, o.template, o.batch_size)
    overhead = statistics.fmean(front) if front else 0.0
    # per template: a video's bytes cost the front end more than a small image's
    per_template = {k: statistics.fmean(v) for k in sub.entries
                    if (v := [o.latency_s - o.group_s for o in done if o.template == k and o.group_s is not None])}  # type: ignore[operator]
    charged = {k: per_template.get(k, overhead) for k in sub.entries}
    batch_over = statistics.median(batches.values()) if batches else 0.0
    arrivals = [Arrival(t=o.t_sent, template=o.template, request_id=o.request_id) for o in sorted(mine, key=lambda o: o.t_sent)]
    own = {o.request_id: o.latency_s - o.group_s for o in done if o.group_s is not None}  # type: ignore[operator]

    park = statistics.median(parks) if parks else 0.0

    def run(per_request: dict[str, float] | None) -> Any:
        return simulate(sub, arrivals, SimulationConfig(
            overhead_s=charged, request_overhead_s=per_request, batch_latency=lambda k, n: _planned(sub, k, n) + batch_over,
            preemption=max_preemptions > 0, max_preemptions=max(1, max_preemptions), host_bytes=host_bytes,
            host_bandwidth=DEFAULT_HOST_BANDWIDTH * ts, park_overhead_s=park))
    # each request is charged the front end it measured (a loaded front end's tail, not only its
    # mean: near an SLO the tail decides); the per-template mean alone is reported beside it
    sim, sim_mean = run(own), run(None)
    return Point(model=model, rate_req_per_min=rate, paper_rate_req_per_min=paper_rate,
                 emulated_rate_req_per_min=rate * ts, time_scale=ts, live_attainment=met / len(mine) if mine else 0.0,
                 simulated_attainment=sim.attainment, simulated_attainment_mean_front_end=sim_mean.attainment, sent=len(mine), lost=len(mine) - len(done),
                 frontend_overhead_s=overhead, frontend_overhead_by_template_s=charged,
                 frontend_overhead_p95_s=sorted(front)[int(0.95 * (len(front) - 1))] if front else 0.0,
                 batch_overhead_s=batch_over, park_overhead_s=park, live_park_overheads=len(parks),
                 live_preemptions=live_preempt, simulated_preemptions=sim.preemptions)


def _plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({p.model for p in result.points})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6))
    for ax, m in zip(axes if len(models) > 1 else [axes], models, strict=True):
        pts = sorted((p for p in result.points if p.model == m), key=lambda p: p.rate_req_per_min)
        xs = [p.paper_rate_req_per_min for p in pts]
        ax.plot(xs, [100 * p.live_attainment for p in pts], "o-", label="live (emulated box)")
        ax.plot(xs, [100 * p.simulated_attainment for p in pts], "s--", label="simulated (same arrivals)")
        ax.set_title(f"{m} (time_scale {result.time_scale[m]:g})")
        ax.set_xlabel("paper's rate (req/min)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown_table(result: Result) -> str:
    """The points as the Markdown table of BENCHMARKS.md "Live vs simulated"."""
    rows = ["| model | paper rate (req/min) | reference box (req/min) | emulated (req/min) | sent | lost | live | simulated "
            "| live - sim (pp) | simulated, mean front end | front end (ms, mean / p95) | preemptions live / sim |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in result.points:
        rows.append(f"| {p.model} | {p.paper_rate_req_per_min:g} | {p.rate_req_per_min:.4g} | {p.emulated_rate_req_per_min:.3g} "
                    f"| {p.sent} | {p.lost} | {100 * p.live_attainment:.1f} % | {100 * p.simulated_attainment:.1f} % "
                    f"| {100 * (p.live_attainment - p.simulated_attainment):+.1f} "
                    f"| {100 * (p.simulated_attainment_mean_front_end or 0):.1f} % | {1000 * p.frontend_overhead_s:.0f} / "
                    f"{1000 * p.frontend_overhead_p95_s:.0f} | {p.live_preemptions} / {p.simulated_preemptions} |")
    return "\n".join(rows)


def resimulate(a: argparse.Namespace) -> None:
    """The simulated half again, on the outcomes a live run recorded (the live figures unchanged)."""
    old = Result.model_validate_json(a.out.read_text())
    cfg = ServeConfig.model_validate(_box_args(a.config, Path(tempfile.mkdtemp())))
    from deployments.planning import load_or_plan
    from xema_ray.serving.startup import paused_host_bytes, served_templates

    reference, spare = load_or_plan(cfg, served_templates(cfg))
    table = scale_table(reference, {g.model: cfg.time_scale_of(g.model) for g in cfg.models})
    max_pre = {g.model: g.max_preemptions for g in cfg.models}
    runs = [[Outcome.model_validate(o) for o in run] for run in json.loads(a.from_outcomes.read_text())]
    points = []
    for p in old.points:
        i = PAPER_RATES[p.model].index(p.paper_rate_req_per_min)
        parks = [p.park_overhead_s] * p.live_park_overheads  # their median, as the live run measured it
        q = _point(p.model, p.paper_rate_req_per_min, p.rate_req_per_min, p.time_scale, table, runs[i],
                   paused_host_bytes(spare, cfg), max_pre[p.model], p.live_preemptions, parks)
        if (q.live_attainment, q.sent, q.lost) != (p.live_attainment, p.sent, p.lost):
            raise ValueError(f"{a.from_outcomes} is not the run of {a.out} ({p.model} at {p.paper_rate_req_per_min})")
        points.append(q)
    result = old.model_copy(update={"points": points})
    a.out.write_text(result.model_dump_json(indent=1))
    _plot(result, a.out.with_suffix(".png"))
    print(markdown_table(result))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/emulated.json")
    ap.add_argument("--config", type=Path, default=ROOT / "deployments/xema-a6000x8-emulated.yaml")
    ap.add_argument("--duration", type=float, default=200.0, help="seconds of arrivals per rate (emulated clock)")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--rates", type=int, default=3, help="how many of the rates to run (from the lowest)")
    ap.add_argument("--models", nargs="+", default=list(TIME_SCALES), choices=list(TIME_SCALES))
    ap.add_argument("--outcomes", type=Path, default=None, help="also write every request's outcome here (JSON)")
    ap.add_argument("--from-outcomes", type=Path, default=None,
                    help="no live run: simulate again the outcomes a live run recorded (--outcomes), keeping --out's live figures")
    a = ap.parse_args(argv)
    if a.from_outcomes is not None:
        resimulate(a)
        return
    t_start = time.monotonic()
    load_before = list(os.getloadavg())
    scale = _rate_scale()
    jobs = Path(tempfile.mkdtemp(prefix="xema-emu-bench-"))
    args = _box_args(a.config, jobs)
    cfg = ServeConfig.model_validate(args)
    from deployments.planning import load_or_plan
    from xema_ray.serving.startup import paused_host_bytes, served_templates

    templates = {t.shape_key: t for t in served_templates(cfg)}
    reference, spare = load_or_plan(cfg, list(templates.values()))
    host_bytes = paused_host_bytes(spare, cfg)
    table = scale_table(reference, {g.model: cfg.time_scale_of(g.model) for g in cfg.models})
    max_pre = {g.model: g.max_preemptions for g in cfg.models}
    port = a.port or free_port()
    base = f"http://127.0.0.1:{port}"
    start_box(args, port=port)
    print(f"box ready after {time.monotonic() - t_start:.0f} s", flush=True)
    points: list[Point] = []
    recorded: list[list[dict]] = []
    try:
        # one request per template first: every path warm before anything is measured
        warm = [Arrival(t=0.05 * i, template=k, request_id=f"warm{i}")
                for i, k in enumerate(k for k in sorted(templates) if templates[k].model in a.models)]
        asyncio.run(drive(base, warm, templates))
        before = _live_preemptions(base)
        for i in range(a.rates):
            arrivals: list[Arrival] = []
            for m in a.models:
                keys = [k for k, t in templates.items() if t.model == m]
                w = template_weights({k: templates[k].latent_length for k in keys}, "uniform")
                rate = _rate(m, i, scale, reference) * TIME_SCALES[m]
                arrivals += [x.model_copy(update={"request_id": f"{m}-{i}-{x.request_id}"})
                             for x in poisson_arrivals(rate, a.duration, w, seed=100 + i)]
            arrivals.sort(key=lambda x: x.t)
            t0 = time.monotonic()
            outcomes = asyncio.run(drive(base, arrivals, templates))
            after = _live_preemptions(base)
            recorded.append([o.model_dump() for o in outcomes])
            for m in a.models:
                decided, parks = after.get(m, _LivePreemption()).since(before.get(m, _LivePreemption()))
                p = _point(m, PAPER_RATES[m][i], _rate(m, i, scale, reference), TIME_SCALES[m], table, outcomes,
                           host_bytes, max_pre[m], decided, parks)
                points.append(p)
                print(f"{m} paper rate {p.paper_rate_req_per_min}: live {100 * p.live_attainment:.1f} % sim "
                      f"{100 * p.simulated_attainment:.1f} % (sent {p.sent}, lost {p.lost}, front end "
                      f"{p.frontend_overhead_s * 1000:.0f} ms, batch +{p.batch_overhead_s * 1000:.0f} ms, park "
                      f"+{p.park_overhead_s * 1000:.0f} ms, preemptions "
                      f"{p.live_preemptions}/{p.simulated_preemptions}) in {time.monotonic() - t0:.0f} s", flush=True)
            before = after
    finally:
        stop_box()
    result = Result(time_scale={m: TIME_SCALES[m] for m in a.models}, duration_s=a.duration,
                    machine=f"{platform.node()} {os.cpu_count()} CPUs", load_avg_before=load_before,
                    load_avg_after=list(os.getloadavg()), wall_s=time.monotonic() - t_start, points=points)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(result.model_dump_json(indent=1))
    _plot(result, a.out.with_suffix(".png"))
    if a.outcomes is not None:
        a.outcomes.write_text(json.dumps(recorded))
    print(markdown_table(result))
    print(f"wrote {a.out} ({result.wall_s:.0f} s, load {load_before} -> {result.load_avg_after})")


if __name__ == "__main__":
    main()
