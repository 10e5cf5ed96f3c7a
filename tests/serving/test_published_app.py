"""The Serve app on CPU serving tiny directories laid out as the three published repositories are
(``xema_ray.checkpoints.write_published``: model_index.json classes, bf16 shards with their index,
CogVideoX's fp32 VAE, the shipped tokenizer classes, the scheduler's config): one image and one
video job through the official ``openai`` client, an LTX-2 video through the synchronous route.
And what a user sees when something is missing: a start-up error naming it, before anything runs."""

from __future__ import annotations

import base64
import io
import shutil
from pathlib import Path

import imageio.v3 as iio
import pytest
import requests
from PIL import Image

import ray
import openai
from bench.scenarios.factories import plan_entry, plan_table
from bench.scenarios.serve_app import running_app

from deployments.planning import machine_fingerprint
from xema_ray.net import free_port
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.startup import StartupError, preflight
from xema_ray.templates import RequestTemplate

TEMPLATES = {
    "tiny-flux2": {"width": 64, "height": 64, "steps": 2},
    "tiny-cogvideox": {"width": 64, "height": 64, "frames": 9, "steps": 2},
    "tiny-ltx2": {"width": 64, "height": 64, "frames": 9, "steps": 2},
}


def _args(published: Path) -> dict:  # type: ignore[type-arg]
    return {"device": "cpu", "worker_cpus": 0.25,
            "models": [{"model": m, "workers": 1, "weights_dir": str(published / m), "templates": [t]}
                       for m, t in TEMPLATES.items()]}


@pytest.fixture(scope="module")
def server(published: Path, tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    # the groups' workers threads of one shared replica, as deployments/xema-checkpoints.yaml runs them
    args = {**_args(published), "worker_set": "inprocess", "shared_replicas": 1}
    table = plan_table([plan_entry(RequestTemplate(model=m, **t), text_encoder="device", slo_s=60.0,
                                   latency_source="estimated") for m, t in TEMPLATES.items()],
                       hardware=machine_fingerprint(ServeConfig.model_validate(args), 1))
    with running_app(args, table, tmp_path_factory.mktemp("plans")) as url:
        yield url


@pytest.mark.slow
def test_openai_client_gets_an_image_and_a_video_job_from_published_layouts(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    resp = client.images.generate(model="tiny-flux2", prompt="a red fox in the snow", size="64x64",
                                  response_format="b64_json", extra_body={"seed": 3})
    img = Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json)))
    assert img.format == "PNG" and img.size == (64, 64)
    video = client.videos.create_and_poll(model="tiny-cogvideox", prompt="waves at dusk", size="64x64", seconds="1")
    assert video.status == "completed", video
    frames = iio.imread(client.videos.download_content(video.id).read(), extension=".mp4")
    assert frames.shape == (9, 64, 64, 3)  # 1 s at CogVideoX's 8 fps


@pytest.mark.slow
def test_ltx2_published_layout_decodes_video_and_audio(server: str) -> None:
    body = {"model": "tiny-ltx2", "prompt": "waves", "size": "64x64", "num_frames": 9, "seed": 2}
    r = requests.post(f"{server}/v1/videos/sync", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert iio.imread(r.content, extension=".mp4").shape[:3] == (9, 64, 64)


# ---------------------------------------------------------------------------- start-up errors
def test_error_raised_at_start_up_if_weights_dir_is_missing_or_incomplete(published: Path, tmp_path: Path) -> None:
    from deployments.app import build_app

    args = _args(published)
    args["models"][1]["weights_dir"] = str(tmp_path / "CogVideoX-5b")
    broken = tmp_path / "tiny-ltx2"
    shutil.copytree(published / "tiny-ltx2", broken)
    shutil.rmtree(broken / "connectors")
    args["models"][2]["weights_dir"] = str(broken)
    with pytest.raises(StartupError) as e:
        build_app(args)  # before planning, before Ray: nothing started
    text = str(e.value)
    assert "tiny-cogvideox: weights_dir" in text and "does not exist; download it with: hf download zai-org/CogVideoX-5b" in text
    assert "tiny-ltx2:" in text and "has no connectors folder(s)" in text


def test_error_raised_at_start_up_if_redis_does_not_answer(published: Path) -> None:
    args = {**_args(published), "jobs": {"backend": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}/0",
                                         "timeout_s": 0.5}}
    with pytest.raises(StartupError, match=r"jobs.redis_url redis://127.0.0.1:\d+/0: no Redis answers .*start one"):
        preflight(ServeConfig.model_validate(args))


def test_start_up_warns_if_the_cluster_lacks_the_gpus(published: Path) -> None:
    from xema_ray.serving.startup import gpu_shortfall

    args = {**_args(published), "device": "cuda"}
    args["models"][0]["workers"] = 4
    cfg = ServeConfig.model_validate(args)
    assert gpu_shortfall(cfg, 0.0) is not None and gpu_shortfall(cfg, 0.0).startswith(  # type: ignore[union-attr]
        "device: cuda: the groups' workers ask for 6 GPUs (tiny-flux2 4, tiny-cogvideox 1, tiny-ltx2 1), "
        "the Ray cluster has 0 now")
    assert gpu_shortfall(cfg, 8.0) is None
