"""Replica choice and autoscaling decisions for a replicated model group: pure functions over
the replicas' published summaries (``replica_summary``), used by the request router
(``replica_router``) and by the Serve autoscaling policy (``SloAutoscalingPolicy`` below).

* ``choose_replica``: the replica whose dispatcher predicts the earliest completion of the
  request, preferring those that meet its SLO; summaries older than ``max_age_s`` rank last.
* ``decide_replicas``: add replicas when the predicted attainment over the next window falls
  below the target (as many as the window's work needs, at least one); remove one when the
  others can absorb its queue and arrivals and still meet the target (plus a margin, so the
  decision does not flap); otherwise keep the count.

Serve's autoscaler hands a policy only numbers per replica, so a summary travels as flat
metrics (``summary_metrics`` / ``summary_from_metrics``, lossless up to the deadlines kept).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xema_ray.plan import ReplicaStart

from xema_ray.serving.scale.replica_summary import (
    MAX_DEADLINES,
    Attainment,
    PlanBrief,
    ReplicaSummary,
    RunningBatch,
    TemplateQueue,
    predict_attainment,
    predict_completion,
)


#: how long a request to a group scaled to zero is held when the plan predicts no start: a replica's
#: start (a Ray actor, its workers, imports, the weights from the node's host copy, docs/serving.md
#: "Scale to zero"); with a prediction, three times its warm start, at least ``MIN_WAKE_TIMEOUT_S``
WAKE_TIMEOUT_S = 120.0
MIN_WAKE_TIMEOUT_S = 30.0


class AutoscalingSpec(BaseModel):
    """A model group's autoscaling (the YAML's ``autoscaling:``); replicas stay within the bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=1, ge=0, description="replicas kept however idle; 0: the group scales to zero "
                                                            "when idle and the first request wakes it")
    max_replicas: int = Field(default=4, ge=1, description="replicas at most (each needs `workers` GPUs)")
    target_attainment: float = Field(default=0.9, gt=0, le=1,
                                     description="add a replica when predicted attainment falls below this")
    window_s: float = Field(default=60.0, gt=0, description="how far ahead the arrivals are predicted (seconds)")
    scale_down_margin: float = Field(default=0.05, ge=0, le=1,
                                     description="remove a replica only when the others stay this far above target")
    upscale_delay_s: float = Field(default=0.0, ge=0, description="how long a scale-up decision must hold")
    downscale_delay_s: float = Field(default=30.0, ge=0, description="how long a scale-down decision must hold")
    metrics_interval_s: float = Field(default=1.0, gt=0, description="how often replicas publish their summary")
    wake_timeout_s: float | None = Field(
        default=None, gt=0, description="min_replicas 0: how long a request to the group at zero is held while a "
                                        "replica starts, before a 503 `waking` with Retry-After; None: three times the "
                                        "plan's predicted warm start, at least 30 s (120 s without one)")

    def wake_timeout(self, start: ReplicaStart | None) -> float:
        """``wake_timeout_s``, else from the plan table's predicted warm start of the group's replica."""
        if self.wake_timeout_s is not None:
            return self.wake_timeout_s
        return max(MIN_WAKE_TIMEOUT_S, 3 * start.warm_s) if start is not None else WAKE_TIMEOUT_S

    @property
    def scales_to_zero(self) -> bool:
        return self.min_replicas == 0

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling: max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        return self


# ---------------------------------------------------------------------------- replica choice
class Choice(BaseModel):
    """The ranked replicas for one request, best first, with their predicted completions."""

    order: list[str]
    completion_s: dict[str, float]
    within_slo: bool


def choose_replica(summaries: Mapping[str, ReplicaSummary | None], template: str, now: float,
                   sent_since: Mapping[str, Mapping[str, int]] | None = None, max_age_s: float = 10.0) -> Choice:
    """Rank replicas (by id) for a request of ``template``: predicted completion within the SLO
    first, earliest first; then the rest, earliest first; replicas without a fresh summary last
    (in the order given: the caller rotates them)."""
    sent_since = sent_since or {}
    known, unknown = {}, []
    for rid, s in summaries.items():
        if s is None or s.age(now) > max_age_s or template not in s.plans:
            unknown.append(rid)
        else:
            known[rid] = predict_completion(s, template, now, sent_since.get(rid))
    slo = next((s.plans[template].slo_s for s in summaries.values() if s is not None and template in s.plans),
               math.inf)
    ranked = sorted(known, key=lambda r: (known[r] > slo, known[r]))
    return Choice(order=[*ranked, *unknown], completion_s=known,
                  within_slo=bool(ranked) and known[ranked[0]] <= slo)


