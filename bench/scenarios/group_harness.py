"""A ``ModelGroup`` on in-process workers, without Ray: its event loop runs on a thread of its own
(as a Serve replica's does), and the test calls into it with ``call``."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from xema_ray.plan import PlanEntry
from xema_ray.deployment import TemplateSpec
from xema_ray.serving.messages import GroupRequest
from xema_ray.serving.group.model_group import ModelGroup
from xema_ray.serving.group.settings import GroupSettings, ModelGroupConfig
from xema_ray.serving.group.worker_set import WorkerSetFactory
from xema_ray.serving.group.worker_set_local import InProcessWorkerSet
from xema_ray.templates import RequestTemplate
from bench.scenarios.factories import plan_entry

T = TypeVar("T")


def entry(t: RequestTemplate, batch: int = 1, dp: int = 1, latency_s: float = 0.5, slo_s: float = 30.0,
          layout_ref: str | None = None) -> PlanEntry:
    return plan_entry(t, batch=batch, dp=dp, latency_s=latency_s, slo_s=slo_s, layout_ref=layout_ref)


def group_config(model: str, plans: dict[str, PlanEntry], workers: int = 1, **fields: Any) -> ModelGroupConfig:
    """The ``ModelGroupConfig`` of a group serving ``plans``' templates (``fields``: its other fields)."""
    templates = [TemplateSpec(width=t.width, height=t.height, frames=t.frames, steps=t.steps)
                 for t in (e.config.template for e in plans.values())]
    return ModelGroupConfig(model=model, workers=workers, templates=templates, **fields)


def request(template: str, request_id: str, prompt: str, seed: int, guidance_scale: float | None = None, *,
            steps: int) -> GroupRequest:
    """What the Router sends a group's ``generate`` (or the job reconciler its ``submit_job``);
    ``steps``: as the API resolved them (the template's own when the request gives none)."""
    return GroupRequest(template=template, request_id=request_id, prompt=prompt, seed=seed,
                        guidance_scale=guidance_scale, steps=steps)


class Harness:
    """The group and the loop it runs on."""

    def __init__(self, group: ModelGroup, loop: asyncio.AbstractEventLoop) -> None:
        self.group = group
        self.loop = loop

    def call(self, fn: Callable[[ModelGroup], Awaitable[T]], timeout: float = 120.0) -> T:
        """Run ``fn(group)`` on the group's loop and wait for its result (or its exception)."""
        async def run() -> T:
            return await fn(self.group)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def submit(self, fn: Callable[[ModelGroup], Awaitable[T]]) -> Any:
        """Start ``fn(group)`` on the loop; returns a ``concurrent.futures.Future``."""
        async def run() -> T:
            return await fn(self.group)

        return asyncio.run_coroutine_threadsafe(run(), self.loop)


@contextmanager
def running_group(model: str, plans: dict[str, PlanEntry], workers: int = 1,
                  worker_set: WorkerSetFactory = InProcessWorkerSet, adapter_registry: Any = None,
                  **kwargs: Any) -> Iterator[Harness]:
    """A started group of ``workers`` in-process workers serving ``plans`` (kwargs: the fields of
    ``ModelGroupConfig`` and of ``GroupSettings``; ``adapter_registry``: a ``LocalDeployment``
    of ``AdapterRegistry`` that several groups share, as replicas of one group do)."""
    unknown = set(kwargs) - set(ModelGroupConfig.model_fields) - set(GroupSettings.model_fields)
    if unknown:
        raise TypeError(f"running_group: unknown arguments {sorted(unknown)}")
    config = group_config(model, plans, workers, **{k: v for k, v in kwargs.items() if k in ModelGroupConfig.model_fields})
    settings = GroupSettings(**{k: v for k, v in kwargs.items() if k in GroupSettings.model_fields})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"group-{model}", daemon=True)
    thread.start()
    group = ModelGroup(config, plans, settings, worker_set=worker_set, adapter_registry=adapter_registry)
    try:
        yield Harness(group, loop)
    finally:
        async def stop() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        group.workers.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


class LocalDeployment:
    """An object served on a loop thread of its own, called as a Serve handle is
    (``await handle.method.remote(*args)``) from other loops: a one-replica deployment in-process."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="local-deployment", daemon=True)
        self.thread.start()

    def __getattr__(self, method: str) -> Any:
        fn = getattr(self.target, method)

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Awaitable[Any]:
                async def run() -> Any:
                    out = fn(*args, **kwargs)
                    return await out if inspect.isawaitable(out) else out

                return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self.loop))

        return _Method

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
