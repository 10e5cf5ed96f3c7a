"""The demo's decode stage as ``make serve`` serves it (issue #54): the tiny-cogvideox group of
``deployments/xema.yaml`` (two DiT workers and a decode pool of one Ray actor) on the committed
plan table, video jobs through the official ``openai`` client: ``/v1/templates`` shows each
template's ``decode``, a job's progress shows the decode stage, and killing the decode worker while
jobs decode loses none of them (each is decoded again on its replacement)."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterator
from typing import Any

import imageio.v3 as iio
import pytest
import requests

import openai
from ray import serve

from tests.serving.test_new_models_app import serve_yaml_args
from xema_ray.net import free_port
from xema_ray.serving.api.ready import wait_ready
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.ray_env import apply_ray_env, init_local_ray, shutdown_serve_and_ray

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

#: make serve's application config, only its tiny-cogvideox group (with its decode pool)
DEMO = ServeConfig.model_validate(serve_yaml_args(("tiny-cogvideox",)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from deployments.app import build_app

    args = serve_yaml_args(("tiny-cogvideox",))
    assert args["models"][0]["decode"] == {"workers": 1}, "make serve's tiny-cogvideox has a decode pool"
    args["jobs"] = {**args["jobs"], "path": str(tmp_path_factory.mktemp("jobs"))}
    port = free_port()
    saved_env = dict(os.environ)
    apply_ray_env(open_ports=False)
    init_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="xema", route_prefix="/")  # plans/demo-cpu.json, as make serve
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=300)
        yield f"http://127.0.0.1:{port}"
    finally:
        shutdown_serve_and_ray()
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.fixture()
def client(server: str) -> Any:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=5)


def test_templates_show_the_decode_pool(server: str) -> None:
    rows = [t for t in requests.get(f"{server}/v1/templates", timeout=30).json() if t["model"] == "tiny-cogvideox"]
    assert len(rows) == 2 and all(t["decode"] and t["decode"]["workers"] >= 1 for t in rows), rows


def test_video_jobs_show_the_decode_stage_and_survive_a_killed_decode_worker(server: str, client: Any) -> None:
    # the group runs in the demo's shared replica (shared_replicas: 1): its methods take the model first
    host = serve.get_deployment_handle(DEMO.group_deployments()["tiny-cogvideox"], app_name="xema")
    member = ("tiny-cogvideox",) if DEMO.shared_replicas else ()
    before = host.decode_pool_report.remote(*member).result()
    assert before is not None and before["alive"] == 1
    # 1 s at CogVideoX's 8 fps: the 64x64x9 template; six jobs queue on the one decode worker
    jobs = [client.videos.create(model="tiny-cogvideox", prompt=f"a fox {i}", size="64x64", seconds="1")
            for i in range(6)]
    stages: set[str] = set()
    killed = False
    deadline = time.time() + 600
    while time.time() < deadline:
        views = [requests.get(f"{server}/v1/videos/{j.id}", timeout=30).json() for j in jobs]
        stages |= {v["stage"] for v in views if v.get("stage")}
        if not killed and any(v.get("stage") == "decode" for v in views):
            host.kill_decode_worker.remote(*member, 0).result()  # the actor dies while jobs decode on it
            killed = True
        if all(v["status"] in ("completed", "failed") for v in views):
            break
        time.sleep(0.05)
    assert killed and "decode" in stages, stages
    assert [v["status"] for v in views] == ["completed"] * len(jobs), views  # no accepted job lost
    after = host.decode_pool_report.remote(*member).result()
    assert after["replaced"] >= before["replaced"] + 1 and after["alive"] == 1, after
    assert after["decoded"] >= before["decoded"] + len(jobs)
    frames = iio.imread(io.BytesIO(client.videos.download_content(jobs[0].id).read()), extension=".mp4")
    assert frames.shape[0] == 9 and frames.shape[1:3] == (64, 64)
