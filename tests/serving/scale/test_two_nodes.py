"""A real two-node Ray cluster on this machine: a head and a worker node as separate `ray start`
processes, each with its own logical GPUs. The app runs with tiny-flux2's group pinned to the
head and tiny-cogvideox's to the worker node (custom node resources, ``bundle_resources``). The
worker node is then killed: tiny-flux2 keeps serving, tiny-cogvideox is reported unavailable
with JSON 503s (never a hang, never plain text), nothing accepted is lost, and when a node with
that resource returns, Serve reschedules the group there and it serves again.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import pytest
import requests

import ray
from ray import serve

from bench.scenarios.local_cluster import LocalCluster
from xema_ray.net import free_port
from xema_ray.serving.api.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from xema_ray.serving.api.ready import wait_ready

pytestmark = pytest.mark.slow

IMAGE = {"model": "tiny-flux2", "prompt": "a fox", "size": "64x64", "seed": 1}
VIDEO = {"model": "tiny-cogvideox", "prompt": "waves", "size": "64x64", "num_frames": 9, "seed": 1}
# node death noticed in ~3 s instead of Ray's default ~15 s, so the test stays short
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
               "RAY_health_check_timeout_ms": "1000"}


def _post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=180)


def _ok_or_json_503(r: requests.Response) -> None:
    assert r.status_code in (200, 503), (r.status_code, r.text[:300])
    if r.status_code == 503:
        assert r.headers["content-type"].startswith("application/json"), r.text[:300]
        assert r.json()["error"]["type"] == "service_unavailable" and int(r.headers["Retry-After"]) >= 1


def _worker_nodes() -> dict[str, str]:
    """Worker actor -> node id, for the groups' worker actors."""
    import ray._private.state as state

    return {a["ActorID"]: a["Address"]["NodeID"] for a in state.actors().values()
            if a["ActorClassName"] == "Worker" and a["State"] == "ALIVE"}


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    # the driver here reads RAY_AUTH_MODE once, at import (unset: disabled); the nodes must match
    c = LocalCluster(env={PROXY_CALLBACK_ENV: PROXY_CALLBACK, **FAST_HEALTH}, auth_mode=os.environ.get("RAY_AUTH_MODE", "disabled"))
    saved = dict(os.environ)
    try:
        c.start_head(num_cpus=2, num_gpus=2, dashboard=False, resources={"xema_head": 100})
        os.environ.update(FAST_HEALTH)
        c.connect(log_to_driver=False)
        c.add_node(num_cpus=2, num_gpus=2, resources={"xema_node_b": 100})
        yield c
    finally:
        # no serve.shutdown(): the whole cluster goes next, and a graceful Serve stop costs ~20 s
        if ray.is_initialized():
            ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        c.shutdown()


def _plan_table(args: dict, path) -> str:  # type: ignore[no-untyped-def]
    from bench.scenarios.factories import plan_entry, plan_table
    from xema_ray.serving.config import ServeConfig
    from deployments.planning import machine_fingerprint
    from xema_ray.serving.startup import served_templates

    cfg = ServeConfig.model_validate(args)
    plan_table([plan_entry(t) for t in served_templates(cfg)], hardware=machine_fingerprint(cfg, 1)).save(str(path))
    return str(path)


def test_groups_on_two_nodes_survive_losing_one(cluster: LocalCluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from deployments.app import build_app

    args = {
        "device": "cpu", "worker_cpus": 0.25,
        "router_resources": {"xema_head": 0.01},
        "models": [
            {"model": "tiny-flux2", "workers": 1, "bundle_resources": {"xema_head": 1},
             "templates": [{"width": 64, "height": 64, "steps": 2}]},
            {"model": "tiny-cogvideox", "workers": 1, "bundle_resources": {"xema_node_b": 1},
             "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 2}]},
        ],
    }
    args["plan_table"] = _plan_table(args, tmp_path / "table.json")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(build_app(args), name="xema", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, timeout_s=300)

    assert _post(url, "/v1/images/generations", IMAGE).status_code == 200
    assert _post(url, "/v1/videos/sync", VIDEO).status_code == 200
    assert len(set(_worker_nodes().values())) == 2  # the two groups' workers run on different nodes

    # lose the worker node with video requests in flight
    node_b = cluster.workers[0]
    with cf.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(_post, url, "/v1/videos/sync", {**VIDEO, "seed": 10 + i}) for i in range(4)]
        time.sleep(1.0)
        killed_at = time.time()
        cluster.kill_node(node_b)
        images = [pool.submit(_post, url, "/v1/images/generations", {**IMAGE, "seed": 20 + i}) for i in range(2)]
        for f in futs:
            _ok_or_json_503(f.result())  # answered: a 200 that finished, or a JSON 503
        assert all(f.result().status_code == 200 for f in images)  # the head's group is untouched

    # the lost group is reported unavailable with a 503 (not queued for a node that may not return)
    deadline = time.time() + 60
    while True:
        r = _post(url, "/v1/videos/sync", VIDEO)
        _ok_or_json_503(r)
        if r.status_code == 503:
            break
        assert time.time() < deadline, "the lost group was never reported unavailable"
        time.sleep(1)
    unavailable_after = time.time() - killed_at
    health = requests.get(f"{url}/healthz", timeout=5).json()
    assert health["degraded"] == ["tiny-cogvideox"], health
    assert _post(url, "/v1/images/generations", IMAGE).status_code == 200

    # a node with the resource returns: Serve reschedules the group there and it serves again
    returned_at = time.time()
    cluster.add_node(num_cpus=2, num_gpus=2, resources={"xema_node_b": 100})
    deadline = time.time() + 150
    while True:
        r = _post(url, "/v1/videos/sync", VIDEO)
        _ok_or_json_503(r)
        if r.status_code == 200:
            break
        assert time.time() < deadline, "the group did not come back on the returned node"
        time.sleep(1)
    recovered = time.time() - returned_at
    assert requests.get(f"{url}/healthz", timeout=5).json()["status"] == "ok"
    print(f"\ntwo nodes: unavailable (JSON 503) {unavailable_after:.1f} s after the node was killed; "
          f"serving again {recovered:.1f} s after a node returned")
