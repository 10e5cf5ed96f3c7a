"""What a ModelGroup replica publishes for the request router and the autoscaler, and how it
drains when Serve scales it down (``SummaryPublisher``, held by the group as ``publisher``).

* routing stats: Serve's controller polls the group's ``record_routing_stats`` every
  ``request_routing_stats_period_s`` and hands the result to every handle's request router
  (``scale/replica_router.SloRequestRouter``): the replica's ``ReplicaSummary`` as JSON.
* autoscaling stats: the same summary as flat numbers, pushed to the controller for the
  custom autoscaling policy (``scale/scaling.SloAutoscalingPolicy``).
* ``drain`` (from the deployment's ``__del__``, which Serve calls once the replica's ongoing
  requests — every synchronous request it accepted — have finished): its queued video jobs go
  back to the job store at once (another replica's reconciler re-dispatches them), its running
  batches finish here within the shutdown budget, and any job still unfinished then is handed
  back too. Nothing it accepted is lost: a job either completes here or is queued again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from xema_ray.serving.scale.replica_router import SUMMARY_KEY
from xema_ray.serving.scale.replica_summary import ArrivalMeter, ReplicaSummary, summarize
from xema_ray.serving.scale.scaling import summary_metrics

if TYPE_CHECKING:
    from xema_ray.scheduling.dispatcher import Dispatcher
    from xema_ray.serving.jobs.lifecycle import JobLifecycle

logger = logging.getLogger("xema_ray.serving")

#: arrivals are counted over this window for the predicted load of the next one
ARRIVAL_WINDOW_S = 30.0


class SummaryPublisher:
    """One replica's summary of its dispatcher, its arrival rates and its drain.

    Args:
        model: the group's model (for the drain's log line).
        owner: this replica (as job owner and in its summary).
        dispatcher: the group's dispatcher, summarised and drained.
        jobs: the video jobs' ``JobLifecycle`` (None: a group without jobs).
    """

    def __init__(self, model: str, owner: str, dispatcher: Dispatcher[Any], jobs: JobLifecycle | None) -> None:
        self.model = model
        self.owner = owner
        self.dispatcher = dispatcher
        self.jobs = jobs
        self.arrivals = ArrivalMeter(ARRIVAL_WINDOW_S)
        self.draining = False

    def note_arrival(self, template: str) -> None:
        """A request of ``template`` arrived (for the arrival rate the autoscaler extrapolates)."""
        self.arrivals.add(template, time.monotonic())

    def summary(self) -> ReplicaSummary:
        now = time.monotonic()
        return summarize(self.dispatcher, self.owner, now, time.time(), self.arrivals.rates(now), draining=self.draining)

    def routing_stats(self) -> dict[str, Any]:
        """What Serve's request router gets (``record_routing_stats``): the summary as JSON."""
        return {SUMMARY_KEY: self.summary().model_dump(mode="json")}

    def autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler gets (``record_autoscaling_stats``): the summary's flat numbers."""
        return summary_metrics(self.summary())

    async def drain(self, budget_s: float) -> dict[str, int]:
        """Hand back queued jobs, let running batches finish within ``budget_s``, hand back the rest.
        Returns how many jobs were handed back and how many batches were still running at the end."""
        self.draining = True
        handed = 0
        deadline = time.monotonic() + budget_s
        if self.jobs is not None:
            handed += await self.jobs.hand_back_queued(self.dispatcher)
        while (self.dispatcher.running or self.dispatcher.paused or self.dispatcher.queue_depth()) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        unfinished = len(self.dispatcher.running) + len(self.dispatcher.paused)
        if self.jobs is not None:
            handed += await self.jobs.hand_back_all()
        logger.info("%s: drained replica %s (%d jobs handed back, %d batches unfinished)", self.model, self.owner,
                    handed, unfinished)
        return {"handed_back": handed, "unfinished_batches": unfinished}
