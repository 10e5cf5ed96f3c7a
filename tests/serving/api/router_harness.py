"""The real ``Router`` (its FastAPI app, handlers, validation, options and error mapping) in front
of in-process ``ModelGroup``s, without Ray: one event loop on a thread of its own runs the groups
and the app, and ``RouterHarness.post`` / ``get`` call the app through the in-process ASGI
client. Serve's pieces are stood in for: the replica context (FastAPI's class-based views ask it
for the Router instance) and the deployment handles (``handle.method.remote(...)`` calls the
group's method on the same loop)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from bench.scenarios.group_harness import group_config
from tests.serving.api.asgi_client import AsgiResponse, call
from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.serving.jobs.store import JobStoreConfig
from xema_ray.serving.group.model_group import GroupSettings, ModelGroup
from xema_ray.serving.group.worker_set_local import InProcessWorkerSet
from xema_ray.templates import RequestTemplate


class _Call:
    def __init__(self, target: Any, name: str) -> None:
        self.target, self.name = target, name

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """As a Serve handle's: an awaitable response that can be cancelled."""
        return asyncio.ensure_future(getattr(self.target, self.name)(*args, **kwargs))


class LocalHandle:
    """A deployment handle on an in-process object (its methods are coroutines)."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _Call:
        return _Call(self._target, name)


class RouterHarness:
    def __init__(self, app: Any, loop: asyncio.AbstractEventLoop, router: Any, groups: dict[str, ModelGroup]) -> None:
        self.app, self.loop, self.router, self.groups = app, loop, router, groups

    def run(self, coro: Any, timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, path: str, payload: Any, **kw: Any) -> AsgiResponse:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return self.run(call(self.app, "POST", path, body, **kw))

    def post_many(self, path: str, payloads: list[Any]) -> list[AsgiResponse]:
        """Send all at once (they meet in the groups' queues) and wait for every answer."""
        async def all_of() -> list[AsgiResponse]:
            return list(await asyncio.gather(*(call(self.app, "POST", path, json.dumps(p).encode()) for p in payloads)))
        return self.run(all_of())

    def get(self, path: str) -> AsgiResponse:
        return self.run(call(self.app, "GET", path))

    def asgi_app(self) -> Any:
        """The app as an ASGI callable for a caller on any event loop (schemathesis' ``from_asgi``
        runs it on loops of its own): each request runs on the harness's loop, where the groups
        live, its ``receive`` / ``send`` back on the caller's."""
        app, loop = self.app, self.loop

        async def bridged(scope: Any, receive: Any, send: Any) -> None:
            caller = asyncio.get_running_loop()

            async def on_caller(coro: Any) -> Any:
                return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, caller))

            async def recv() -> Any:
                return await on_caller(receive())

            async def snd(message: Any) -> None:
                await on_caller(send(message))

            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(app(scope, recv, snd), loop))
        return bridged

    def serve_http(self) -> str:
        """Serve the app over HTTP on 127.0.0.1 (uvicorn on the harness's loop, stopped with it);
        returns the base URL (for clients that need a socket, e.g. schemathesis)."""
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(server.serve()))
        deadline = time.monotonic() + 30
        while not (server.started and server.servers):
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"


@contextmanager
def running_router(plans: dict[str, PlanEntry], wait_window_s: float = 0.3, jobs: JobStoreConfig | None = None,
                   adapters: dict[str, LoraPoolConfig] | None = None, handle: Callable[[Any], Any] = LocalHandle,
                   replica_counts: Callable[[], Awaitable[dict[str, int] | None]] | None = None,
                   decode: dict[str, dict[str, Any]] | None = None, **router_kwargs: Any) -> Iterator[RouterHarness]:
    """The Router serving ``plans`` (one group of one in-process worker per model; ``jobs``: the
    job store of the video job API; ``adapters``: the adapter pool of each model that has one;
    ``handle``: what stands for each group's Serve handle; ``replica_counts``: for Serve's
    controller's count of each group's running replicas; ``decode``: the ``decode:`` block of each
    model that has a decode pool)."""
    from ray.serve import context as serve_context

    from xema_ray.serving.api import router as router_module

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="router-harness", daemon=True)
    thread.start()
    by_model: dict[str, dict[str, PlanEntry]] = {}
    for key, e in plans.items():
        by_model.setdefault(e.config.template.model, {})[key] = e
    adapters = adapters or {}
    pools = decode or {}
    groups = {m: ModelGroup(group_config(m, ps, wait_window_s=wait_window_s, adapters=adapters.get(m),
                                         decode=pools.get(m)), ps,
                            GroupSettings(jobs=jobs), worker_set=InProcessWorkerSet) for m, ps in by_model.items()}
    templates: list[RequestTemplate] = [e.config.template for e in plans.values()]
    gpus = max([1, *(e.config.total_gpus for e in plans.values())])  # a decode pool's GPUs counted
    table = PlanTable(hardware="cpu:harness", gpus=gpus, budget_bytes=2**40, entries=dict(plans))
    cls = router_module.Router.__mro__[1]  # the class under serve.ingress's wrapper
    router = object.__new__(cls)  # the class itself: its wrapper's (async) __init__ and __del__ are Serve's

    async def build() -> None:
        cls.__init__(router, {m: handle(g) for m, g in groups.items()}, table, templates, jobs=jobs,
                     adapter_pools={m: a for m, a in adapters.items() if m in groups}, **router_kwargs)
        if replica_counts is not None:
            router.health.replica_counts = replica_counts
    saved = serve_context._INTERNAL_REPLICA_CONTEXT
    try:
        asyncio.run_coroutine_threadsafe(build(), loop).result(60)  # outside a replica: no Serve controller asked
        serve_context._INTERNAL_REPLICA_CONTEXT = SimpleNamespace(  # what Serve's metrics read too
            servable_object=router, app_name="harness", deployment="Router", replica_tag="harness")
        # the FastAPI app the class's methods see (and ``install_openapi`` changed): Serve's
        # ingress copied the module's app when it wrapped the class
        h = RouterHarness(cls.__init__.__globals__["app"], loop, router, groups)
        deadline = time.monotonic() + 60
        while h.get("/healthz").status != 200:  # the health probes have heard from every group
            if time.monotonic() > deadline:
                raise TimeoutError("the in-process groups never reported ready")
            time.sleep(0.05)
        yield h
    finally:
        serve_context._INTERNAL_REPLICA_CONTEXT = saved

        async def stop() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        for g in groups.values():
            g.workers.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
