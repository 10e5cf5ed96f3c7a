"""The dispatch policy of a model's GPU worker set (paper §4, Figure 3), with no I/O and no clock.

One ``Dispatcher`` per model keeps a queue per template, forms batches of up to the plan's batch
size (waiting at most a short window for a batch to fill), serves templates earliest-deadline
first (deadline = arrival + the template's SLO), and places each batch on a free group of the
plan's SP size. SP groups are aligned blocks of workers — ``[0,1]``, ``[2,3]`` for SP 2 — so
SP-2 groups fall on NVLink pairs when the workers are ordered by the topology. DP is how many
such groups run at once.

The live ModelGroup deployment drives it with wall-clock time and the cluster simulator
(``xema_ray.sim``) with virtual time: the same code decides in both.

Step-level preemption (with a ``PreemptionPolicy``): a waiting batch whose head request would
miss its deadline by waiting for a free group, but meets it if it starts now, may take the
workers of running batches that are paused at their next denoising-step boundary — when each of
them still meets its own deadline after the delay (or has lost it already), none of its requests
has been preempted ``max_preemptions`` times, and memory allows it: on every worker the incoming
batch's planned peak plus the paused state (kept on the device) is within the budget, else the
paused state moves to host memory where the host has room, else there is no preemption (a batch
that ran with a static layout always moves its state: it lies in the layout's arena, which the
next armed batch reuses). A paused
batch resumes first, as soon as its workers are free; its workers take no other batch meanwhile
except through this same rule. Every decision is logged (``decisions``), so the live group and
the simulator can be compared.

SLO-aware dispatch (with an ``AdmissionPolicy``, chosen by the load-aware planner per group): a
partial batch starts at once when waiting for it to fill would make its oldest request miss; a
queued request that can no longer meet its SLO even if started now alone is, by the policy's
``late``, served in deadline order as before, deprioritised (run only when no request that still
can is waiting), or shed when others wait (``take_shed``; the caller answers it 503, attainment
counts it as missed); templates the policy refuses at this load are refused at ``submit``.
Without a policy the dispatcher behaves as it always has.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.plan import AdmissionPolicy

if TYPE_CHECKING:
    from xema_ray.plan import PlanEntry
    from xema_ray.profiling.phases import PhaseShares

P = TypeVar("P")  # what a request carries (the HTTP payload live, nothing in simulation)

MAX_DECISIONS_KEPT = 10_000


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
        c, p = entry.config, entry.prediction
        phases = {} if shares is None else {"denoise_frac": shares.denoise, "decode_encode_frac": shares.decode_encode}
        return cls(batch=c.batch, sp=c.sp, slo_s=p.slo_s if slo_s is None else slo_s, latency_s=p.latency_s,
                   steps=c.template.steps, peak_bytes=p.peak_bytes, pause_bytes=p.pause_bytes,
                   static_layout=c.layout_ref is not None, min_latency_s=p.latency_by_batch.get(1), **phases)


class Refused(OverflowError):
    """A template the group's admission policy does not admit at its planned load (HTTP 503)."""


