"""Scale to zero on a real Ray Serve: a group with ``min_replicas: 0`` under the app's own autoscaling
policy (``SloAutoscalingPolicy``) gives its idle replica back, and a request sent to it then is held
by Serve and wakes it (Serve's cold start for a request waiting at the handle of a deployment with
no replica), and is served. The group is ``DispatchOnlyGroup`` (the ModelGroup's dispatcher and
summaries without workers: tests/serving/scale/scale_group.py). The Router's part (holding the
request up to the wake timeout, the 503 ``waking``) is tests/serving/api/test_wake.py's."""

from __future__ import annotations

import asyncio
import os
import time
import warnings

import pytest

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from bench.scenarios.local_cluster import LocalCluster
from xema_ray.serving.messages import GroupRequest
from xema_ray.serving.scale.scaling import AutoscalingSpec, SloAutoscalingPolicy

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The `metrics_interval_s`:DeprecationWarning")]

PLANS = {"img": {"batch": 1, "sp": 1, "slo_s": 5.0, "latency_s": 0.2, "steps": 2}}
SPEC = AutoscalingSpec(min_replicas=0, max_replicas=1, downscale_delay_s=1.0, metrics_interval_s=0.5)


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    c = LocalCluster(env={"PYTHONPATH": root}, auth_mode=os.environ.get("RAY_AUTH_MODE", "disabled"))
    try:
        c.start_head(num_cpus=2, num_gpus=0, dashboard=False)
        c.connect(log_to_driver=False)
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


#: the longest a request sent to the group at zero may take to be served (a replica's start is ~5 s here)
WAKE_S = 120


def _states() -> dict[str, int]:
    """The group's replicas by state (RUNNING, STARTING, STOPPING, ...)."""
    states = serve.status().applications["zero"].deployments["group"].replica_states
    return {str(state): n for state, n in states.items() if n}


def _replicas() -> int:
    return _states().get("RUNNING", 0)


def test_an_idle_group_scales_to_zero_and_a_request_wakes_it_and_is_served(cluster) -> None:  # type: ignore[no-untyped-def]
    from tests.serving.scale.scale_group import DispatchOnlyGroup

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        autoscaling = AutoscalingConfig(
            min_replicas=0, max_replicas=1, initial_replicas=1, metrics_interval_s=SPEC.metrics_interval_s,
            look_back_period_s=3 * SPEC.metrics_interval_s, upscale_delay_s=0.0,
            downscale_delay_s=SPEC.downscale_delay_s,
            policy=AutoscalingPolicy(policy_function=SloAutoscalingPolicy,
                                     policy_kwargs={"spec": SPEC.model_dump(), "plans": PLANS}))
    deployment = serve.deployment(DispatchOnlyGroup, name="group", num_replicas="auto", autoscaling_config=autoscaling,
                                  ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100,
                                  graceful_shutdown_wait_loop_s=0.5)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    handle = serve.run(deployment.bind(PLANS, 1), name="zero", route_prefix=None)
    try:
        assert _replicas() == 1
        deadline = time.time() + 90
        while _states():  # idle: nothing queued, running or arrived; the replica stopped, not only stopping
            assert time.time() < deadline, f"the idle group never scaled to zero: {_states()}"
            time.sleep(0.5)

        async def wake() -> tuple[dict, float]:  # type: ignore[type-arg]
            start = time.time()
            out = await handle.generate.remote(GroupRequest(template="img", request_id="w", prompt="", seed=0,
                                                            steps=PLANS["img"]["steps"]))
            return out, time.time() - start

        try:  # bounded: a request nobody wakes for fails the test, naming what Serve saw, instead of waiting forever
            out, waited = asyncio.run(asyncio.wait_for(wake(), WAKE_S))
        except TimeoutError:
            status = serve.status().applications["zero"].deployments["group"]
            raise AssertionError(f"a request to the group at zero was not served within {WAKE_S} s: replicas "
                                 f"{_states()}, deployment {status.status} {status.message!r}") from None
        assert out["replica"] and out["seconds"] >= 0  # served by the replica that woke
        print(f"woke and served in {waited:.1f} s")
        assert _replicas() == 1  # it woke: a replica runs again
    finally:
        handle.shutdown()
        serve.shutdown()
