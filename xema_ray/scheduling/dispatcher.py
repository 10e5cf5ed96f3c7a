"""The dispatch policy of a model's GPU worker set (paper §4, Figure 3), with no I/O and no clock.

One ``Dispatcher`` per model keeps a queue per template, forms batches of up to the plan's batch
size (waiting at most a short window for a batch to fill), serves templates earliest-deadline
first (deadline = arrival + the template's SLO), and places each batch on a free group of the
plan's SP size. SP groups are aligned blocks of workers — ``[0,1]``, ``[2,3]`` for SP 2 — so
SP-2 groups fall on NVLink pairs when the workers are ordered by the topology. DP is how many
such groups run at once.

The live ModelGroup deployment drives it with wall-clock time and the cluster simulator
(``xema_ray.sim``) with virtual time: the same code decides in both.

Its two optional parts live beside it, each with the state it keeps: step-level preemption (with a
``PreemptionPolicy``: running batches paused at a step boundary for a more urgent one,
``preemption_policy.py``) and SLO-aware admission (with an ``AdmissionPolicy``: late requests set
aside or shed, ``admission.py``). What it works with — plans, queued requests, assignments — is
``batch.py``'s.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from xema_ray.plan import AdmissionPolicy
from xema_ray.scheduling.admission import Refused, SloAdmission
from xema_ray.scheduling.batch import Assignment, BatchProgress, DispatchPlan, P, Pending, pop_batch
from xema_ray.scheduling.preemption_policy import Preemption, PreemptionPolicy, StepPreemption


class Dispatcher(StepPreemption[P], SloAdmission[P]):
    """Batching + EDF + SP-group placement for one model's workers.

    Args:
        plans: template key -> DispatchPlan.
        workers: number of workers (GPUs) of the model group.
        wait_window_s: longest a request waits for its batch to fill before a partial batch runs.
        max_queue: requests queued per template beyond which ``submit`` refuses (HTTP 503).
        preemption: step-level preemption (``preemption_policy.py``); None: off.
        admission: SLO-aware admission (``admission.py``); None: plain EDF, every request served.

    Example:
        >>> d = Dispatcher({"t": DispatchPlan(batch=2, sp=1, slo_s=10, latency_s=1)}, workers=1)
        >>> d.submit("t", "r1", now=0.0, steps=1)
        >>> d.submit("t", "r2", now=0.1, steps=1)
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
        self._progress: dict[int, BatchProgress] = {}
        self._init_preemption(preemption)
        self._init_admission(admission)

    # ------------------------------------------------------------------ queue
    def submit(self, template: str, request_id: str, now: float, payload: P | None = None, *, steps: int) -> None:
        """Queue a request (``steps``: the denoising steps it runs, resolved where the request met its
        template; its deadline is the SLO scaled to them, ``DispatchPlan.for_steps``). Raises
        KeyError for an unplanned template, OverflowError when full."""
        if template not in self.plans:
            raise KeyError(template)
        if self.admission is not None and template in self.admission.refused:
            raise Refused(f"{template}: not admitted at this group's planned load (admission policy)")
        q = self._queues[template]
        if len(q) >= self.max_queue:
            raise OverflowError(f"{template}: {len(q)} requests queued (limit {self.max_queue})")
        plan = self.plans[template].for_steps(steps)
        heapq.heappush(q, Pending(now + plan.slo_s, next(self._seq), template, now, request_id, steps, payload))

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

    def observe_pause_bytes(self, template: str, state_bytes: int) -> None:
        """A paused batch of ``template`` holds ``state_bytes`` (what its workers measured): the plan's
        figure from now on if it is larger (the memory checks of later preemptions use it); a plan
        that never pauses (``pause_bytes`` None) stays so."""
        plan = self.plans[template]
        if plan.pause_bytes is not None and state_bytes > plan.pause_bytes:
            self.plans[template] = dataclasses.replace(plan, pause_bytes=state_bytes)

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
        plan = self.plans[template].for_steps(q[0].steps)
        oldest = min(r.arrival for r in q)
        # ``now >= oldest + window``, the very sum ``next_wakeup`` returns: ``now - oldest >= window``
        # can be False at that wake-up by rounding, and the partial batch then waited for the next event
        if sum(r.steps == q[0].steps for r in q) >= plan.batch or now >= oldest + self.wait_window_s:
            return True
        # waiting out the window would make the head request miss: start the partial batch now
        adm = self.admission
        return adm is not None and adm.partial_when_late and oldest + self.wait_window_s + plan.latency_s > q[0].deadline

    def replace_plans(self, plans: dict[str, DispatchPlan], admission: AdmissionPolicy | None = None) -> None:
        """Serve new plans for the same templates (a new plan table), every queued request kept
        (its deadline as it was). Call with no batch running or paused."""
        if set(plans) != set(self.plans):
            raise ValueError(f"new plans must cover the same templates: {sorted(self.plans)}, got {sorted(plans)}")
        if self._running or self._paused:
            raise RuntimeError(f"{len(self._running)} batches running and {len(self._paused)} paused: finish them first")
        for key, p in plans.items():
            if p.batch < 1 or p.sp < 1 or p.sp > self.workers:
                raise ValueError(f"{key}: batch and sp must be >= 1 and sp <= {self.workers}, got batch={p.batch} sp={p.sp}")
        self.plans = dict(plans)
        self.admission = admission  # requests it set aside as late stay where they are

    def dispatch(self, now: float, start_new: bool = True) -> list[Assignment[P]]:
        """Batches to start now: paused ones whose workers are free first, then templates by
        earliest head deadline, each on a free SP group, or by preempting (``preemption_policy.py``).
        ``start_new`` False: only the paused ones (new batches are held)."""
        started: list[Assignment[P]] = self._resumable(now)
        if not start_new:
            return started
        if self.admission is not None and self.admission.late != "serve":
            self._set_aside_late(now)
        order = sorted((q[0].deadline, t) for t, q in self._queues.items() if q)
        for _, template in order:
            while self._ready(template, now):
                plan = self.plans[template].for_steps(self._queues[template][0].steps)
                group = self._free_group(plan.sp)
                preempts: tuple[Preemption, ...] = ()
                park_wait = 0.0
                if group is None:
                    chosen = self._preemptible_group(template, now)
                    if chosen is None:
                        break
                    group, preempts, park_wait = chosen
                reqs = pop_batch(self._queues[template], plan.batch)
                a = Assignment(next(self._batch_ids), template, group, reqs, plan, preempts, park_wait_s=park_wait)
                for p in preempts:
                    self._pause(p, a, now)
                for w in group:
                    self._busy[w] = a.batch_id
                self._running[a.batch_id] = a
                self._progress[a.batch_id] = BatchProgress(since=now)
                started.append(a)
        if any(self._late.values()) and not any(self._queues.values()):
            started += self._start_late(now)  # nothing that can still meet its SLO waits
        return started

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

    def extend(self, batch_id: int, more_s: float, now: float) -> None:
        """A running (or paused) batch needs ``more_s`` seconds more from ``now``: its group runs
        part of it again (``xema_ray.serving.group.isolation``: a request failed it). Its expected
        end moves there, so the preemption policy and the replica's summary see the workers busy
        that long. Counted, as every running batch is, against the plan's full-batch latency: a
        partial batch keeps the difference on top (``DispatchPlan.latency_for``)."""
        prog = self._progress.get(batch_id)
        if prog is None:
            return
        a = self.assignment(batch_id)
        running = now - prog.since if prog.since is not None else 0.0
        remaining = more_s + a.plan.latency_s - a.plan.latency_for(len(a.requests))
        prog.ran_s = a.plan.latency_s - remaining - running  # so that ``remaining_s`` is ``remaining``

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

