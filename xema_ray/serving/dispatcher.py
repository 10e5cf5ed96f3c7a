"""The dispatch policy of a model's GPU worker set (paper §4, Figure 3), with no I/O and no clock.

One ``Dispatcher`` per model keeps a queue per template, forms batches of up to the plan's batch
size (waiting at most a short window for a batch to fill), serves templates earliest-deadline
first (deadline = arrival + the template's SLO), and places each batch on a free group of the
plan's SP size. SP groups are aligned blocks of workers — ``[0,1]``, ``[2,3]`` for SP 2 — so
SP-2 groups fall on NVLink pairs when the workers are ordered by the topology. DP is how many
such groups run at once.

The live ModelGroup deployment drives it with wall-clock time and the cluster simulator
(``xema_ray.sim``) with virtual time: the same code decides in both.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P")  # what a request carries (the HTTP payload live, nothing in simulation)


@dataclass(frozen=True)
class DispatchPlan:
    """What the dispatcher needs from a template's plan."""

    batch: int
    sp: int
    slo_s: float
    latency_s: float  # predicted batch latency, for the simulator and for Retry-After hints


@dataclass(order=True)
class Pending(Generic[P]):
    deadline: float
    seq: int
    template: str = field(compare=False)
    arrival: float = field(compare=False)
    request_id: str = field(compare=False)
    payload: P | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Assignment(Generic[P]):
    """A batch placed on a group of workers."""

    batch_id: int
    template: str
    workers: tuple[int, ...]
    requests: tuple[Pending[P], ...]
    plan: DispatchPlan


class Dispatcher(Generic[P]):
    """Batching + EDF + SP-group placement for one model's workers.

    Args:
        plans: template key -> DispatchPlan.
        workers: number of workers (GPUs) of the model group.
        wait_window_s: longest a request waits for its batch to fill before a partial batch runs.
        max_queue: requests queued per template beyond which ``submit`` refuses (HTTP 503).

    Example:
        >>> d = Dispatcher({"t": DispatchPlan(batch=2, sp=1, slo_s=10, latency_s=1)}, workers=1)
        >>> d.submit("t", "r1", now=0.0)
        >>> d.submit("t", "r2", now=0.1)
        >>> [a.workers for a in d.dispatch(now=0.1)]
        [(0,)]
    """

    def __init__(self, plans: dict[str, DispatchPlan], workers: int, wait_window_s: float = 0.05,
                 max_queue: int = 256) -> None:
        if workers < 1:
            raise ValueError(f"a model group needs at least one worker, got {workers}")
        for key, p in plans.items():
            if p.batch < 1 or p.sp < 1:
                raise ValueError(f"{key}: batch and sp must be >= 1, got batch={p.batch} sp={p.sp}")
            if p.sp > workers:
                raise ValueError(f"{key}: plan needs SP {p.sp} but the group has {workers} workers")
        self.plans = dict(plans)
        self.workers = workers
        self.wait_window_s = wait_window_s
        self.max_queue = max_queue
        self._queues: dict[str, list[Pending[P]]] = {k: [] for k in plans}
        self._busy: dict[int, int] = {}  # worker -> batch id
        self._running: dict[int, Assignment[P]] = {}
        self._seq = itertools.count()
        self._batch_ids = itertools.count()

    # ------------------------------------------------------------------ queue
    def submit(self, template: str, request_id: str, now: float, payload: P | None = None) -> None:
        """Queue a request. Raises KeyError for an unplanned template, OverflowError when full."""
        if template not in self.plans:
            raise KeyError(template)
        q = self._queues[template]
        if len(q) >= self.max_queue:
            raise OverflowError(f"{template}: {len(q)} requests queued (limit {self.max_queue})")
        plan = self.plans[template]
        heapq.heappush(q, Pending(now + plan.slo_s, next(self._seq), template, now, request_id, payload))

    def requeue(self, assignment: Assignment[P]) -> None:
        """Put a failed batch's requests back at the front (their deadlines are unchanged)."""
        for r in assignment.requests:
            heapq.heappush(self._queues[r.template], r)

    def cancel(self, request_id: str) -> bool:
        """Remove a queued request (False: it is not queued — running, finished or unknown)."""
        for q in self._queues.values():
            for i, r in enumerate(q):
                if r.request_id == request_id:
                    q.pop(i)
                    heapq.heapify(q)
                    return True
        return False

    def queue_depth(self, template: str | None = None) -> int:
        if template is not None:
            return len(self._queues.get(template, ()))
        return sum(len(q) for q in self._queues.values())

    # ------------------------------------------------------------------ placement
    def _free_group(self, sp: int) -> tuple[int, ...] | None:
        for start in range(0, self.workers - sp + 1, sp):
            group = tuple(range(start, start + sp))
            if not any(w in self._busy for w in group):
                return group
        return None

    def _ready(self, template: str, now: float) -> bool:
        q = self._queues[template]
        if not q:
            return False
        plan = self.plans[template]
        oldest = min(r.arrival for r in q)
        return len(q) >= plan.batch or now - oldest >= self.wait_window_s

    def dispatch(self, now: float) -> list[Assignment[P]]:
        """Batches to start now: templates by earliest head deadline, each on a free SP group."""
        started: list[Assignment[P]] = []
        order = sorted((q[0].deadline, t) for t, q in self._queues.items() if q)
        for _, template in order:
            while self._ready(template, now):
                plan = self.plans[template]
                group = self._free_group(plan.sp)
                if group is None:
                    break
                q = self._queues[template]
                reqs = tuple(heapq.heappop(q) for _ in range(min(plan.batch, len(q))))
                a = Assignment(next(self._batch_ids), template, group, reqs, plan)
                for w in group:
                    self._busy[w] = a.batch_id
                self._running[a.batch_id] = a
                started.append(a)
        return started

    def complete(self, batch_id: int) -> Assignment[P]:
        """Free the batch's workers (success or failure) and return its assignment."""
        a = self._running.pop(batch_id)
        for w in a.workers:
            self._busy.pop(w, None)
        return a

    def next_wakeup(self, now: float) -> float | None:
        """Earliest time a waiting partial batch becomes ready (None: nothing is waiting)."""
        times = [min(r.arrival for r in q) + self.wait_window_s for q in self._queues.values() if q]
        return min(times) if times else None

    @property
    def running(self) -> list[Assignment[P]]:
        return list(self._running.values())
