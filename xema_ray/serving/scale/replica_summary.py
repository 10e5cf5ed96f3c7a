"""What a ModelGroup replica publishes about its backlog, and the predictions made from it.

Each replica of a model group summarises its ``Dispatcher`` (``summarize``): per template the
queued requests and their deadlines, the recent arrival rate, the waiting partial batch's free
slots (a request that fills one costs no extra work); the running and paused batches' remaining
seconds and steps; the free SP groups. The summary is small (tens of numbers) and cheap (no
I/O), so it can be published every fraction of a second and read without a call per request.

``schedule`` replays the dispatcher's policy on a summary — batches of up to the plan's batch
size, earliest head deadline first, each on the aligned SP group that frees first — to predict
when each queued (or hypothetical) request completes. Two numbers come from it:

* ``predict_completion``: seconds until one more request of a template would finish on this
  replica (the request router sends it to the replica where this is earliest within the SLO);
  ``predict_wait`` the same probe's seconds until its batch starts (the group's
  ``xema_predicted_queue_wait_s``, for routers outside the app);
* ``predict_attainment``: the fraction of this replica's requests — running, queued, and those
  expected over the next window at the recent arrival rate — predicted to meet their deadlines
  (the autoscaler adds a replica when it falls below the target).

The replay is deliberately the dispatcher's own rules on a coarse state, not the dispatcher
itself: it is run by the request router per request and by the autoscaler per tick, on summaries
of other processes.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.scheduling.batch import DispatchPlan, partial_latency
from xema_ray.scheduling.batch_key import DEFAULT_BATCH_POLICY, BatchKey, BatchPolicy, batch_seconds
from xema_ray.scheduling.dispatcher import Dispatcher

#: queued deadlines kept per template in a summary (beyond it, the rest are spread evenly)
MAX_DEADLINES = 64


class PlanBrief(BaseModel):
    """What the replay needs from a template's plan."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch: int = Field(ge=1)
    sp: int = Field(ge=1)
    latency_s: float = Field(ge=0, description="predicted seconds of one full batch")
    slo_s: float = Field(gt=0)
    steps: int = Field(default=1, ge=1)
    min_latency_s: float | None = Field(default=None, ge=0,
                                        description="predicted seconds of a batch of one (None: latency_s)")
    latency_by_batch: dict[int, float] = Field(default_factory=dict, description="predicted seconds of a partial "
                                               "batch of n, as planned (the dispatcher's ``DispatchPlan.latency_for``)")

    @classmethod
    def of(cls, p: DispatchPlan) -> PlanBrief:
        return cls(batch=p.batch, sp=p.sp, latency_s=p.latency_s, slo_s=p.slo_s, steps=p.steps,
                   min_latency_s=p.min_latency_s, latency_by_batch=dict(p.latency_by_batch))

    def latency_for(self, n: int) -> float:
        """Predicted seconds of a batch of ``n`` requests: a partial batch is faster than a full one
        (a batch of one of Flux.2 256x256 takes half a batch of three), so the replay must not
        charge it the full batch's time — at a low rate every batch is partial, and charging them
        the full time predicts misses that do not happen (the autoscaler then adds replicas for
        nothing and never removes them). The plan's latency-by-batch where it has ``n``, else linear
        between the two ends."""
        if n < self.batch and n in self.latency_by_batch:
            return self.latency_by_batch[n]
        return partial_latency(self.latency_s, self.min_latency_s, self.batch, n)


class TemplateQueue(BaseModel):
    """One template's queue on a replica."""

    model_config = ConfigDict(extra="forbid")

    queued: int = Field(ge=0)
    deadlines_s: list[float] = Field(
        default_factory=list, description="seconds from the summary's time to each queued request's deadline, "
                                          f"earliest first (at most {MAX_DEADLINES})")
    oldest_wait_s: float = Field(default=0.0, ge=0, description="how long the oldest queued request has waited")
    open_slots: int = Field(default=0, ge=0, description="requests that would join the waiting partial batch")
    keys: list[int] = Field(default_factory=list, description="each queued request's batch key, in the order of "
                            "deadlines_s: 0 the template's default (its steps, the model's guidance, lossless), 1.. "
                            "the others by first appearance; empty (or not one per deadline): all 0")
    arrival_rate: float = Field(default=0.0, ge=0, description="requests per second over the recent window")


class RunningBatch(BaseModel):
    """A batch running (or paused) on the replica's workers."""

    model_config = ConfigDict(extra="forbid")

    template: str
    workers: list[int]
    requests: int = Field(ge=0)
    remaining_s: float = Field(ge=0)
    remaining_steps: int = Field(ge=0)
    deadline_s: float = Field(description="seconds from the summary's time to its earliest member's deadline")
    paused: bool = False


