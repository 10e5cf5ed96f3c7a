"""A model group's bookkeeping of step-level preemption: which batches the dispatcher paused,
whether their workers have parked them yet, the resume signal, and the counts ``/v1/stats`` and
the metrics report (the decisions themselves are the shared ``Dispatcher``'s)."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, Field

from xema_ray.scheduling.batch import Assignment
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.scheduling.preemption_policy import PreemptionPolicy
from xema_ray.serving.group.worker_set import WorkerSet

if TYPE_CHECKING:
    from xema_ray.runtime.engine import Batch, BatchResult
    from xema_ray.runtime.pause import PausedRun
    from xema_ray.runtime.progress import StepObserver


def _finished(results: list[BatchResult | PausedRun]) -> list[BatchResult]:
    """The ranks' results of a batch that ran to its end (not preemptible, or every pause resumed)."""
    return cast("list[BatchResult]", results)


class TemplatePreemption(BaseModel):
    preemptions: int = Field(default=0, description="batches of this template paused for another")
    paused_now: int = Field(default=0, description="batches paused at this moment")
    paused_bytes: int = Field(default=0, description="between-step state the paused batches hold now")
    offloaded: int = Field(default=0, description="pauses whose state moved to host memory")
    paused_s: float = Field(default=0.0, description="seconds spent paused, summed over batches")


class DecisionRecord(BaseModel):
    kind: str = Field(description="preempt or resume")
    template: str = Field(description="the paused (or resumed) batch's template")
    requests: list[str]
    by: list[str] = Field(default_factory=list, description="the preempting batch's requests")
    offload: bool = False


#: decisions ``/v1/stats`` lists (the latest ones)
RECENT_DECISIONS = 50
#: preempting batches whose park overhead ``/v1/stats`` summarises (the latest ones)
PARK_SAMPLES = 1000


class ParkOverhead(BaseModel):
    """How much longer preempting batches waited for their victims to park than the dispatcher
    predicted (next step boundary, residency switch, state move): the pause handshake — the
    pause call, the parked run's return, the group's event loop. The simulator is charged it."""

    total: int = Field(description="preempting batches measured since the replica started")
    mean_s: float = Field(description="over recent_s")
    p50_s: float
    p90_s: float
    max_s: float
    recent_s: list[float] = Field(description="the latest PARK_SAMPLES, oldest first")

    @classmethod
    def of(cls, samples: list[float], total: int) -> ParkOverhead | None:
        if not samples:
            return None
        xs = sorted(samples)
        return cls(total=total, mean_s=sum(xs) / len(xs), p50_s=xs[len(xs) // 2], p90_s=xs[int(0.9 * (len(xs) - 1))],
                   max_s=xs[-1], recent_s=list(samples))


class PreemptionReport(BaseModel):
    enabled: bool
    per_template: dict[str, TemplatePreemption]
    decisions: int = Field(description="preemptions the dispatcher decided (each is resumed in turn)")
    recent: list[DecisionRecord] = Field(default_factory=list, description="the latest decisions, oldest first")
    park_overhead: ParkOverhead | None = Field(default=None, description="the preempting batches' wait beyond the "
                                               "predicted one (None: no batch preempted yet)")


@dataclass
class PreemptionState:
    """Per batch id: pause wanted (and how), parked, resumed. Runs on the group's event loop."""

    _want: dict[int, bool] = field(default_factory=dict)  # batch -> offload
    _parked: dict[int, asyncio.Event] = field(default_factory=dict)
    _resume: dict[int, asyncio.Event] = field(default_factory=dict)
    _holding: dict[int, tuple[str, int]] = field(default_factory=dict)  # paused batch -> (template, bytes)
    #: batch id -> the run id of its sub-batch on the workers now
    current_run: dict[int, str] = field(default_factory=dict)
    stats: dict[str, TemplatePreemption] = field(default_factory=dict)
    #: preempting batches: seconds their victims took to park beyond the dispatcher's prediction
    park_overhead: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=PARK_SAMPLES))
    parks_measured: int = 0

    def observe_park(self, overhead_s: float) -> None:
        self.park_overhead.append(overhead_s)
        self.parks_measured += 1

    def _event(self, table: dict[int, asyncio.Event], bid: int) -> asyncio.Event:
        return table.setdefault(bid, asyncio.Event())

    def want(self, bid: int, offload: bool) -> None:
        self._want[bid] = offload
        self._event(self._parked, bid).clear()
        self._event(self._resume, bid).clear()

    def wanted(self, bid: int) -> bool:
        return bid in self._want

    def parked(self, bid: int, template: str, state_bytes: int, offloaded: bool) -> None:
        st = self.stats.setdefault(template, TemplatePreemption())
        st.preemptions += 1
        st.offloaded += int(offloaded)
        self._holding[bid] = (template, state_bytes)
        self._event(self._parked, bid).set()

    async def wait_parked(self, bid: int) -> None:
        """Until ``bid`` parked (or ended: then no pause is pending for it any more)."""
        if bid not in self._want:
            return
        await self._event(self._parked, bid).wait()

    def resume(self, bid: int) -> None:
        self._want.pop(bid, None)
        self._event(self._resume, bid).set()

    async def wait_resume(self, bid: int) -> None:
        await self._event(self._resume, bid).wait()

    def resumed(self, bid: int, template: str, paused_s: float) -> None:
        self._holding.pop(bid, None)
        self.stats.setdefault(template, TemplatePreemption()).paused_s += paused_s

    def finished(self, bid: int) -> None:
        """The batch ended (done, failed, or finished before it could park): nobody waits on it."""
        self._event(self._parked, bid).set()
        self._want.pop(bid, None)
        self._parked.pop(bid, None)
        self._resume.pop(bid, None)
        self._holding.pop(bid, None)

    def report(self, enabled: bool, decisions: Any, total: int) -> PreemptionReport:
        per = {k: v.model_copy() for k, v in self.stats.items()}
        for template, nbytes in self._holding.values():
            st = per.setdefault(template, TemplatePreemption())
            st.paused_now += 1
            st.paused_bytes += nbytes
        recent = [DecisionRecord(kind=d.kind, template=d.template, requests=list(d.requests), by=list(d.by), offload=d.offload)
                  for d in list(decisions)[-RECENT_DECISIONS:]]
        return PreemptionReport(enabled=enabled, per_template=per, decisions=total, recent=recent,
                                park_overhead=ParkOverhead.of(list(self.park_overhead), self.parks_measured))

    def held_bytes(self, template: str) -> int:
        return sum(n for t, n in self._holding.values() if t == template)


