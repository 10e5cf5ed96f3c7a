"""What moves through the dispatcher: a template's ``DispatchPlan``, a queued request
(``Pending``), a batch placed on its workers (``Assignment``) and how long it has run
(``BatchProgress``). Data only; the decisions are ``Dispatcher``'s (``dispatcher.py``)."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Generic, TypeVar

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
                   static_layout=c.layout_ref is not None, min_latency_s=p.latency_by_batch.get(1), **phases)

    def latency_for(self, n: int) -> float:
        """Predicted seconds of a batch of ``n`` of this plan's requests (``partial_latency``)."""
        return partial_latency(self.latency_s, self.min_latency_s, self.batch, n)

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
                       denoise_frac=d * k / factor, decode_encode_frac=self.decode_encode_frac / factor)


@dataclass(order=True)
class Pending(Generic[P]):
    deadline: float
    seq: int
    template: str = field(compare=False)
    arrival: float = field(compare=False)
    request_id: str = field(compare=False)
    steps: int = field(compare=False)  # the denoising steps it runs (resolved by the API: its own or its template's)
    payload: P | None = field(default=None, compare=False)


def pop_batch(q: list[Pending[P]], size: int) -> tuple[Pending[P], ...]:
    """Up to ``size`` requests off the heap ``q`` for one batch, earliest deadline first: the head's
    and those of its step count only (a batch runs one step count; the others stay queued for a
    batch of their own)."""
    steps = q[0].steps
    taken: list[Pending[P]] = []
    kept: list[Pending[P]] = []
    while q and len(taken) < size:
        r = heapq.heappop(q)
        (taken if r.steps == steps else kept).append(r)
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
    plan: DispatchPlan
    preempts: tuple[Preemption, ...] = ()  # batches that pause so this one runs on their workers
    resume: bool = False  # a paused batch continuing on its own workers
    park_wait_s: float = 0.0  # predicted seconds until ``preempts`` have parked (step boundary, switch, move out)


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
    busy: dict[int, int] = field(default_factory=dict)  # worker -> batch id running on it
    held: dict[int, int] = field(default_factory=dict)  # worker -> paused batch whose state it holds
    running: dict[int, Assignment[P]] = field(default_factory=dict)
    progress: dict[int, BatchProgress] = field(default_factory=dict)
    batch_ids: itertools.count[int] = field(default_factory=itertools.count)

    def free_group(self, sp: int) -> tuple[int, ...] | None:
        """The first aligned group of ``sp`` workers that runs and holds nothing (None: none is free)."""
        for start in range(0, self.workers - sp + 1, sp):
            group = tuple(range(start, start + sp))
            if not any(w in self.busy or w in self.held for w in group):
                return group
        return None
