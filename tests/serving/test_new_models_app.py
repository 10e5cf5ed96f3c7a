"""The models added beyond the paper's three, served as ``make serve`` serves them: their groups of
``deployments/xema.yaml`` (its committed plan table, workers in their replicas), requests through the official ``openai``
client (a video job of the two-expert tiny-wan2.2, an image of tiny-qwen-image, an image-to-video
job of tiny-wan2.2-i2v)."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import imageio.v3 as iio
import pytest
import yaml

import openai
import ray
from ray import serve

from xema_ray.net import free_port
from xema_ray.serving.api.ready import wait_ready
from xema_ray.serving.ray_env import apply_ray_env, init_local_ray, shutdown_serve_and_ray

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
NEW_MODELS = ("tiny-wan2.2", "tiny-wan2.2-i2v", "tiny-qwen-image")


def serve_yaml_args(models: tuple[str, ...]) -> dict[str, Any]:
    """``deployments/xema.yaml``'s application args with only ``models``' groups."""
    doc = yaml.safe_load((ROOT / "deployments" / "xema.yaml").read_text())
    args = dict(doc["applications"][0]["args"])
    args["models"] = [g for g in args["models"] if g["model"] in models]
    assert [g["model"] for g in args["models"]] == list(models), "make serve must serve the new models"
    return args


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from deployments.app import build_app

    args = serve_yaml_args(NEW_MODELS)
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


def test_templates_list_the_new_models(server: str) -> None:
    import requests

    listed = requests.get(f"{server}/v1/templates", timeout=30).json()
    shapes = {(t["model"], t["width"], t["height"], t["frames"]) for t in listed}
    assert {("tiny-wan2.2", 64, 64, 9), ("tiny-wan2.2", 128, 96, 17), ("tiny-qwen-image", 128, 128, 1)} <= shapes, listed


def test_wan_video_job_through_the_openai_client(client: Any) -> None:
    # 1 s at Wan's 16 fps is 17 frames: the 128x96x17 template, two steps of each expert
    video = client.videos.create_and_poll(model="tiny-wan2.2", prompt="a fox in the snow", size="128x96", seconds="1")
    assert video.status == "completed", video
    data = client.videos.download_content(video.id).read()
    frames = iio.imread(io.BytesIO(data), extension=".mp4")
    assert frames.shape[0] == 17 and frames.shape[1:3] == (96, 128)


def test_qwen_image_through_the_openai_client(client: Any) -> None:
    import base64

    from PIL import Image

    resp = client.images.generate(model="tiny-qwen-image", prompt="a lighthouse at dawn", size="128x128",
                                  extra_body={"seed": 7})
    image = Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json)))
    assert image.size == (128, 128)


def test_wan_image_to_video_job_through_the_openai_client(client: Any) -> None:
    # the first frame as the client sends it (multipart), any size: scaled and cropped to 64x64
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (100, 80), (200, 40, 40)).save(buf, format="PNG")
    video = client.videos.create_and_poll(model="tiny-wan2.2-i2v", prompt="the sea moves", size="64x64", seconds="0.5",
                                          input_reference=("first.png", buf.getvalue(), "image/png"))
    assert video.status == "completed", video
    frames = iio.imread(io.BytesIO(client.videos.download_content(video.id).read()), extension=".mp4")
    assert frames.shape[0] == 9 and frames.shape[1:3] == (64, 64)
