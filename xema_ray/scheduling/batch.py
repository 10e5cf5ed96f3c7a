"""What moves through the dispatcher: a template's ``DispatchPlan``, a queued request
(``Pending``, with its ``BatchKey``), a batch placed on its workers (``Assignment``) and how long it
has run (``BatchProgress``). Data only; the decisions are ``Dispatcher``'s (``dispatcher.py``), what
a batch may mix and what it costs ``batch_key.py``'s."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Generic, TypeVar

from xema_ray.scheduling.batch_key import DEFAULT_BATCH_POLICY, BatchKey, BatchPolicy, batch_seconds

if TYPE_CHECKING:
    from xema_ray.plan import PlanEntry
    from xema_ray.profiling.phases import PhaseShares
    from xema_ray.scheduling.preemption_policy import Preemption

P = TypeVar("P")  # what a request carries (the HTTP payload live, nothing in simulation)


def partial_latency(latency_s: float, min_latency_s: float | None, batch: int, n: int) -> float:
    """Predicted seconds of a batch of ``n`` requests of a plan for ``batch`` that takes
    ``latency_s`` full and ``min_latency_s`` with one request (None: ``latency_s``): linear
    between the two ends, ``latency_s`` from ``batch`` on.

    Example:
        >>> partial_latency(10.0, 4.0, 4, 2)
        6.0
    """
    if min_latency_s is None or n >= batch or batch <= 1:
        return latency_s
    return min_latency_s + (latency_s - min_latency_s) * (max(1, n) - 1) / (batch - 1)


@dataclass(frozen=True)
class DispatchPlan:
    """What the dispatcher needs from a template's plan."""

    batch: int
    sp: int
    slo_s: float
    latency_s: float  # predicted batch latency, for the simulator and for Retry-After hints
    steps: int = 1  # denoising steps: a pause waits for the next step boundary
    peak_bytes: int | None = None  # planned device peak per worker (weights included)
    pause_bytes: int | None = None  # between-step state a paused batch holds; None: never preempted
    static_layout: bool = False  # runs with a static layout: its paused state must leave the layout's arena
    denoise_frac: float = 1.0  # share of latency_s in the denoising steps (1: no phases known)
    decode_encode_frac: float = 0.0  # share after the last step (decode, encode): no step boundary left there
    min_latency_s: float | None = None  # a batch of one (None: latency_s): whether a late request can still make it
    latency_by_batch: tuple[tuple[int, float], ...] = ()  # (n, seconds) of a partial batch of n, as planned

    @classmethod
    def of_entry(cls, entry: PlanEntry, slo_s: float | None = None, shares: PhaseShares | None = None) -> DispatchPlan:
        """What the dispatcher needs from a plan table entry (``slo_s``: another SLO than the plan's;
        ``shares``: where its latency goes, ``xema_ray.profiling.phases``; None: no phases known)."""
        from xema_ray.scheduling.decode_stage import dit_stage_latency, pooled

        c, p = entry.config, entry.prediction
        phases = {} if shares is None else {"denoise_frac": shares.denoise, "decode_encode_frac": shares.decode_encode}
        if pooled(entry):
            # the DiT workers hold the batch until its last step; the decode pool has the rest
            # (``decode_stage.decode_plan``): no decode tail here, its SLO what is left after it
            total = p.latency_s
            dit = dit_stage_latency(entry)
            phases = {"denoise_frac": min(1.0, phases.get("denoise_frac", 1.0) * total / max(dit, 1e-9)),
                      "decode_encode_frac": 0.0}
            return cls(batch=c.batch, sp=c.sp, slo_s=(p.slo_s if slo_s is None else slo_s) - (total - dit),
                       latency_s=dit, steps=c.template.steps, peak_bytes=p.peak_bytes, pause_bytes=p.pause_bytes,
                       static_layout=c.layout_ref is not None, min_latency_s=None, **phases)
        return cls(batch=c.batch, sp=c.sp, slo_s=p.slo_s if slo_s is None else slo_s, latency_s=p.latency_s,
                   steps=c.template.steps, peak_bytes=p.peak_bytes, pause_bytes=p.pause_bytes,
                   static_layout=c.layout_ref is not None, min_latency_s=p.latency_by_batch.get(1),
                   latency_by_batch=tuple(sorted(p.latency_by_batch.items())), **phases)

    def latency_for(self, n: int) -> float:
        """Predicted seconds of a batch of ``n`` of this plan's requests: the plan's latency-by-batch
        where it has ``n``, else ``partial_latency``."""
        for k, s in self.latency_by_batch:
            if k == n and n < self.batch:
                return s
        return partial_latency(self.latency_s, self.min_latency_s, self.batch, n)

    def batch_seconds(self, keys: tuple[BatchKey, ...] | list[BatchKey]) -> float:
        """Predicted seconds of a batch of requests of ``keys`` as it runs: one sub-batch per key,
        each at its own step count (``batch_key.batch_seconds``).

        Example:
            >>> p = DispatchPlan(batch=4, sp=1, slo_s=10, latency_s=4.0, min_latency_s=1.5)
            >>> p.batch_seconds([BatchKey(1, (g, None)) for g in (1.0, 2.0, 3.0, 4.0)])
            6.0
        """
        return batch_seconds(keys, lambda k, n: self.for_steps(k.steps).latency_for(n))

    def held_s(self, keys: tuple[BatchKey, ...] | list[BatchKey]) -> float:
        """Seconds the dispatcher counts a batch of ``keys`` against while it runs: the full batch's
        latency, as for every batch, plus the time its calls take beyond one (``Assignment.held_s``)."""
        return self.latency_s + max(0.0, self.batch_seconds(keys) - self.latency_for(len(keys)))

    def for_steps(self, steps: int) -> DispatchPlan:
        """This plan for a batch of ``steps`` denoising steps (the plan's own: itself). Memory
        does not depend on the step count; the time in the steps scales with it, the rest does not
        (text, decode, encode), and the SLO scales as the latency does.

        Example:
            >>> p = DispatchPlan(batch=1, sp=1, slo_s=20, latency_s=10, steps=10, denoise_frac=0.8, decode_encode_frac=0.2)
            >>> q = p.for_steps(20)
            >>> (q.latency_s, q.slo_s, q.steps)
            (18.0, 36.0, 20)
        """
        if steps == self.steps:
            return self
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        d, k = self.denoise_frac, steps / self.steps
        factor = (1.0 - d) + d * k
        return replace(self, steps=steps, latency_s=self.latency_s * factor, slo_s=self.slo_s * factor,
                       min_latency_s=None if self.min_latency_s is None else self.min_latency_s * factor,
                       latency_by_batch=tuple((n, v * factor) for n, v in self.latency_by_batch),
                       denoise_frac=d * k / factor, decode_encode_frac=self.decode_encode_frac / factor)


