"""Discrete-event simulation of the serving runtime (paper §9) driven by a plan table.

Requests arrive (Poisson, or a recorded trace), are queued and batched by the very
``Dispatcher`` the live ModelGroup uses, and each batch takes the plan's predicted latency
(profile store or cost model). A request meets its SLO when it finishes within
``slo_scale × base SLO`` of its arrival; a template with no plan (infeasible for that planner)
fails every request, as an OOM would.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from typing import cast

from pydantic import BaseModel, Field

from xema_ray.plan import PlanTable
from xema_ray.serving.dispatcher import Dispatcher, DispatchPlan


class Arrival(BaseModel):
    """One request of an arrival trace (seconds from the start)."""

    t: float = Field(ge=0)
    template: str = Field(description="RequestTemplate.shape_key")
    request_id: str = ""


class TemplateStats(BaseModel):
    sent: int = 0
    met: int = 0
    failed: int = 0
    latencies_s: list[float] = Field(default_factory=list)


class SimResult(BaseModel):
    """Outcome of one simulated run."""

    duration_s: float
    sent: int
    met: int
    failed: int = Field(description="requests for templates the plan table cannot serve")
    attainment: float = Field(description="share of requests finishing within their SLO")
    goodput_rpm: float = Field(description="requests per minute finishing within their SLO")
    per_template: dict[str, TemplateStats]


def base_slos(table: PlanTable) -> dict[str, float]:
    """Each planned template's SLO at scale 1 (the table stores it at its planning scale)."""
    return {k: e.prediction.slo_s / table.slo_scale for k, e in table.entries.items()}


def template_weights(latencies: dict[str, float], mix: str, alpha: float = 1.0) -> dict[str, float]:
    """Sampling weights: uniform, or the skewed mix of Figure 10 (p_i ∝ exp(α L_i / L_max))."""
    if mix == "uniform":
        return {k: 1.0 for k in latencies}
    if mix == "skewed":
        top = max(latencies.values())
        return {k: math.exp(alpha * v / top) for k, v in latencies.items()}
    raise ValueError(f"unknown mix {mix!r}; use 'uniform' or 'skewed'")


def poisson_arrivals(rate_per_min: float, duration_s: float, weights: dict[str, float], seed: int = 0) -> list[Arrival]:
    """Open-loop Poisson arrivals with templates drawn by ``weights``."""
    if rate_per_min <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate_per_min}/min for {duration_s} s")
    rng = random.Random(seed)
    keys = sorted(weights)
    w = [weights[k] for k in keys]
    out, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(rate_per_min / 60.0)
        if t >= duration_s:
            return out
        out.append(Arrival(t=t, template=rng.choices(keys, w)[0], request_id=f"r{i}"))
        i += 1


def simulate(
    table: PlanTable,
    arrivals: Sequence[Arrival],
    slo_scale: float = 1.0,
    slos: dict[str, float] | None = None,
    wait_window_s: float = 0.05,
    batch_latency: Callable[[str, int], float] | None = None,
) -> SimResult:
    """Run ``arrivals`` through the table's plans on ``table.gpus`` workers.

    Args:
        slos: base SLO per template (default: from the table); requests of templates missing
            from the table still need an SLO to count (they fail).
        batch_latency: ``(template, n) -> seconds`` for a batch of n (default: the plan's
            predicted latency for its full batch, whatever n — a partial batch is never faster
            in the model, which keeps the simulation conservative).
    """
    slos = dict(slos or base_slos(table))
    plans = {
        k: DispatchPlan(batch=e.config.batch, sp=e.config.sp, slo_s=slos[k] * slo_scale, latency_s=e.prediction.latency_s)
        for k, e in table.entries.items()
    }
    disp: Dispatcher[None] = Dispatcher(plans, workers=table.gpus, wait_window_s=wait_window_s, max_queue=10**9)
    stats: dict[str, TemplateStats] = {}
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, data: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    for a in arrivals:
        push(a.t, "arrival", a)
    end = max((a.t for a in arrivals), default=0.0)
    wakes: set[float] = set()
    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrival":
            data = cast(Arrival, data)
            st = stats.setdefault(data.template, TemplateStats())
            st.sent += 1
            if data.template not in plans:
                st.failed += 1
            else:
                disp.submit(data.template, data.request_id, now)
        elif kind == "done":
            a = disp.complete(int(data))  # type: ignore[arg-type]
            for r in a.requests:
                st = stats[r.template]
                lat = now - r.arrival
                st.latencies_s.append(lat)
                st.met += lat <= r.deadline - r.arrival + 1e-9
            end = max(end, now)
        elif kind == "wake":
            wakes.discard(now)
        for a in disp.dispatch(now):
            dur = batch_latency(a.template, len(a.requests)) if batch_latency else a.plan.latency_s
            push(now + dur, "done", a.batch_id)
        wake = disp.next_wakeup(now)
        if wake is not None and wake > now and wake not in wakes:
            wakes.add(wake)
            push(wake, "wake", None)
    sent = sum(s.sent for s in stats.values())
    met = sum(s.met for s in stats.values())
    duration = max((a.t for a in arrivals), default=0.0) or 1.0
    return SimResult(
        duration_s=end, sent=sent, met=met, failed=sum(s.failed for s in stats.values()),
        attainment=met / sent if sent else 0.0, goodput_rpm=met / duration * 60.0, per_template=stats,
    )