# ---------------------------------------------------------------------------- scaling
class ScaleDecision(BaseModel):
    """What the autoscaler wants, and why."""

    replicas: int = Field(ge=0)
    action: Literal["up", "down", "hold"]
    attainment: float = Field(ge=0, le=1, description="predicted over the window with the current replicas")
    attainment_without: float | None = Field(default=None, description="predicted with one replica removed")
    reason: str


def _absorbed(summaries: Sequence[ReplicaSummary], removed: int) -> list[ReplicaSummary]:
    """The other replicas after ``removed``'s queue and arrivals are shared out among them (its
    running batches finish where they are: it drains)."""
    gone = summaries[removed]
    others = [s.model_copy(deep=True) for i, s in enumerate(summaries) if i != removed]
    n = len(others)
    for key, q in gone.queues.items():
        for i, s in enumerate(others):
            share = q.queued // n + (1 if i < q.queued % n else 0)
            mine = s.queues.get(key) or TemplateQueue(queued=0)
            deadlines = sorted([*mine.deadlines_s, *q.deadlines_s[i::n]])[:MAX_DEADLINES]
            s.queues[key] = mine.model_copy(update={
                "queued": mine.queued + share, "deadlines_s": deadlines,
                "oldest_wait_s": max(mine.oldest_wait_s, q.oldest_wait_s),
                "arrival_rate": mine.arrival_rate + q.arrival_rate / n})
    return others


def _spread(summaries: Sequence[ReplicaSummary], k: int) -> list[ReplicaSummary]:
    """``k`` replicas sharing the running ones' queues and arrivals evenly (``k`` >= their count):
    the running ones keep their running batches, the added ones start idle."""
    base = summaries[0]
    out = [s.model_copy(deep=True) for s in summaries]
    out += [base.model_copy(update={"replica": f"new-{i}", "queues": {}, "running": [], "draining": False},
                            deep=True) for i in range(k - len(summaries))]
    keys = sorted({key for s in summaries for key in s.queues})
    for key in keys:
        qs = [s.queues[key] for s in summaries if key in s.queues]
        total = sum(q.queued for q in qs)
        rate = sum(q.arrival_rate for q in qs)
        deadlines = sorted(d for q in qs for d in q.deadlines_s)
        for i, s in enumerate(out):
            share = total // k + (1 if i < total % k else 0)
            s.queues[key] = TemplateQueue(queued=share, deadlines_s=deadlines[i::k][:MAX_DEADLINES],
                                          oldest_wait_s=max(q.oldest_wait_s for q in qs), arrival_rate=rate / k)
    return out


def _attainment(summaries: Sequence[ReplicaSummary], window_s: float, now: float) -> Attainment:
    total = Attainment(met=0, total=0)
    for s in summaries:
        total = total + predict_attainment(s, window_s, now, running=False)
    return total


def idle(s: ReplicaSummary) -> bool:
    """Nothing queued, running or arrived over the replica's arrival window."""
    return not s.running and all(q.queued == 0 and q.arrival_rate == 0 for q in s.queues.values())


