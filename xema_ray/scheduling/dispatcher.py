"""The dispatch policy of a model's GPU worker set (paper §4, Figure 3), with no I/O and no clock.

One ``Dispatcher`` per model keeps a queue per template, forms batches of up to the plan's batch
size (waiting at most a short window for a batch to fill), serves templates earliest-deadline
first (deadline = arrival + the template's SLO), and places each batch on a free group of the
plan's SP size. SP groups are aligned blocks of workers — ``[0,1]``, ``[2,3]`` for SP 2 — so
SP-2 groups fall on NVLink pairs when the workers are ordered by the topology. DP is how many
such groups run at once.

The live ModelGroup deployment drives it with wall-clock time and the cluster simulator
(``xema_ray.sim``) with virtual time: the same code decides in both.

It holds its two optional parts, each with the state it keeps: step-level preemption
(``step_preemption``, with a ``PreemptionPolicy``: running batches paused at a step boundary for a
more urgent one, ``preemption_policy.py``) and SLO-aware admission (``slo_admission``, with an
``AdmissionPolicy``: late requests set aside or shed, ``admission.py``). All three read and write
one ``DispatchState`` (plans, queues, which workers run or hold which batch). What it works with —
plans, queued requests, assignments — is ``batch.py``'s.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from typing import Generic

from xema_ray.plan import AdmissionPolicy
from xema_ray.scheduling.admission import Refused, SloAdmission
from xema_ray.scheduling.batch import Assignment, DispatchPlan, DispatchState, P, Pending, pop_batch
from xema_ray.scheduling.batch_key import DEFAULT_BATCH_POLICY, BatchKey, BatchPolicy
from xema_ray.scheduling.preemption_policy import Decision, Preemption, PreemptionPolicy, StepPreemption


class Dispatcher(Generic[P]):
    """Batching + EDF + SP-group placement for one model's workers.

    Args:
        plans: template key -> DispatchPlan.
        workers: number of workers (GPUs) of the model group.
        wait_window_s: longest a request waits for its batch to fill before a partial batch runs.
        max_queue: requests queued per template beyond which ``submit`` refuses (HTTP 503).
        preemption: step-level preemption (``preemption_policy.py``); None: off.
        admission: SLO-aware admission (``admission.py``); None: plain EDF, every request served.
        batching: what one batch may mix (``batch_key.BatchPolicy``): ``by_key``, requests of one
            ``BatchKey`` only; ``mixed``, any guidance of one step count and tier, one sub-batch each.
            Either way every batch is priced as it runs (``DispatchPlan.batch_seconds``).

    Example:
        >>> d = Dispatcher({"t": DispatchPlan(batch=2, sp=1, slo_s=10, latency_s=1)}, workers=1)
        >>> d.submit("t", "r1", now=0.0, key=BatchKey(steps=1))
        >>> d.submit("t", "r2", now=0.1, key=BatchKey(steps=1))
        >>> [a.workers for a in d.dispatch(now=0.1)]
        [(0,)]
    """

    def __init__(self, plans: dict[str, DispatchPlan], workers: int, wait_window_s: float = 0.05,
                 max_queue: int = 256, preemption: PreemptionPolicy | None = None,
                 admission: AdmissionPolicy | None = None, batching: BatchPolicy = DEFAULT_BATCH_POLICY) -> None:
        if batching not in ("by_key", "mixed"):
            raise ValueError(f"batching must be 'by_key' or 'mixed', got {batching!r}")
        if workers < 1:
            raise ValueError(f"a model group needs at least one worker, got {workers}")
        for key, p in plans.items():
            if p.batch < 1 or p.sp < 1:
                raise ValueError(f"{key}: batch and sp must be >= 1, got batch={p.batch} sp={p.sp}")
            if p.sp > workers:
                raise ValueError(f"{key}: plan needs SP {p.sp} but the group has {workers} workers")
        self.workers = workers
        self.wait_window_s = wait_window_s
        self.max_queue = max_queue
        self.state: DispatchState[P] = DispatchState(dict(plans), workers, queues={k: [] for k in plans},
                                                     batching=batching)
        self._seq = itertools.count()
        self.step_preemption: StepPreemption[P] = StepPreemption(self.state, preemption)
        self.slo_admission: SloAdmission[P] = SloAdmission(self.state, admission)

    # ------------------------------------------------------------------ the state and the parts' answers
    @property
    def plans(self) -> dict[str, DispatchPlan]:
        return self.state.plans

    @property
    def batching(self) -> BatchPolicy:
        """What one batch may mix (``batch_key.BatchPolicy``)."""
        return self.state.batching

    @property
    def preemption(self) -> PreemptionPolicy | None:
        return self.step_preemption.policy

    @property
    def admission(self) -> AdmissionPolicy | None:
        return self.slo_admission.policy

    @property
    def decisions(self) -> collections.deque[Decision]:
        """The latest preemption decisions (``StepPreemption.decisions``)."""
        return self.step_preemption.decisions

    @property
    def preemptions_total(self) -> int:
        return self.step_preemption.preemptions_total

    @property
    def shed_total(self) -> int:
        return self.slo_admission.shed_total

    @property
    def paused(self) -> list[Assignment[P]]:
        return self.step_preemption.paused

    def assignment(self, batch_id: int) -> Assignment[P]:
        """A running or paused batch's assignment."""
        return self.step_preemption.assignment(batch_id)

    def remaining_s(self, batch_id: int, now: float) -> float:
        """Predicted seconds a running or paused batch still needs (its plan's latency less what it ran)."""
        return self.step_preemption.remaining_s(batch_id, now)

    def preempted_count(self, request_id: str) -> int:
        return self.step_preemption.preempted_count(request_id)

    def take_shed(self) -> list[Pending[P]]:
        """The requests shed since the last call (the caller answers them: 503, missed)."""
        return self.slo_admission.take_shed()

    # ------------------------------------------------------------------ queue
    def submit(self, template: str, request_id: str, now: float, payload: P | None = None, *, key: BatchKey,
               deadline: float | None = None) -> None:
        """Queue a request (``key``: what its batch cannot mix, its steps resolved where the request met
        its template; its deadline is the SLO scaled to them, ``DispatchPlan.for_steps``; ``deadline``:
        one it already has, the request's second stage: ``xema_ray.scheduling.decode_stage``). Raises
        KeyError for an unplanned template, OverflowError when full."""
        if template not in self.plans:
            raise KeyError(template)
        if self.admission is not None and template in self.admission.refused:
            raise Refused(f"{template}: not admitted at this group's planned load (admission policy)")
        q = self.state.queues[template]
        if len(q) >= self.max_queue:
            raise OverflowError(f"{template}: {len(q)} requests queued (limit {self.max_queue})")
        plan = self.plans[template].for_steps(key.steps)
        due = now + plan.slo_s if deadline is None else deadline
        heapq.heappush(q, Pending(due, next(self._seq), template, now, request_id, key, payload))

    def requeue(self, assignment: Assignment[P]) -> None:
        """Put a failed batch's requests back at the front (their deadlines are unchanged)."""
        for r in assignment.requests:
            heapq.heappush(self.state.queues[r.template], r)

    def cancel(self, request_id: str) -> bool:
        """Remove a queued request (False: it is not queued — running, finished or unknown)."""
        for q in (*self.state.queues.values(), *self.slo_admission.late.values()):
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

    def observe_pause_bytes(self, template: str, state_bytes: int) -> None:
        """A paused batch of ``template`` holds ``state_bytes`` (what its workers measured): the plan's
        figure from now on if it is larger (the memory checks of later preemptions use it); a plan
        that never pauses (``pause_bytes`` None) stays so."""
        plan = self.plans[template]
        if plan.pause_bytes is not None and state_bytes > plan.pause_bytes:
            self.plans[template] = dataclasses.replace(plan, pause_bytes=state_bytes)

    def queued(self, template: str) -> list[Pending[P]]:
        """A template's queued requests, earliest deadline first (a copy: for summaries)."""
        return sorted(self.state.queues.get(template, ()))

    def queue_depth(self, template: str | None = None) -> int:
        queues, late = self.state.queues, self.slo_admission.late
        if template is not None:
            return len(queues.get(template, ())) + len(late.get(template, ()))
        return sum(len(q) for q in queues.values()) + sum(len(q) for q in late.values())

    # ------------------------------------------------------------------ placement
    def _ready(self, template: str, now: float) -> bool:
        q = self.state.queues[template]
        if not q:
            return False
        plan = self.plans[template].for_steps(q[0].steps)
        oldest = min(r.arrival for r in q)
        # ``now >= oldest + window``, the very sum ``next_wakeup`` returns: ``now - oldest >= window``
        # can be False at that wake-up by rounding, and the partial batch then waited for the next event
        if sum(q[0].key.joins(r.key, self.batching) for r in q) >= plan.batch or now >= oldest + self.wait_window_s:
            return True
        # waiting out the window would make the head request miss: start the partial batch now
        adm = self.admission
        if adm is None or not adm.partial_when_late:
            return False
        return oldest + self.wait_window_s + plan.held_s([r.key for r in self.state.next_batch(template)]) > q[0].deadline

    def replace_plans(self, plans: dict[str, DispatchPlan], admission: AdmissionPolicy | None = None) -> None:
        """Serve new plans for the same templates (a new plan table), every queued request kept
        (its deadline as it was). Call with no batch running or paused."""
        if set(plans) != set(self.plans):
            raise ValueError(f"new plans must cover the same templates: {sorted(self.plans)}, got {sorted(plans)}")
        if self.state.running or self.step_preemption.holds():
            raise RuntimeError(f"{len(self.state.running)} batches running and {len(self.paused)} paused: finish them first")
        for key, p in plans.items():
            if p.batch < 1 or p.sp < 1 or p.sp > self.workers:
                raise ValueError(f"{key}: batch and sp must be >= 1 and sp <= {self.workers}, got batch={p.batch} sp={p.sp}")
        self.state.plans = dict(plans)
        self.slo_admission.policy = admission  # requests it set aside as late stay where they are

    def dispatch(self, now: float, start_new: bool = True) -> list[Assignment[P]]:
        """Batches to start now: paused ones whose workers are free first, then templates by
        earliest head deadline, each on a free SP group, or by preempting (``preemption_policy.py``).
        ``start_new`` False: only the paused ones (new batches are held)."""
        st, late = self.state, self.slo_admission
        started: list[Assignment[P]] = self.step_preemption.resumable(now)
        if not start_new:
            return started
        if self.admission is not None and self.admission.late != "serve":
            late.set_aside_late(now)
        order = sorted((q[0].deadline, t) for t, q in st.queues.items() if q)
        for _, template in order:
            while self._ready(template, now):
                plan = st.plans[template].for_steps(st.queues[template][0].steps)
                group = st.free_group(plan.sp)
                preempts: tuple[Preemption, ...] = ()
                park_wait = 0.0
                if group is None:
                    chosen = self.step_preemption.preemptible_group(template, now)
                    if chosen is None:
                        break
                    group, preempts, park_wait = chosen
                reqs = pop_batch(st.queues[template], plan.batch, self.batching)
                a = st.start(template, group, reqs, plan, now, preempts, park_wait)
                for p in preempts:  # their workers now hold them, paused
                    self.step_preemption.pause(p, a, now)
                started.append(a)
        if any(late.late.values()) and not any(st.queues.values()):
            started += late.start_late(now)  # nothing that can still meet its SLO waits
        return started

    def complete(self, batch_id: int) -> Assignment[P]:
        """Free the batch's workers (success or failure) and return its assignment. A batch the
        dispatcher paused may finish instead (its last step was already running): it is done."""
        st = self.state
        st.progress.pop(batch_id, None)
        a = self.step_preemption.finished(batch_id)  # paused: its workers hold it no longer
        if a is None:
            a = st.running.pop(batch_id)
            for w in a.workers:
                if st.busy.get(w) == batch_id:
                    del st.busy[w]
        self.step_preemption.forget(a)
        return a

    def extend(self, batch_id: int, more_s: float, now: float) -> None:
        """A running (or paused) batch needs ``more_s`` seconds more from ``now``: its group runs
        part of it again (``xema_ray.serving.group.isolation``: a request failed it). Its expected
        end moves there, so the preemption policy and the replica's summary see the workers busy
        that long. Counted, as every running batch is, against ``Assignment.held_s``: a partial
        batch keeps the difference to what it runs as (``Assignment.run_s``) on top."""
        prog = self.state.progress.get(batch_id)
        if prog is None:
            return
        a = self.assignment(batch_id)
        running = now - prog.since if prog.since is not None else 0.0
        remaining = more_s + a.held_s - a.run_s
        prog.ran_s = a.held_s - remaining - running  # so that ``remaining_s`` is ``remaining``

    def next_wakeup(self, now: float) -> float | None:
        """Earliest time after ``now`` at which a waiting partial batch becomes ready (None: no
        batch becomes ready by waiting). A batch that is ready already but found no free group
        waits for the next event instead (a batch ends, a request arrives), in the live group as
        in the simulator: a dispatch loop woken again at once would spin while it waits (and, on
        the replica's event loop, starve the threads that run the batches)."""
        times = [t for q in self.state.queues.values() if q and (t := min(r.arrival for r in q) + self.wait_window_s) > now]
        return min(times) if times else None

    @property
    def running(self) -> list[Assignment[P]]:
        return list(self.state.running.values())