class ReplicaSummary(BaseModel):
    """A replica's backlog at time ``t``: what the request router and the autoscaler read."""

    model_config = ConfigDict(extra="forbid")

    replica: str = Field(description="the replica (its job-store owner id)")
    t: float = Field(description="wall-clock time (time.time()) of the summary")
    workers: int = Field(ge=1)
    wait_window_s: float = Field(default=0.05, ge=0)
    batching: BatchPolicy = Field(default=DEFAULT_BATCH_POLICY, description="what one batch may mix "
                                  "(``xema_ray.scheduling.batch_key``): the replay batches and prices as the dispatcher")
    plans: dict[str, PlanBrief]
    queues: dict[str, TemplateQueue] = Field(default_factory=dict)
    running: list[RunningBatch] = Field(default_factory=list)
    free_groups: dict[str, int] = Field(default_factory=dict, description="per template: free aligned SP groups")
    draining: bool = Field(default=False, description="the replica is shutting down: it takes nothing new")

    def age(self, now: float) -> float:
        return max(0.0, now - self.t)


# ---------------------------------------------------------------------------- from a dispatcher
class ArrivalMeter:
    """Arrivals per template over a sliding window (for the predicted load of the next window)."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._times: dict[str, collections.deque[float]] = {}

    def add(self, template: str, now: float) -> None:
        self._times.setdefault(template, collections.deque()).append(now)

    def rates(self, now: float) -> dict[str, float]:
        out = {}
        for t, q in self._times.items():
            while q and q[0] < now - self.window_s:
                q.popleft()
            out[t] = len(q) / self.window_s
        return out


def summarize(dispatcher: Dispatcher, replica: str, now: float, wall: float | None = None,
              rates: Mapping[str, float] | None = None, draining: bool = False) -> ReplicaSummary:
    """The summary of ``dispatcher`` at monotonic time ``now`` (``wall``: the same instant on the
    wall clock, which is what other processes compare with)."""
    plans = {k: PlanBrief.of(p) for k, p in dispatcher.plans.items()}
    queues = {}
    for key, plan in dispatcher.plans.items():
        pending = dispatcher.queued(key)
        if not pending and not (rates or {}).get(key):
            continue
        default = BatchKey(steps=plan.steps)  # the template's default key: 0; a new request's open slots are its
        partial = sum(default.joins(r.key, dispatcher.batching) for r in pending) % plan.batch
        numbers: dict[BatchKey, int] = {default: 0}
        keys = [numbers.setdefault(r.key, len(numbers)) for r in pending[:MAX_DEADLINES]]
        queues[key] = TemplateQueue(
            queued=len(pending), deadlines_s=[r.deadline - now for r in pending[:MAX_DEADLINES]],
            oldest_wait_s=max((now - r.arrival for r in pending), default=0.0),
            open_slots=plan.batch - partial if partial else 0, arrival_rate=(rates or {}).get(key, 0.0),
            keys=keys if any(keys) else [])
    running = []
    for a, paused in [*((a, False) for a in dispatcher.running), *((a, True) for a in dispatcher.paused)]:
        # the dispatcher counts a batch's remaining time against ``held_s`` (the full batch's latency);
        # the batch ends when it has run as priced, sub-batches included (``Assignment.run_s``)
        own = a.run_s
        ran = a.held_s - dispatcher.remaining_s(a.batch_id, now)
        rem = max(0.0, own - ran)
        steps = a.plan.steps
        running.append(RunningBatch(
            template=a.template, workers=list(a.workers), requests=len(a.requests), remaining_s=rem,
            remaining_steps=min(steps, max(0, round(steps * rem / own))) if own > 0 else 0,
            deadline_s=min(r.deadline for r in a.requests) - now, paused=paused))
    busy = {w for b in running for w in b.workers}
    free = {}
    for key, plan in dispatcher.plans.items():
        free[key] = sum(1 for s in range(0, dispatcher.workers - plan.sp + 1, plan.sp)
                        if not busy.intersection(range(s, s + plan.sp)))
    return ReplicaSummary(replica=replica, t=time.time() if wall is None else wall, workers=dispatcher.workers,
                          wait_window_s=dispatcher.wait_window_s, batching=dispatcher.batching, plans=plans,
                          queues=queues, running=running,
                          free_groups=free, draining=draining)


# ---------------------------------------------------------------------------- the replay
@dataclass(order=True)
class _Req:
    deadline: float
    arrival: float
    template: str
    tag: int = -1  # >= 0: a request the caller asks about
    key: int = 0  # its batch key's number (``TemplateQueue.keys``; 0: the template's default)


#: the tag of a running (or paused) batch's members in the replay's outcomes
RUNNING = -2


@dataclass(frozen=True)
class Outcome:
    """A request of the replay: when it arrives, its deadline and predicted completion (seconds
    from the replay's time zero)."""

    template: str
    arrival: float
    deadline: float
    completion: float
    tag: int = -1
    start: float | None = None  # when its batch starts (None: a batch running at the replay's time zero)

    @property
    def met(self) -> bool:
        return self.completion <= self.deadline + 1e-9


def _queued(s: ReplicaSummary, key: str, q: TemplateQueue, age: float) -> list[_Req]:
    """The queued requests of a template, their deadlines from now (the ones past the kept list
    are spread between the last kept deadline and a fresh request's)."""
    ds = [d - age for d in q.deadlines_s]
    slo = s.plans[key].slo_s
    keys = q.keys if len(q.keys) == len(ds) else [0] * len(ds)  # reshuffled by the autoscaler's what-ifs: all 0
    extra = q.queued - len(ds)
    if extra > 0:
        last = ds[-1] if ds else slo - q.oldest_wait_s - age
        ds += [last + (slo - age - last) * (i + 1) / (extra + 1) for i in range(extra)]
    return [_Req(d, -(slo - d), key, key=keys[i] if i < len(keys) else 0) for i, d in enumerate(ds)]


def schedule(s: ReplicaSummary, now: float | None = None, arrivals: Sequence[tuple[str, float, int]] = (),
             extra_queued: Mapping[str, int] | None = None) -> list[Outcome]:
    """Replay the dispatcher on ``s`` from ``now`` (default: the summary's own time): the queued
    requests, ``extra_queued`` more per template arrived just now (sent since the summary), and
    ``arrivals`` — ``(template, seconds from now, tag)`` — in the order of their deadlines.
    Returns every request's outcome (running batches' members included, tag -1)."""
    age = 0.0 if now is None else s.age(now)
    # Times are seconds from ``now``, but the replay runs from the summary's own time: what the
    # summary shows happened ``age`` ago. A worker free then (or freed since: its batch's end is
    # now negative) took the queued requests then, not now; a running batch that ended since keeps
    # the outcome it had. Clamping those times to now would make an old summary look backlogged:
    # its queue would start late and its finished batches would end after their deadlines.
    free_at = [-age] * s.workers
    out: list[Outcome] = []
    for b in s.running:
        if b.paused:
            continue
        end = b.remaining_s - age
        for w in b.workers:
            free_at[w] = max(free_at[w], end)
    for b in s.running:  # a paused batch resumes when its workers are free and runs to its end
        if b.paused:
            start = max(free_at[w] for w in b.workers)
            for w in b.workers:
                free_at[w] = start + b.remaining_s
    for b in s.running:
        end = max(free_at[w] for w in b.workers) if b.paused else b.remaining_s - age
        out += [Outcome(b.template, -age, b.deadline_s - age, end, RUNNING)] * b.requests
    pending: dict[str, list[_Req]] = collections.defaultdict(list)
    for key, tq in s.queues.items():
        if key in s.plans:
            pending[key] += _queued(s, key, tq, age)
    for key, n in (extra_queued or {}).items():
        if key in s.plans:
            pending[key] += [_Req(s.plans[key].slo_s, 0.0, key) for _ in range(n)]
    for key, at, tag in arrivals:
        pending[key].append(_Req(at + s.plans[key].slo_s, at, key, tag))
    for reqs in pending.values():
        reqs.sort()
    while any(pending.values()):
        # earliest head deadline first, as the dispatcher orders templates
        key = min((reqs[0].deadline, k) for k, reqs in pending.items() if reqs)[1]
        plan, q = s.plans[key], pending[key]
        groups = [tuple(range(g, g + plan.sp)) for g in range(0, s.workers - plan.sp + 1, plan.sp)]
        group = min(groups, key=lambda g: max(free_at[w] for w in g))
        ready = max(max(free_at[w] for w in group), q[0].arrival)
        # a batch takes what has arrived by the time it can start (waiting a window for more), of the
        # head's key only (``by_key``) or one sub-batch per key (``mixed``), priced as it runs
        members = [r for r in q if r.arrival <= ready + s.wait_window_s
                   and (s.batching == "mixed" or r.key == q[0].key)][: plan.batch]
        if len(members) < plan.batch:
            ready = max(ready, min(r.arrival for r in members) + s.wait_window_s) if members else ready
        start = max(ready, max(r.arrival for r in members))
        end = start + batch_seconds([r.key for r in members], lambda _, n: plan.latency_for(n))
        for w in group:
            free_at[w] = end
        for r in members:
            q.remove(r)
            out.append(Outcome(key, r.arrival, r.deadline, end, r.tag, start))
    return out


def predict_completion(s: ReplicaSummary, template: str, now: float,
                       sent_since: Mapping[str, int] | None = None) -> float:
    """Seconds from ``now`` until one more request of ``template`` would complete on this replica
    (``sent_since``: requests already sent to it that the summary does not show yet)."""
    return probe(s, template, now, sent_since).completion


def predict_wait(s: ReplicaSummary, template: str, now: float,
                 sent_since: Mapping[str, int] | None = None) -> float:
    """Seconds from ``now`` until one more request of ``template`` would start on this replica:
    the queue ahead of it, the workers' running batches and the wait for its batch to fill
    (``predict_completion`` less its own batch's run time; inf where it would never run here).

    Example:
        >>> s = ReplicaSummary(replica="r", t=0.0, workers=1, wait_window_s=0.0,
        ...                    plans={"t": PlanBrief(batch=1, sp=1, latency_s=2.0, slo_s=10.0)},
        ...                    queues={"t": TemplateQueue(queued=2, deadlines_s=[9.0, 9.5])})
        >>> predict_wait(s, "t", now=0.0)
        4.0
    """
    o = probe(s, template, now, sent_since)
    return float("inf") if o.start is None else max(0.0, o.start)


def probe(s: ReplicaSummary, template: str, now: float, sent_since: Mapping[str, int] | None = None) -> Outcome:
    """The replay's outcome of one more request of ``template`` arriving at ``now``: when its
    batch would start and end (seconds from ``now``; never, inf / None, on a draining replica or
    for a template it does not plan)."""
    if template not in s.plans or s.draining:
        return Outcome(template, 0.0, float("inf"), float("inf"), 0, None)
    outs = schedule(s, now, arrivals=[(template, 0.0, 0)], extra_queued=sent_since)
    return next(o for o in outs if o.tag == 0)


class Attainment(BaseModel):
    """Requests predicted to meet their deadlines over a window, of how many."""

    model_config = ConfigDict(frozen=True)

    met: float = Field(ge=0)
    total: float = Field(ge=0)
    work_gpu_s: float = Field(default=0.0, ge=0, description="GPU-seconds of the window's work (queued + arriving)")

    @property
    def fraction(self) -> float:
        return 1.0 if self.total == 0 else self.met / self.total

    def __add__(self, other: Attainment) -> Attainment:
        return Attainment(met=self.met + other.met, total=self.total + other.total,
                          work_gpu_s=self.work_gpu_s + other.work_gpu_s)


def expected_arrivals(rates: Mapping[str, float], window_s: float) -> list[tuple[str, float, int]]:
    """Arrivals at ``rates`` (per second) over ``[0, window_s)`` as a Poisson process spreads them:
    the expected count, at uniform random times (a Poisson process given its count), from a seed
    fixed by the count, so that the same summary gives the same prediction. Evenly spaced arrivals
    never bunch, and a replica fed them looks better than it is: on the live dispatcher and the
    Flux.2 plan of ``make bench-scale`` (tests/serving/scale/test_scaling_low_rate.py), one replica at
    0.25 / 0.4 / 0.5 req/s of Poisson arrivals meets 0.94 / 0.71 / 0.39 of its SLOs; spread this
    way the replay predicts 0.95 / 0.70 / 0.39, evenly spaced 0.98 / 0.80 / 0.47."""
    out = []
    for key, rate in sorted(rates.items()):
        n = int(round(rate * window_s))
        rng = random.Random(n)
        out += [(key, t, -1) for t in sorted(rng.uniform(0.0, window_s) for _ in range(n))]
    return out


def predict_attainment(s: ReplicaSummary, window_s: float, now: float | None = None,
                       rates: Mapping[str, float] | None = None,
                       extra_queued: Mapping[str, int] | None = None, running: bool = True) -> Attainment:
    """Predicted attainment of this replica's requests — running (unless ``running`` is False:
    what the autoscaler decides on, since no replica added or removed changes a started batch),
    queued and arriving over the next ``window_s`` at ``rates`` (default: the summary's recent
    arrival rates)."""
    if rates is None:
        rates = {k: q.arrival_rate for k, q in s.queues.items()}
    outs = schedule(s, now, arrivals=expected_arrivals(rates, window_s), extra_queued=extra_queued)
    if not running:
        outs = [o for o in outs if o.tag != RUNNING]
    work = 0.0
    for o in outs:
        p = s.plans[o.template]
        work += p.latency_s * p.sp / p.batch
    return Attainment(met=sum(o.met for o in outs), total=len(outs), work_gpu_s=work)