@dataclass(order=True)
class Pending(Generic[P]):
    deadline: float
    seq: int
    template: str = field(compare=False)
    arrival: float = field(compare=False)
    request_id: str = field(compare=False)
    key: BatchKey = field(compare=False)  # what its batch cannot mix: steps (resolved by the API), guidance, quality
    payload: P | None = field(default=None, compare=False)

    @property
    def steps(self) -> int:
        """The denoising steps it runs (its own or its template's)."""
        return self.key.steps


def pop_batch(q: list[Pending[P]], size: int, policy: BatchPolicy) -> tuple[Pending[P], ...]:
    """Up to ``size`` requests off the heap ``q`` for one batch, earliest deadline first: the head's
    and those whose key joins it under ``policy`` (``BatchKey.joins``: its own key only, or any
    guidance of its step count and tier); the others stay queued for a batch of their own."""
    head = q[0].key
    taken: list[Pending[P]] = []
    kept: list[Pending[P]] = []
    while q and len(taken) < size:
        r = heapq.heappop(q)
        (taken if head.joins(r.key, policy) else kept).append(r)
    for r in kept:
        heapq.heappush(q, r)
    return tuple(taken)


@dataclass(frozen=True)
class Assignment(Generic[P]):
    """A batch placed on a group of workers."""

    batch_id: int
    template: str
    workers: tuple[int, ...]
    requests: tuple[Pending[P], ...]
    plan: DispatchPlan  # at the batch's step count (``DispatchPlan.for_steps``): one call's latencies
    preempts: tuple[Preemption, ...] = ()  # batches that pause so this one runs on their workers
    resume: bool = False  # a paused batch continuing on its own workers
    park_wait_s: float = 0.0  # predicted seconds until ``preempts`` have parked (step boundary, switch, move out)
    run_s: float = 0.0  # predicted seconds of the batch as it runs, sub-batches included (``DispatchPlan.batch_seconds``)

    @property
    def held_s(self) -> float:
        """Seconds the dispatcher counts the running batch against: the full batch's latency, as for
        every batch (a partial batch keeps the difference on top), plus the time its sub-batches
        take beyond one call (``run_s`` less one call of its size)."""
        return self.plan.latency_s + max(0.0, self.run_s - self.plan.latency_for(len(self.requests)))