class PreemptibleRunner:
    """Runs a model group's sub-batches on its worker set. Where the group preempts, a batch the
    dispatcher paused is asked to park at its next step boundary, the preempting batch starts
    once it has, and it resumes on the dispatcher's word (any number of times before its results
    come back). Runs on the group's event loop."""

    def __init__(self, model: str, workers: WorkerSet[Any], dispatcher: Dispatcher[Any], policy: PreemptionPolicy | None,
                 metrics: Any) -> None:
        self.model = model
        self.workers = workers
        self.dispatcher = dispatcher
        self.policy = policy
        self.metrics = metrics
        self.state = PreemptionState()

    def request_pause(self, batch_id: int, offload: bool) -> None:
        """The dispatcher paused ``batch_id``: ask its workers to park it at the next step boundary."""
        self.state.want(batch_id, offload)
        run_id = self.state.current_run.get(batch_id)
        if run_id is not None:
            self.workers.pause(self.dispatcher.assignment(batch_id).workers, run_id, offload)

    async def run_sub_batch(self, a: Assignment[Any], batch: Batch, observer: StepObserver | None,
                            run_id: str) -> list[BatchResult]:
        """One sub-batch on the assignment's workers; its ``BatchResult`` per rank."""
        from xema_ray.runtime.pause import PausedRun

        bid = a.batch_id
        if self.policy is None:
            return _finished(await self.workers.execute(a.workers, batch, observer))
        if self.state.wanted(bid):  # a pause that lands between two sub-batches holds nothing
            await self._parked(a, 0, False)
        self.state.current_run[bid] = run_id
        try:
            results = await self.workers.execute(a.workers, batch, observer, run_id)
            while any(isinstance(r, PausedRun) for r in results):
                paused = [r for r in results if isinstance(r, PausedRun)]
                if len(paused) != len(results):
                    raise RuntimeError(f"{self.model}: batch {bid}'s SP ranks disagree about a pause ({results})")
                resumed = await self._parked(a, max(r.state_bytes for r in paused), paused[0].offloaded)
                results = await self.workers.resume(resumed, run_id)
            return _finished(results)
        finally:
            self.state.current_run.pop(bid, None)

    async def _parked(self, a: Assignment[Any], state_bytes: int, offloaded: bool) -> tuple[int, ...]:
        """Record that ``a`` parked, let the preempting batch start, wait for the dispatcher's
        resume; returns the workers to resume on."""
        t0 = time.monotonic()
        self.state.parked(a.batch_id, a.template, state_bytes, offloaded)
        self.metrics.observe_pause(a.template, self.state.held_bytes(a.template))
        # what the workers hold: the plan's figure from now on if it is larger (the dispatcher's memory checks)
        self.dispatcher.observe_pause_bytes(a.template, state_bytes)
        await self.state.wait_resume(a.batch_id)
        paused_s = time.monotonic() - t0
        self.state.resumed(a.batch_id, a.template, paused_s)
        self.metrics.observe_resume(a.template, paused_s, self.state.held_bytes(a.template))
        return a.workers
