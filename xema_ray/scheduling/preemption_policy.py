"""Step-level preemption, the dispatcher's part of it (with a ``PreemptionPolicy``; the
``Dispatcher`` holds a ``StepPreemption`` over its ``DispatchState``).

A waiting batch whose head request would miss its deadline by waiting for a free group, but meets
it if it starts now, may take the workers of running batches that are paused at their next
denoising-step boundary — when each of them still meets its own deadline after the delay (or has
lost it already), none of its requests has been preempted ``max_preemptions`` times, and memory
allows it: on every worker the incoming batch's planned peak plus the paused state (kept on the
device) is within the budget, else the paused state moves to host memory where the host has room,
else there is no preemption (a batch that ran with a static layout always moves its state: it lies
in the layout's arena, which the next armed batch reuses). A paused batch resumes first, as soon as
its workers are free; its workers take no other batch meanwhile except through this same rule.
Every decision is logged (``decisions``), so the live group and the simulator can be compared.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Generic, Literal

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.scheduling.batch import Assignment, DispatchPlan, DispatchState, P

MAX_DECISIONS_KEPT = 10_000


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


class StepPreemption(Generic[P]):
    """The paused batches and the preemption decisions of a ``Dispatcher`` (which holds one).

    Args:
        state: the dispatcher's state (plans, queues, which workers run or hold which batch).
        policy: when running batches may be paused (None: never).
    """

    def __init__(self, state: DispatchState[P], policy: PreemptionPolicy | None) -> None:
        self.state = state
        self.policy = policy
        self._paused: dict[int, Assignment[P]] = {}
        self._times_preempted: dict[str, int] = {}  # request id -> pauses so far
        #: the latest decisions (bounded: a server runs for months), and how many there were
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=MAX_DECISIONS_KEPT)
        self.preemptions_total = 0

    def resumable(self, now: float) -> list[Assignment[P]]:
        out = []
        for bid, a in sorted(self._paused.items(), key=lambda kv: _deadline(kv[1])):
            if any(w in self.state.busy for w in a.workers):
                continue
            del self._paused[bid]
            for w in a.workers:
                self.state.held.pop(w, None)
                self.state.busy[w] = bid
            self.state.running[bid] = a
            self.state.progress[bid].since = now
            self.decisions.append(Decision(now, "resume", bid, a.template, _ids(a)))
            out.append(Assignment(a.batch_id, a.template, a.workers, a.requests, a.plan, resume=True, run_s=a.run_s))
        return out

    def pause(self, p: Preemption, by: Assignment[P], now: float) -> None:
        a = self.state.running.pop(p.batch_id)
        prog = self.state.progress[p.batch_id]
        prog.ran_s += now - (prog.since if prog.since is not None else now)
        prog.since, prog.offloaded = None, p.offload
        self._paused[p.batch_id] = a
        for w in a.workers:
            if self.state.busy.get(w) == p.batch_id:
                del self.state.busy[w]
            self.state.held[w] = p.batch_id
        for r in a.requests:
            self._times_preempted[r.request_id] = self._times_preempted.get(r.request_id, 0) + 1
        self.decisions.append(Decision(now, "preempt", p.batch_id, a.template, _ids(a), _ids(by), p.offload))
        self.preemptions_total += 1

    def assignment(self, batch_id: int) -> Assignment[P]:
        """A running or paused batch's assignment."""
        a = self.state.running.get(batch_id)
        return a if a is not None else self._paused[batch_id]

    def remaining_s(self, batch_id: int, now: float) -> float:
        """Predicted seconds a running or paused batch still needs (``Assignment.held_s`` less what it ran)."""
        return self.state.progress[batch_id].remaining(self.assignment(batch_id).held_s, now)

    def _expected_end(self, bid: int, now: float) -> float:
        a = self.assignment(bid)
        prog = self.state.progress[bid]
        return now + prog.remaining(a.held_s, now)

    def _to_boundary(self, bid: int, now: float) -> float | None:
        """Seconds until running batch ``bid`` reaches its next step boundary (None: its steps are
        done, it is in its decode tail). Counted back from its expected end, so the tail (often
        most of a tiny video's time) is not spread over the steps."""
        a = self.state.running[bid]
        v = self.state.plans[a.template]
        step = a.plan.latency_s * v.denoise_frac / max(1, a.plan.steps)
        denoise_left = self.state.progress[bid].remaining(a.held_s, now) - a.plan.latency_s * v.decode_encode_frac
        # the boundary after the last step is none: a worker pauses only between steps (step < total)
        if step <= 0 or denoise_left <= step * (1 + 1e-9):
            return None
        return min(step, (denoise_left - step) % step or step)

    def _free_at(self, group: tuple[int, ...], now: float) -> float:
        """When ``group`` would be free without preemption (running batches end, paused ones
        resume after them and end)."""
        t = now
        for w in group:
            if w in self.state.busy:
                t = max(t, self._expected_end(self.state.busy[w], now))
        for held in {self.state.held[w] for w in group if w in self.state.held}:
            t += self.state.progress[held].remaining(self._paused[held].held_s, now)
        return t

    def _switch_s(self, a: str, b: str) -> float:
        assert self.policy is not None
        return self.policy.switch_s.get(a, {}).get(b, 0.0) if a != b else 0.0

    def preemptible_group(self, template: str, now: float
                          ) -> tuple[tuple[int, ...], tuple[Preemption, ...], float] | None:
        """A group for ``template``'s next batch by pausing running batches, the pauses, and the
        seconds until they have parked; or None."""
        pol = self.policy
        head = self.state.queues[template][0]
        plan = self.state.plans[template].for_steps(head.steps)  # the next batch runs the head's step count
        if pol is None or plan.peak_bytes is None:
            return None
        need = plan.held_s([r.key for r in self.state.next_batch(template)])  # priced as it will run
        groups = [tuple(range(s, s + plan.sp)) for s in range(0, self.state.workers - plan.sp + 1, plan.sp)]
        if not groups or min(self._free_at(g, now) for g in groups) + need <= head.deadline:
            return None  # waiting costs it nothing
        best: tuple[tuple[float, int], tuple[int, ...], tuple[Preemption, ...], float] | None = None
        for g in groups:
            if any(w in self.state.held for w in g):
                continue  # a worker already holds a paused batch
            victims = sorted({self.state.busy[w] for w in g if w in self.state.busy})
            pauses = []
            wait = 0.0
            for bid in victims:
                p = self._pause_for(bid, template, plan, need, head.deadline, now)
                if p is None:
                    break
                pauses.append(p)
                boundary = self._to_boundary(bid, now)
                assert boundary is not None  # _pause_for refuses a batch with no boundary left
                # the state leaves the device before the preempting batch may start (it is moved back on resume)
                move = pol.move_s(self.state.plans[self.state.running[bid].template].pause_bytes) if p.offload else 0.0
                wait = max(wait, boundary + self._switch_s(self.state.running[bid].template, template) + move)
            else:
                if now + wait + need > head.deadline:
                    continue  # preempting does not save it either
                slack = min((_deadline(self.state.running[b]) for b in victims), default=float("inf"))
                key = (len(victims), -slack)
                if best is None or key < best[0]:
                    best = (key, g, tuple(pauses), wait)
        return None if best is None else (best[1], best[2], best[3])

    def _pause_for(self, bid: int, template: str, plan: DispatchPlan, need_s: float, deadline: float,
                   now: float) -> Preemption | None:
        """How running batch ``bid`` would pause for a batch of ``template`` that holds its workers
        ``need_s`` (``DispatchPlan.held_s``), or None if it may not."""
        pol = self.policy
        assert pol is not None and plan.peak_bytes is not None
        a = self.state.running[bid]
        v = self.state.plans[a.template]  # its pause_bytes may have been raised to what the workers measured
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
        delay = need_s + self._switch_s(a.template, template) + self._switch_s(template, a.template) + moves
        end = self._expected_end(bid, now)
        if end + delay > _deadline(a) and end <= _deadline(a):
            return None  # it would meet its deadline, and the pause would make it miss
        return Preemption(bid, offload)

    def preempted_count(self, request_id: str) -> int:
        return self._times_preempted.get(request_id, 0)

    @property
    def paused(self) -> list[Assignment[P]]:
        return list(self._paused.values())

    def holds(self) -> bool:
        """Whether a batch is paused."""
        return bool(self._paused)

    def finished(self, batch_id: int) -> Assignment[P] | None:
        """A batch ended: its assignment if it was paused (its workers no longer hold it), else
        None; either way its requests' pause counts are forgotten by ``forget``."""
        a = self._paused.pop(batch_id, None)
        if a is not None:
            for w in a.workers:
                if self.state.held.get(w) == batch_id:
                    del self.state.held[w]
        return a

    def forget(self, a: Assignment[P]) -> None:
        """``a``'s requests are done: their pause counts go."""
        for r in a.requests:
            self._times_preempted.pop(r.request_id, None)


def _deadline(a: Assignment[P]) -> float:
    return min(r.deadline for r in a.requests)


def _ids(a: Assignment[P]) -> tuple[str, ...]:
    return tuple(r.request_id for r in a.requests)