class PreemptionPolicy(BaseModel):
    """When running batches may be paused for a waiting one (see the module docstring); it
    travels from the app to each model group as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget_bytes: int = Field(ge=1, description="device memory per worker")
    host_bytes: int | None = Field(default=None, ge=0,
                                   description="host memory per worker a paused state may move to (None: unbounded)")
    max_preemptions: int = Field(default=2, ge=1, description="most times one request is paused")
    switch_s: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="residency switch seconds, switch_s[from][to] (the plan table's)")
    host_bandwidth: float = Field(default=20e9, gt=0, description="bytes/s of a paused state's move to the host and back")

    def move_s(self, nbytes: int | None) -> float:
        """Seconds of one move of a paused state of ``nbytes`` between the device and the host."""
        return (nbytes or 0) / self.host_bandwidth


@dataclass(frozen=True)
class Preemption:
    """A running batch to pause at its next step boundary, its state kept or moved to the host."""

    batch_id: int
    offload: bool


@dataclass(frozen=True)
class Decision:
    """One preemption decision, for logs and the live-versus-simulated comparison."""

    t: float
    kind: Literal["preempt", "resume"]
    batch_id: int
    template: str
    requests: tuple[str, ...]
    by: tuple[str, ...] = ()  # the preempting batch's requests
    offload: bool = False


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
    preempts: tuple[Preemption, ...] = ()  # batches that pause so this one runs on their workers
    resume: bool = False  # a paused batch continuing on its own workers
    park_wait_s: float = 0.0  # predicted seconds until ``preempts`` have parked (step boundary, switch, move out)


@dataclass
class _Progress:
    """How long a batch has run (for its remaining time) and where it holds paused state."""

    ran_s: float = 0.0
    since: float | None = None  # running since (None: paused)
    offloaded: bool = False

    def remaining(self, latency_s: float, now: float) -> float:
        ran = self.ran_s + (now - self.since if self.since is not None else 0.0)
        return max(0.0, latency_s - ran)


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
                 max_queue: int = 256, preemption: PreemptionPolicy | None = None,
                 admission: AdmissionPolicy | None = None) -> None:
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
        self.preemption = preemption
        self._progress: dict[int, _Progress] = {}
        self._paused: dict[int, Assignment[P]] = {}
        self._held: dict[int, int] = {}  # worker -> paused batch whose state it holds
        self._times_preempted: dict[str, int] = {}  # request id -> pauses so far
        #: the latest decisions (bounded: a server runs for months), and how many there were
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=MAX_DECISIONS_KEPT)
        self.preemptions_total = 0
        self.admission = admission
        self._late: dict[str, list[Pending[P]]] = {k: [] for k in plans}  # can no longer meet their SLO
        self._shed: list[Pending[P]] = []  # dropped, for the caller to answer (take_shed)
        self.shed_total = 0

    # ------------------------------------------------------------------ queue
    def submit(self, template: str, request_id: str, now: float, payload: P | None = None) -> None:
        """Queue a request. Raises KeyError for an unplanned template, OverflowError when full."""
        if template not in self.plans:
            raise KeyError(template)
        if self.admission is not None and template in self.admission.refused:
            raise Refused(f"{template}: not admitted at this group's planned load (admission policy)")
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
        for q in (*self._queues.values(), *self._late.values()):
            for i, r in enumerate(q):
                if r.request_id == request_id:
                    q.pop(i)
                    heapq.heapify(q)
                    return True
        return False

    def set_phases(self, template: str, denoise_frac: float, decode_encode_frac: float) -> None:
        """Measured shares of ``template``'s latency in its denoising steps and after them (decode,
        encode): where its step boundaries fall (a batch past its last step has none left).
        Shares, not seconds: the plan's latency stays what the dispatcher predicts with."""
        if not (0 < denoise_frac <= 1 and 0 <= decode_encode_frac < 1 and denoise_frac + decode_encode_frac <= 1 + 1e-9):
            raise ValueError(f"{template}: phase shares must lie in (0, 1], got denoise {denoise_frac}, decode_encode {decode_encode_frac}")
        self.plans[template] = dataclasses.replace(self.plans[template], denoise_frac=denoise_frac, decode_encode_frac=decode_encode_frac)

    def queued(self, template: str) -> list[Pending[P]]:
        """A template's queued requests, earliest deadline first (a copy: for summaries)."""
        return sorted(self._queues.get(template, ()))

    def queue_depth(self, template: str | None = None) -> int:
        if template is not None:
            return len(self._queues.get(template, ())) + len(self._late.get(template, ()))
        return sum(len(q) for q in self._queues.values()) + sum(len(q) for q in self._late.values())

    # ------------------------------------------------------------------ placement
    def _free_group(self, sp: int) -> tuple[int, ...] | None:
        for start in range(0, self.workers - sp + 1, sp):
            group = tuple(range(start, start + sp))
            if not any(w in self._busy or w in self._held for w in group):
                return group
        return None

    def _ready(self, template: str, now: float) -> bool:
        q = self._queues[template]
        if not q:
            return False
        plan = self.plans[template]
        oldest = min(r.arrival for r in q)
        # ``now >= oldest + window``, the very sum ``next_wakeup`` returns: ``now - oldest >= window``
        # can be False at that wake-up by rounding, and the partial batch then waited for the next event
        if len(q) >= plan.batch or now >= oldest + self.wait_window_s:
            return True
        # waiting out the window would make the head request miss: start the partial batch now
        adm = self.admission
        return adm is not None and adm.partial_when_late and oldest + self.wait_window_s + plan.latency_s > q[0].deadline

    def dispatch(self, now: float) -> list[Assignment[P]]:
        """Batches to start now: paused ones whose workers are free first, then templates by
        earliest head deadline, each on a free SP group, or by preempting (see the module docstring)."""
        started: list[Assignment[P]] = self._resumable(now)
        if self.admission is not None and self.admission.late != "serve":
            self._set_aside_late(now)
        order = sorted((q[0].deadline, t) for t, q in self._queues.items() if q)
        for _, template in order:
            while self._ready(template, now):
                plan = self.plans[template]
                group = self._free_group(plan.sp)
                preempts: tuple[Preemption, ...] = ()
                park_wait = 0.0
                if group is None:
                    chosen = self._preemptible_group(template, now)
                    if chosen is None:
                        break
                    group, preempts, park_wait = chosen
                q = self._queues[template]
                reqs = tuple(heapq.heappop(q) for _ in range(min(plan.batch, len(q))))
                a = Assignment(next(self._batch_ids), template, group, reqs, plan, preempts, park_wait_s=park_wait)
                for p in preempts:
                    self._pause(p, a, now)
                for w in group:
                    self._busy[w] = a.batch_id
                self._running[a.batch_id] = a
                self._progress[a.batch_id] = _Progress(since=now)
                started.append(a)
        if any(self._late.values()) and not any(self._queues.values()):
            started += self._start_late(now)  # nothing that can still meet its SLO waits
        return started

    # ------------------------------------------------------------------ SLO-aware admission
    def _set_aside_late(self, now: float) -> None:
        """Move queued requests that can no longer meet their SLO (even started now, alone) to the
        late queues; under ``shed``, drop them instead while requests that still can are waiting."""
        for template, q in self._queues.items():
            plan = self.plans[template]
            fastest = plan.min_latency_s if plan.min_latency_s is not None else plan.latency_s
            if not q or now + fastest <= q[0].deadline + 1e-9:
                continue  # the head (earliest deadline) can still make it, so can the rest
            keep = [r for r in q if now + fastest <= r.deadline + 1e-9]
            for r in q:
                if now + fastest > r.deadline + 1e-9:
                    heapq.heappush(self._late[template], r)
            heapq.heapify(keep)
            self._queues[template] = keep
        if self.admission is not None and self.admission.late == "shed" and any(self._queues.values()):
            for template, late in self._late.items():
                self._shed += late
                self.shed_total += len(late)
                self._late[template] = []

    def _start_late(self, now: float) -> list[Assignment[P]]:
        """Late requests on free groups, earliest deadline first (no waiting, no preemption)."""
        out: list[Assignment[P]] = []
        for _, template in sorted((q[0].deadline, t) for t, q in self._late.items() if q):
            plan, q = self.plans[template], self._late[template]
            while q:
                group = self._free_group(plan.sp)
                if group is None:
                    break
                reqs = tuple(heapq.heappop(q) for _ in range(min(plan.batch, len(q))))
                a = Assignment(next(self._batch_ids), template, group, reqs, plan)
                for w in group:
                    self._busy[w] = a.batch_id
                self._running[a.batch_id] = a
                self._progress[a.batch_id] = _Progress(since=now)
                out.append(a)
        return out

    def take_shed(self) -> list[Pending[P]]:
        """The requests shed since the last call (the caller answers them: 503, missed)."""
        out, self._shed = self._shed, []
        return out

    def complete(self, batch_id: int) -> Assignment[P]:
        """Free the batch's workers (success or failure) and return its assignment. A batch the
        dispatcher paused may finish instead (its last step was already running): it is done."""
        self._progress.pop(batch_id, None)
        if batch_id in self._paused:
            a = self._paused.pop(batch_id)
            owner = self._held
        else:
            a = self._running.pop(batch_id)
            owner = self._busy
        for w in a.workers:
            if owner.get(w) == batch_id:
                del owner[w]
        for r in a.requests:
            self._times_preempted.pop(r.request_id, None)
        return a

    # ------------------------------------------------------------------ preemption
    def _resumable(self, now: float) -> list[Assignment[P]]:
        out = []
        for bid, a in sorted(self._paused.items(), key=lambda kv: _deadline(kv[1])):
            if any(w in self._busy for w in a.workers):
                continue
            del self._paused[bid]
            for w in a.workers:
                self._held.pop(w, None)
                self._busy[w] = bid
            self._running[bid] = a
            self._progress[bid].since = now
            self.decisions.append(Decision(now, "resume", bid, a.template, _ids(a)))
            out.append(Assignment(a.batch_id, a.template, a.workers, a.requests, a.plan, resume=True))
        return out

    def _pause(self, p: Preemption, by: Assignment[P], now: float) -> None:
        a = self._running.pop(p.batch_id)
        prog = self._progress[p.batch_id]
        prog.ran_s += now - (prog.since if prog.since is not None else now)
        prog.since, prog.offloaded = None, p.offload
        self._paused[p.batch_id] = a
        for w in a.workers:
            if self._busy.get(w) == p.batch_id:
                del self._busy[w]
            self._held[w] = p.batch_id
        for r in a.requests:
            self._times_preempted[r.request_id] = self._times_preempted.get(r.request_id, 0) + 1
        self.decisions.append(Decision(now, "preempt", p.batch_id, a.template, _ids(a), _ids(by), p.offload))
        self.preemptions_total += 1

    def assignment(self, batch_id: int) -> Assignment[P]:
        """A running or paused batch's assignment."""
        a = self._running.get(batch_id)
        return a if a is not None else self._paused[batch_id]

    def remaining_s(self, batch_id: int, now: float) -> float:
        """Predicted seconds a running or paused batch still needs (its plan's latency less what it ran)."""
        return self._progress[batch_id].remaining(self.assignment(batch_id).plan.latency_s, now)

    def _expected_end(self, bid: int, now: float) -> float:
        a = self.assignment(bid)
        prog = self._progress[bid]
        return now + prog.remaining(a.plan.latency_s, now)

    def _to_boundary(self, bid: int, now: float) -> float | None:
        """Seconds until running batch ``bid`` reaches its next step boundary (None: its steps are
        done, it is in its decode tail). Counted back from its expected end, so the tail (often
        most of a tiny video's time) is not spread over the steps."""
        a = self._running[bid]
        v = self.plans[a.template]
        step = a.plan.latency_s * v.denoise_frac / max(1, a.plan.steps)
        denoise_left = self._progress[bid].remaining(a.plan.latency_s, now) - a.plan.latency_s * v.decode_encode_frac
        # the boundary after the last step is none: a worker pauses only between steps (step < total)
        if step <= 0 or denoise_left <= step * (1 + 1e-9):
            return None
        return min(step, (denoise_left - step) % step or step)

    def _free_at(self, group: tuple[int, ...], now: float) -> float:
        """When ``group`` would be free without preemption (running batches end, paused ones
        resume after them and end)."""
        t = now
        for w in group:
            if w in self._busy:
                t = max(t, self._expected_end(self._busy[w], now))
        for held in {self._held[w] for w in group if w in self._held}:
            t += self._progress[held].remaining(self._paused[held].plan.latency_s, now)
        return t

    def _switch_s(self, a: str, b: str) -> float:
        assert self.preemption is not None
        return self.preemption.switch_s.get(a, {}).get(b, 0.0) if a != b else 0.0

    def _preemptible_group(self, template: str, now: float
                           ) -> tuple[tuple[int, ...], tuple[Preemption, ...], float] | None:
        """A group for ``template``'s next batch by pausing running batches, the pauses, and the
        seconds until they have parked; or None."""
        pol = self.preemption
        plan = self.plans[template]
        if pol is None or plan.peak_bytes is None:
            return None
        head = self._queues[template][0]
        groups = [tuple(range(s, s + plan.sp)) for s in range(0, self.workers - plan.sp + 1, plan.sp)]
        if not groups or min(self._free_at(g, now) for g in groups) + plan.latency_s <= head.deadline:
            return None  # waiting costs it nothing
        best: tuple[tuple[float, int], tuple[int, ...], tuple[Preemption, ...], float] | None = None
        for g in groups:
            if any(w in self._held for w in g):
                continue  # a worker already holds a paused batch
            victims = sorted({self._busy[w] for w in g if w in self._busy})
            pauses = []
            wait = 0.0
            for bid in victims:
                p = self._pause_for(bid, template, plan, head.deadline, now)
                if p is None:
                    break
                pauses.append(p)
                boundary = self._to_boundary(bid, now)
                assert boundary is not None  # _pause_for refuses a batch with no boundary left
                # the state leaves the device before the preempting batch may start (it is moved back on resume)
                move = pol.move_s(self.plans[self._running[bid].template].pause_bytes) if p.offload else 0.0
                wait = max(wait, boundary + self._switch_s(self._running[bid].template, template) + move)
            else:
                if now + wait + plan.latency_s > head.deadline:
                    continue  # preempting does not save it either
                slack = min((_deadline(self._running[b]) for b in victims), default=float("inf"))
                key = (len(victims), -slack)
                if best is None or key < best[0]:
                    best = (key, g, tuple(pauses), wait)
        return None if best is None else (best[1], best[2], best[3])

    def _pause_for(self, bid: int, template: str, plan: DispatchPlan, deadline: float, now: float) -> Preemption | None:
        """How running batch ``bid`` would pause for a batch of ``template``, or None if it may not."""
        pol = self.preemption
        assert pol is not None and plan.peak_bytes is not None
        a = self._running[bid]
        v = self.plans[a.template]  # its pause_bytes may have been raised to what the workers measured
        lost = self._expected_end(bid, now) > _deadline(a)  # it misses its deadline whatever happens now
        if v.pause_bytes is None or a.template == template or (_deadline(a) <= deadline and not lost):
            return None  # unknown state size; same template (EDF already orders it); more urgent and still on time
        if self._to_boundary(bid, now) is None:
            return None  # in its decode: it ends before it could pause
        if any(self._times_preempted.get(r.request_id, 0) >= pol.max_preemptions for r in a.requests):
            return None
        if plan.peak_bytes + v.pause_bytes <= pol.budget_bytes and not v.static_layout:
            offload, moves = False, 0.0
        elif pol.host_bytes is None or v.pause_bytes <= pol.host_bytes:
            offload, moves = True, 2 * pol.move_s(v.pause_bytes)
        else:
            return None  # neither the device nor the host has room for the paused state
        delay = plan.latency_s + self._switch_s(a.template, template) + self._switch_s(template, a.template) + moves
        end = self._expected_end(bid, now)
        if end + delay > _deadline(a) and end <= _deadline(a):
            return None  # it would meet its deadline, and the pause would make it miss
        return Preemption(bid, offload)

    def preempted_count(self, request_id: str) -> int:
        return self._times_preempted.get(request_id, 0)

    @property
    def paused(self) -> list[Assignment[P]]:
        return list(self._paused.values())

    def next_wakeup(self, now: float) -> float | None:
        """Earliest time after ``now`` at which a waiting partial batch becomes ready (None: no
        batch becomes ready by waiting). A batch that is ready already but found no free group
        waits for the next event instead (a batch ends, a request arrives), in the live group as
        in the simulator: a dispatch loop woken again at once would spin while it waits (and, on
        the replica's event loop, starve the threads that run the batches)."""
        times = [t for q in self._queues.values() if q and (t := min(r.arrival for r in q) + self.wait_window_s) > now]
        return min(times) if times else None

    @property
    def running(self) -> list[Assignment[P]]:
        return list(self._running.values())


def _deadline(a: Assignment[P]) -> float:
    return min(r.deadline for r in a.requests)


def _ids(a: Assignment[P]) -> tuple[str, ...]:
    return tuple(r.request_id for r in a.requests)