def decide_replicas(summaries: Sequence[ReplicaSummary], current: int, spec: AutoscalingSpec, now: float) -> ScaleDecision:
    """The replica count for the next window (bounded by the spec), from the published summaries
    of the running replicas (``current`` counts replicas still starting too)."""
    lo, hi = spec.min_replicas, spec.max_replicas
    live = [s for s in summaries if not s.draining]
    if not live:
        return ScaleDecision(replicas=min(max(current, lo), hi), action="hold", attainment=1.0,
                             reason="no summary yet")
    att = _attainment(live, spec.window_s, now)
    frac = att.fraction
    if current < lo:
        return ScaleDecision(replicas=lo, action="up", attainment=frac, reason=f"below min_replicas ({lo})")
    if frac < spec.target_attainment and current < hi:
        gpus = live[0].workers
        # as many replicas as the window's work needs, at least one more than those running. The
        # "one more" counts from the running replicas, not from ``current``: replicas asked for and
        # still starting (tens of seconds) publish nothing yet, so the running ones keep predicting
        # the same shortfall on every tick (Serve asks the policy every 0.1 s); counted from
        # ``current``, one burst would ratchet the group to max_replicas within a second
        need = math.ceil(att.work_gpu_s / (gpus * spec.window_s)) if att.work_gpu_s else len(live) + 1
        want = min(hi, max(len(live) + 1, need))
        # the window's GPU-seconds count full batches back to back; under an SLO a few seconds
        # above a batch's time, queueing needs more: the fewest replicas whose replay, the load
        # shared among them, meets the target
        while want < hi and _attainment(_spread(live, want), spec.window_s, now).fraction < spec.target_attainment:
            want += 1
        if want <= current:
            return ScaleDecision(replicas=current, action="hold", attainment=frac,
                                 reason=f"predicted attainment {frac:.3f} < target {spec.target_attainment}: "
                                        f"{current - len(live)} replicas asked for are still starting")
        return ScaleDecision(replicas=want, action="up", attainment=frac,
                             reason=f"predicted attainment {frac:.3f} < target {spec.target_attainment}")
    if len(live) < current and frac >= min(1.0, spec.target_attainment + spec.scale_down_margin):
        # replicas asked for but not running (still starting, or no node has room for them) that
        # the running ones do without: stop asking for them
        return ScaleDecision(replicas=max(lo, len(live)), action="down", attainment=frac,
                             reason=f"the {len(live)} running replicas predict {frac:.3f} without the "
                                    f"{current - len(live)} not running")
    if lo == 0 and current == len(live) == 1 and idle(live[0]):
        # nothing queued, running or arriving over the summary's window: give the GPUs back (Serve
        # holds the decision for downscale_delay_s; the next request wakes the group)
        return ScaleDecision(replicas=0, action="down", attainment=frac, reason="idle: scaled to zero")
    if current > lo and len(live) == current and len(live) > 1:
        # the replica with the least to do is the one whose load is cheapest to share out
        loads = [sum(q.queued for q in s.queues.values()) + sum(b.requests for b in s.running) for s in live]
        removed = min(range(len(live)), key=lambda i: (loads[i], -live[i].t))
        without = _attainment(_absorbed(live, removed), spec.window_s, now).fraction
        if without >= min(1.0, spec.target_attainment + spec.scale_down_margin):
            return ScaleDecision(replicas=current - 1, action="down", attainment=frac, attainment_without=without,
                                 reason=f"the others absorb {live[removed].replica}'s load at {without:.3f}")
        return ScaleDecision(replicas=current, action="hold", attainment=frac, attainment_without=without,
                             reason=f"one fewer replica would predict {without:.3f}")
    return ScaleDecision(replicas=min(max(current, lo), hi), action="hold", attainment=frac,
                         reason=f"predicted attainment {frac:.3f}")


# ---------------------------------------------------------------------------- as Serve metrics
#: the earliest queued deadlines per template carried as metrics (the rest are spread evenly)
METRIC_DEADLINES = 8


def summary_metrics(s: ReplicaSummary) -> dict[str, float]:
    """A summary as the flat numbers Serve's autoscaler carries (``record_autoscaling_stats``).

    The keys are the same on every report (every template, every worker, a fixed number of
    deadlines): Serve keeps each key's series, so a key that stopped being reported would keep
    its last value. The plans travel separately (the policy's kwargs)."""
    m: dict[str, float] = {"t": s.t, "workers": float(s.workers), "wait_window_s": s.wait_window_s,
                           "draining": float(s.draining)}
    for key in sorted(s.plans):
        q = s.queues.get(key) or TemplateQueue(queued=0)
        m[f"q|{key}|n"] = float(q.queued)
        m[f"q|{key}|wait"] = q.oldest_wait_s
        m[f"q|{key}|rate"] = q.arrival_rate
        m[f"q|{key}|slots"] = float(q.open_slots)
        for i in range(METRIC_DEADLINES):
            m[f"q|{key}|d{i}"] = q.deadlines_s[i] if i < len(q.deadlines_s) else 0.0
    index = {k: i for i, k in enumerate(sorted(s.plans))}
    lead: dict[int, RunningBatch] = {}
    for b in s.running:
        lead.setdefault(min(b.workers), b)  # a paused batch and the one on its workers: both kept below
    extra = [b for b in s.running if lead.get(min(b.workers)) is not b]
    for w in range(s.workers):
        lb = lead.get(w)
        m[f"w|{w}|tpl"] = float(index[lb.template]) if lb is not None and lb.template in index else -1.0
        m[f"w|{w}|sp"] = float(len(lb.workers)) if lb is not None else 0.0
        m[f"w|{w}|rem"] = lb.remaining_s if lb is not None else 0.0
        m[f"w|{w}|n"] = float(lb.requests) if lb is not None else 0.0
        m[f"w|{w}|dl"] = lb.deadline_s if lb is not None else 0.0
        m[f"w|{w}|p"] = float(lb.paused) if lb is not None else 0.0
        # a second batch on the same workers (a paused one under a running one): its seconds and members
        e = next((x for x in extra if min(x.workers) == w), None)
        m[f"w|{w}|held_rem"] = e.remaining_s if e is not None else 0.0
        m[f"w|{w}|held_n"] = float(e.requests) if e is not None else 0.0
        m[f"w|{w}|held_tpl"] = float(index[e.template]) if e is not None and e.template in index else -1.0
        m[f"w|{w}|held_dl"] = e.deadline_s if e is not None else 0.0
    return m


