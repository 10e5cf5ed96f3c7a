"""Scale-out on a real multi-node Ray cluster: a model group whose replicas each take a whole
node's GPUs (a placement group of its own), routed by ``SloRequestRouter`` from the replicas'
published summaries and autoscaled by ``SloAutoscalingPolicy`` from their predicted attainment.

A load step above one replica's capacity adds the second replica (on the other node); both
serve; after the step the group drains back to one; every request completes.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
import warnings

import pytest

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from bench.scenarios.local_cluster import LocalCluster
from xema_ray.serving.messages import GroupRequest
from xema_ray.serving.scale.replica_router import SloRequestRouter
from xema_ray.serving.scale.scaling import AutoscalingSpec, SloAutoscalingPolicy

# Serve re-validates the autoscaling config and warns each time that metrics_interval_s moves to an env variable
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The `metrics_interval_s`:DeprecationWarning")]

# one replica: 2 workers x batches of 2 per second = 4 req/s
PLANS = {"img": {"batch": 2, "sp": 1, "slo_s": 2.5, "latency_s": 1.0, "steps": 10}}
SPEC = AutoscalingSpec(min_replicas=1, max_replicas=2, target_attainment=0.9, window_s=4.0, downscale_delay_s=2.0,
                       metrics_interval_s=0.5)


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    # the replicas import tests.serving.scale.scale_group from the repository root
    c = LocalCluster(env={"PYTHONPATH": root},
                     auth_mode=os.environ.get("RAY_AUTH_MODE", "disabled"))
    try:
        c.start_head(num_cpus=2, num_gpus=0, dashboard=False)
        c.connect(log_to_driver=False)
        c.add_nodes(2, num_cpus=1, num_gpus=2)
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def _deployment():  # type: ignore[no-untyped-def]
    from tests.serving.scale.scale_group import DispatchOnlyGroup

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        autoscaling = AutoscalingConfig(
            min_replicas=SPEC.min_replicas, max_replicas=SPEC.max_replicas, initial_replicas=1,
            metrics_interval_s=SPEC.metrics_interval_s, look_back_period_s=3 * SPEC.metrics_interval_s,
            upscale_delay_s=0.0, downscale_delay_s=SPEC.downscale_delay_s,
            policy=AutoscalingPolicy(policy_function=SloAutoscalingPolicy,
                                     policy_kwargs={"spec": SPEC.model_dump(), "plans": PLANS}))
    return serve.deployment(
        DispatchOnlyGroup, name="group", num_replicas="auto", autoscaling_config=autoscaling,
        ray_actor_options={"num_cpus": 0}, placement_group_bundles=[{"CPU": 0.01, "GPU": 1}] * 2,
        placement_group_strategy="STRICT_PACK", max_ongoing_requests=10_000, graceful_shutdown_wait_loop_s=0.5,
        request_router_config=RequestRouterConfig(request_router_class=SloRequestRouter,
                                                  request_routing_stats_period_s=0.5))


def _replicas() -> int:
    states = serve.status().applications["scale"].deployments["group"].replica_states
    return sum(n for state, n in states.items() if state == "RUNNING")


def test_a_load_step_adds_a_replica_on_another_node_and_the_group_drains_back(cluster) -> None:  # type: ignore[no-untyped-def]
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    handle = serve.run(_deployment().bind(PLANS, 2), name="scale", route_prefix=None)
    counts: list[int] = []

    async def send(rate: float, until) -> list:  # type: ignore[no-untyped-def, type-arg]
        calls, i = [], 0
        while not until():
            req = GroupRequest(template="img", request_id=f"r{rate}-{i}", prompt="", seed=0, steps=PLANS["img"]["steps"])
            # an answer within 120 s (seconds here): one never answered fails the test naming it, not a hang
            calls.append(asyncio.ensure_future(asyncio.wait_for(handle.generate.remote(req), 120)))
            i += 1
            await asyncio.sleep(1 / rate)
        return await asyncio.gather(*calls, return_exceptions=True)

    async def run() -> tuple[list, list]:  # type: ignore[type-arg]
        # the step (2.5x one replica's capacity) lasts until the second replica has run 5 s, at most 90 s
        t0, second, polled = time.time(), [float("inf")], [0.0]

        def step_over() -> bool:
            if time.time() - polled[0] >= 0.5:  # serve.status() asks the controller: not every send
                polled[0] = time.time()
                counts.append(_replicas())
                if counts[-1] >= 2:
                    second[0] = min(second[0], time.time())
            return time.time() > min(t0 + 90, second[0] + 5)

        step = await send(10.0, step_over)
        low_end = time.time() + 1
        low = await send(1.0, lambda: time.time() > low_end)
        deadline = time.time() + 45
        while _replicas() > 1 and time.time() < deadline:
            counts.append(_replicas())
            await asyncio.sleep(0.5)
        counts.append(_replicas())
        return step, low

    try:
        step, low = asyncio.run(run())
    finally:  # the handle's router (its autoscaling-metrics thread) stops before Ray does; the cluster goes next
        handle.shutdown()
    failed = [r for r in step + low if isinstance(r, BaseException)]
    assert not failed, failed[:3]  # nothing lost, not even on the replica that drained
    assert max(counts) == 2 and counts[-1] == 1, collections.Counter(counts)
    served = collections.Counter(r["node"] for r in step)
    assert len(served) == 2, served  # the second replica took the other node's GPUs and served
    assert min(served.values()) >= 5, served
