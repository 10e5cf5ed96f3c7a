"""A group scaled to zero: its first request is held while the group wakes and then served; one
held past the wake timeout gets a JSON 503 ``waking`` with Retry-After; a full queue while waking
answers as the group's admission does (503 ``queue_full``).

The real Router (its health probes, ``WakeGate``, error mapping, ``/v1/stats``) in front of a real
in-process ModelGroup; Serve's part is stood in for as it behaves (``ray/serve/_private/router.py``,
``wrap_queued_request``): a call to a deployment with no running replica waits at the handle and
makes the controller start one (``ScaledToZero``), which then answers; the controller reports the
running replicas (``replica_counts``). The autoscaler's decision to drop an idle group to zero is
tested in ``tests/serving/scale/test_scaling.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bench.scenarios.factories import plan_entry
from tests.serving.api.router_harness import RouterHarness, running_router
from xema_ray.serving.api.wake import WakePolicy
from xema_ray.templates import RequestTemplate

T = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
BODY = {"model": "tiny-flux2", "prompt": "a fox", "size": "64x64", "seed": 1}


class ScaledToZero:
    """Serve as a group that scales to zero meets it: ``replicas`` running; a call while there are
    none waits at the handle and starts one, running ``wake_s`` later (``None``: never)."""

    def __init__(self) -> None:
        self.replicas = 1
        self.wake_s: float | None = 1.0
        self.woken: asyncio.Event | None = None
        self.wakes = 0
        self.calls: list[str] = []

    def handle(self, group: Any) -> Any:
        gate = self

        class _Call:
            def __init__(self, name: str) -> None:
                self.name = name

            def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
                gate.calls.append(self.name)
                return asyncio.ensure_future(gate._call(getattr(group, self.name), *args, **kwargs))

        class _Handle:
            def __getattr__(self, name: str) -> _Call:
                return _Call(name)

        return _Handle()

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        if self.replicas == 0:
            if self.woken is None:  # the first call waiting at the handle: the controller starts a replica
                self.woken = asyncio.Event()
                self.wakes += 1
                asyncio.get_running_loop().create_task(self._start(self.woken))
            await self.woken.wait()
        return await method(*args, **kwargs)

    async def _start(self, woken: asyncio.Event) -> None:
        if self.wake_s is None:
            return
        await asyncio.sleep(self.wake_s)
        self.replicas, self.woken = 1, None
        woken.set()

    async def counts(self) -> dict[str, int]:
        return {"tiny-flux2": self.replicas}


@pytest.fixture(scope="module")
def serve() -> ScaledToZero:
    return ScaledToZero()


@pytest.fixture(scope="module")
def app(serve: ScaledToZero) -> Iterator[RouterHarness]:
    plans = {T.shape_key: plan_entry(T, batch=1, latency_s=1.0, slo_s=120.0)}
    with running_router(plans, wait_window_s=0.01, handle=serve.handle, replica_counts=serve.counts,
                        wake={"tiny-flux2": WakePolicy(timeout_s=20.0, max_queue=2)}) as h:
        yield h


def _sleep(h: RouterHarness, serve: ScaledToZero) -> None:
    """The autoscaler took the group's last replica: wait for the Router to see it asleep."""
    serve.replicas, serve.woken = 0, None  # (a wake that never came up, the test before, is forgotten)
    deadline = time.monotonic() + 30
    while True:
        health = json.loads(h.get("/healthz").body)
        if health["groups"]["tiny-flux2"]["status"] == "asleep":
            assert health["ready"] is True  # asleep is ready: a request wakes it
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.1)


def _waking(h: RouterHarness) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(h.get("/v1/stats").body)["waking"]["tiny-flux2"]
    return out


def test_a_request_to_a_group_scaled_to_zero_is_held_while_it_wakes_and_served(app: RouterHarness,
                                                                               serve: ScaledToZero) -> None:
    _sleep(app, serve)
    probes = serve.calls.count("status")
    time.sleep(1.5)
    assert serve.calls.count("status") == probes and serve.wakes == 0  # an asleep group is never probed awake
    before = _waking(app)
    serve.wake_s = 1.0
    start = time.monotonic()
    r = app.post("/v1/images/generations", BODY)
    waited = time.monotonic() - start
    assert r.status == 200, r.body
    assert len(json.loads(r.body)["data"]) == 1
    assert waited >= 1.0 and serve.wakes == 1  # held through the wake, not refused
    after = _waking(app)
    assert after["held"] == before["held"] + 1 and after["woke"] == before["woke"] + 1
    assert after["timed_out"] == before["timed_out"]
    assert after["wait_s"] - before["wait_s"] >= 0.9
    deadline = time.monotonic() + 15  # the probes' next turn reads it awake
    while (status := json.loads(app.get("/healthz").body)["groups"]["tiny-flux2"]["status"]) != "ok":
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def test_a_request_held_past_the_wake_timeout_gets_503_waking(app: RouterHarness, serve: ScaledToZero) -> None:
    _sleep(app, serve)
    policy = app.router.wake.policies["tiny-flux2"]
    app.router.wake.policies["tiny-flux2"] = policy.model_copy(update={"timeout_s": 0.5})
    serve.wake_s = None  # the replica does not come up in time
    before = _waking(app)
    try:
        start = time.monotonic()
        r = app.post("/v1/images/generations", BODY)
        waited = time.monotonic() - start
    finally:
        app.router.wake.policies["tiny-flux2"] = policy
    assert r.status == 503, r.body
    err = json.loads(r.body)["error"]
    assert err["code"] == "waking" and err["type"] == "service_unavailable"
    assert err["limit"] == "models[].autoscaling.wake_timeout_s" and "wake_timeout_s (0.5 s)" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert 0.5 <= waited < 5.0
    after = _waking(app)
    assert after["timed_out"] == before["timed_out"] + 1 and after["held"] == before["held"] + 1


def test_a_full_queue_while_waking_answers_as_admission_does(app: RouterHarness, serve: ScaledToZero) -> None:
    _sleep(app, serve)
    serve.wake_s = 2.0
    before = _waking(app)
    rs = app.post_many("/v1/images/generations", [{**BODY, "seed": s} for s in range(3)])  # max_queue 2 held
    codes = sorted(r.status for r in rs)
    assert codes == [200, 200, 503], [r.body for r in rs]
    full = next(r for r in rs if r.status == 503)
    err = json.loads(full.body)["error"]
    assert err["code"] == "queue_full" and err["limit"] == "models[].max_queue"
    assert "retry-after" in full.headers
    after = _waking(app)
    assert after["queue_full"] == before["queue_full"] + 1 and after["woke"] == before["woke"] + 2
