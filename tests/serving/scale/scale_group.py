"""A model group for scale-out tests without workers: the ModelGroup's dispatcher and summary
publishing (``SummaryPublisher``), each batch taking its plan's latency on the event loop. It
holds its placement group's GPUs like a real group, so Serve places, routes, autoscales and
drains it as it does ModelGroup; what it leaves out is the worker set (tested elsewhere)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from xema_ray.scheduling.batch import Assignment, DispatchPlan
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.serving.messages import GroupRequest
from xema_ray.serving.group.replica_stats import SummaryPublisher


class DispatchOnlyGroup:
    def __init__(self, plans: dict[str, dict[str, Any]], workers: int, wait_window_s: float = 0.01) -> None:
        import ray

        self.model = "dispatch-only"
        self.owner = f"group-{uuid.uuid4().hex[:8]}"
        self.node = ray.get_runtime_context().get_node_id()
        self.jobs = None  # no video jobs
        self.dispatcher: Dispatcher[asyncio.Future] = Dispatcher(
            {k: DispatchPlan(**v) for k, v in plans.items()}, workers, wait_window_s)
        self._wake: asyncio.Event | None = None
        self.publisher = SummaryPublisher(self.model, self.owner, self.dispatcher, None)

    async def record_routing_stats(self) -> dict[str, Any]:
        return self.publisher.routing_stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return self.publisher.autoscaling_stats()

    async def replica_summary(self) -> dict[str, Any]:
        return self.publisher.summary().model_dump(mode="json")

    async def generate(self, req: GroupRequest) -> dict[str, Any]:
        template, request_id = req.template, req.request_id
        self.publisher.note_arrival(template)
        loop = asyncio.get_running_loop()
        if self._wake is None:
            self._wake = asyncio.Event()
            loop.create_task(self._loop())
        fut: asyncio.Future = loop.create_future()
        arrived = time.monotonic()
        self.dispatcher.submit(template, request_id, arrived, fut, key=req.batch_key)
        self._wake.set()
        out = await fut
        return {**out, "replica": self.owner, "node": self.node, "seconds": time.monotonic() - arrived}

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            now = time.monotonic()
            for a in self.dispatcher.dispatch(now):
                asyncio.get_running_loop().create_task(self._run(a))
            wake = self.dispatcher.next_wakeup(now)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), None if wake is None else max(0.0, wake - time.monotonic()))
            except TimeoutError:
                pass

    async def _run(self, a: Assignment[asyncio.Future]) -> None:
        await asyncio.sleep(a.plan.latency_s)
        self.dispatcher.complete(a.batch_id)
        for r in a.requests:
            r.payload.set_result({"batch_seconds": a.plan.latency_s, "workers": list(a.workers)})
        assert self._wake is not None
        self._wake.set()

    async def __del__(self) -> None:
        await self.publisher.drain(10.0)
