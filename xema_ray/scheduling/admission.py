"""SLO-aware admission, the dispatcher's part of it (with an ``AdmissionPolicy``, chosen by the
load-aware planner per group; the ``Dispatcher`` holds an ``SloAdmission`` over its ``DispatchState``).

A partial batch starts at once when waiting for it to fill would make its oldest request miss
(``Dispatcher._ready``); a queued request that can no longer meet its SLO even if started now alone
is, by the policy's ``late``, served in deadline order as before, deprioritised (run only when no
request that still can is waiting), or shed when others wait (``take_shed``; the caller answers it
503, attainment counts it as missed); templates the policy refuses at this load are refused at
``submit`` (``Refused``). Without a policy the dispatcher behaves as it always has.
"""

from __future__ import annotations

import heapq
from typing import Generic

from xema_ray.plan import AdmissionPolicy
from xema_ray.scheduling.batch import Assignment, DispatchState, P, Pending, pop_batch


class Refused(OverflowError):
    """A template the group's admission policy does not admit at its planned load (HTTP 503)."""


class SloAdmission(Generic[P]):
    """The late queues and the shed requests of a ``Dispatcher`` (which holds one).

    Args:
        state: the dispatcher's state (plans, queues, which workers run which batch).
        policy: what happens to late requests and which templates are refused (None: plain EDF).
    """

    def __init__(self, state: DispatchState[P], policy: AdmissionPolicy | None) -> None:
        self.state = state
        self.policy = policy
        self.late: dict[str, list[Pending[P]]] = {k: [] for k in state.plans}  # can no longer meet their SLO
        self._shed: list[Pending[P]] = []  # dropped, for the caller to answer (take_shed)
        self.shed_total = 0

    def set_aside_late(self, now: float) -> None:
        """Move queued requests that can no longer meet their SLO (even started now, alone) to the
        late queues; under ``shed``, drop them instead while requests that still can are waiting."""
        for template, q in self.state.queues.items():
            def fastest(r: Pending[P], template: str = template) -> float:  # alone: one call of its own key
                return self.state.plans[template].batch_seconds([r.key])
            if not q or all(now + fastest(r) <= r.deadline + 1e-9 for r in q):
                continue
            keep = [r for r in q if now + fastest(r) <= r.deadline + 1e-9]
            for r in q:
                if now + fastest(r) > r.deadline + 1e-9:
                    heapq.heappush(self.late[template], r)
            heapq.heapify(keep)
            self.state.queues[template] = keep
        if self.policy is not None and self.policy.late == "shed" and any(self.state.queues.values()):
            for template, late in self.late.items():
                self._shed += late
                self.shed_total += len(late)
                self.late[template] = []

    def start_late(self, now: float) -> list[Assignment[P]]:
        """Late requests on free groups, earliest deadline first (no waiting, no preemption)."""
        out: list[Assignment[P]] = []
        for _, template in sorted((q[0].deadline, t) for t, q in self.late.items() if q):
            q = self.late[template]
            while q:
                plan = self.state.plans[template].for_steps(q[0].steps)
                group = self.state.free_group(plan.sp)
                if group is None:
                    break
                out.append(self.state.start(template, group, pop_batch(q, plan.batch, self.state.batching), plan, now))
        return out

    def take_shed(self) -> list[Pending[P]]:
        """The requests shed since the last call (the caller answers them: 503, missed)."""
        out, self._shed = self._shed, []
        return out