def summary_from_metrics(replica: str, m: Mapping[str, float], plans: Mapping[str, PlanBrief]) -> ReplicaSummary:
    """The summary back from ``summary_metrics`` (its deadlines beyond the first few spread)."""
    keys = sorted(plans)
    workers = int(m.get("workers", 1))
    qs = {}
    for key in keys:
        n = int(m.get(f"q|{key}|n", 0))
        rate = m.get(f"q|{key}|rate", 0.0)
        if n == 0 and rate == 0:
            continue
        qs[key] = TemplateQueue(queued=n, oldest_wait_s=max(0.0, m.get(f"q|{key}|wait", 0.0)), arrival_rate=max(0.0, rate),
                                open_slots=int(m.get(f"q|{key}|slots", 0)),
                                deadlines_s=[m.get(f"q|{key}|d{i}", 0.0) for i in range(min(n, METRIC_DEADLINES))])
    rs = []
    for w in range(workers):
        sp = int(m.get(f"w|{w}|sp", 0))
        t = int(m.get(f"w|{w}|tpl", -1))
        if sp > 0 and 0 <= t < len(keys):
            rs.append(RunningBatch(template=keys[t], workers=list(range(w, min(workers, w + sp))),
                                   requests=int(m.get(f"w|{w}|n", 0)), remaining_s=max(0.0, m.get(f"w|{w}|rem", 0.0)),
                                   remaining_steps=0, deadline_s=m.get(f"w|{w}|dl", 0.0),
                                   paused=bool(m.get(f"w|{w}|p", 0.0))))
        h = int(m.get(f"w|{w}|held_tpl", -1))
        if 0 <= h < len(keys):
            hsp = plans[keys[h]].sp
            rs.append(RunningBatch(template=keys[h], workers=list(range(w, min(workers, w + hsp))),
                                   requests=int(m.get(f"w|{w}|held_n", 0)),
                                   remaining_s=max(0.0, m.get(f"w|{w}|held_rem", 0.0)), remaining_steps=0,
                                   deadline_s=m.get(f"w|{w}|held_dl", 0.0), paused=True))
    return ReplicaSummary(replica=replica, t=m.get("t", 0.0), workers=workers,
                          wait_window_s=m.get("wait_window_s", 0.05), plans=dict(plans), queues=qs, running=rs,
                          draining=bool(m.get("draining", 0.0)))


class SloAutoscalingPolicy:
    """Serve's custom autoscaling policy for a model group (``AutoscalingConfig.policy``): the
    replicas' latest published summaries -> ``decide_replicas``. Serve applies the bounds and
    the up/down delays around it.

    Args:
        spec: the group's ``AutoscalingSpec`` (JSON-able dict).
        plans: template -> ``PlanBrief`` (JSON-able dicts).
    """

    def __init__(self, spec: dict[str, Any], plans: dict[str, dict[str, Any]]) -> None:
        self.spec = AutoscalingSpec.model_validate(spec)
        self.plans = {k: PlanBrief.model_validate(v) for k, v in plans.items()}

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        import time

        now = time.time()
        per_replica: dict[Any, dict[str, float]] = {}
        raw = ctx.raw_metrics or {}
        for name, by_replica in raw.items():
            for rid, series in by_replica.items():
                if series:  # the latest point: a summary is a state, not a rate to average
                    per_replica.setdefault(rid, {})[name] = series[-1].value
        if not per_replica:
            for name, by_replica in (ctx.aggregated_metrics or {}).items():
                for rid, v in by_replica.items():
                    per_replica.setdefault(rid, {})[name] = v
        running = set(ctx.running_replicas)
        summaries = [summary_from_metrics(str(rid), m, self.plans) for rid, m in per_replica.items()
                     if rid in running and "t" in m]
        decision = decide_replicas(summaries, ctx.target_num_replicas, self.spec, now)
        state = dict(ctx.policy_state)
        state["xema_decision"] = decision.model_dump()
        return decision.replicas, state