@dataclass
class BatchProgress:
    """How long a batch has run (for its remaining time) and where it holds paused state."""

    ran_s: float = 0.0
    since: float | None = None  # running since (None: paused)
    offloaded: bool = False

    def remaining(self, latency_s: float, now: float) -> float:
        ran = self.ran_s + (now - self.since if self.since is not None else 0.0)
        return max(0.0, latency_s - ran)


@dataclass
class DispatchState(Generic[P]):
    """What the dispatcher and its two parts (step-level preemption, SLO admission) read and
    write: the plans, the queues, which workers run or hold which batch. One object, held by
    each of them (``Dispatcher``, ``StepPreemption``, ``SloAdmission``)."""

    plans: dict[str, DispatchPlan]
    workers: int
    queues: dict[str, list[Pending[P]]] = field(default_factory=dict)
    batching: BatchPolicy = DEFAULT_BATCH_POLICY  # what one batch may mix (``batch_key``)
    busy: dict[int, int] = field(default_factory=dict)  # worker -> batch id running on it
    held: dict[int, int] = field(default_factory=dict)  # worker -> paused batch whose state it holds
    running: dict[int, Assignment[P]] = field(default_factory=dict)
    progress: dict[int, BatchProgress] = field(default_factory=dict)
    batch_ids: itertools.count[int] = field(default_factory=itertools.count)

    def start(self, template: str, group: tuple[int, ...], reqs: tuple[Pending[P], ...], plan: DispatchPlan, now: float,
              preempts: tuple[Preemption, ...] = (), park_wait_s: float = 0.0) -> Assignment[P]:
        """A new batch of ``reqs`` on ``group``, priced as it will run (``DispatchPlan.batch_seconds``),
        its workers busy from ``now``."""
        a = Assignment(next(self.batch_ids), template, group, reqs, plan, preempts, park_wait_s=park_wait_s,
                       run_s=plan.batch_seconds([r.key for r in reqs]))
        for w in group:
            self.busy[w] = a.batch_id
        self.running[a.batch_id] = a
        self.progress[a.batch_id] = BatchProgress(since=now)
        return a

    def next_batch(self, template: str) -> list[Pending[P]]:
        """The requests the template's next batch would take now (``pop_batch``'s, left queued)."""
        q = sorted(self.queues[template])
        if not q:
            return []
        plan = self.plans[template]
        return [r for r in q if q[0].key.joins(r.key, self.batching)][: plan.batch]

    def free_group(self, sp: int) -> tuple[int, ...] | None:
        """The first aligned group of ``sp`` workers that runs and holds nothing (None: none is free)."""
        for start in range(0, self.workers - sp + 1, sp):
            group = tuple(range(start, start + sp))
            if not any(w in self.busy or w in self.held for w in group):
                return group
        return None
