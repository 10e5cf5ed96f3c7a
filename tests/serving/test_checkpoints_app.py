"""The Serve app on CPU serving the three tiny models from local diffusers directories
(``make checkpoints``; ``deployments/xema-checkpoints.yaml``): prompts go through each model's
own tokenizer and text encoder, the official ``openai`` client gets PNGs, the same prompt and
seed give the same bytes and two prompts two pictures, videos decode with the requested frames,
and a long prompt is truncated and reported, not refused."""

from __future__ import annotations

import base64
import io

import imageio.v3 as iio
import pytest
import requests
from PIL import Image

import ray
import openai
from bench.scenarios.factories import plan_entry, plan_table
from bench.scenarios.serve_app import running_app

from xema_ray.checkpoints import TINY_MODELS, write_checkpoint
from xema_ray.serving.config import ServeConfig
from deployments.planning import machine_fingerprint
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.slow

TEMPLATES = {
    "tiny-flux2": {"width": 64, "height": 64, "steps": 2},
    "tiny-cogvideox": {"width": 64, "height": 64, "frames": 9, "steps": 2},
    "tiny-ltx2": {"width": 64, "height": 64, "frames": 9, "steps": 2},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # type: ignore[no-untyped-def]
    ckpt = tmp_path_factory.mktemp("checkpoints")
    for m in TINY_MODELS:
        write_checkpoint(m, ckpt)
    # the groups' workers threads of one shared replica, as deployments/xema-checkpoints.yaml runs them
    args = {"device": "cpu", "worker_cpus": 0.25, "worker_set": "inprocess", "shared_replicas": 1,
            "models": [{"model": m, "workers": 1, "weights_dir": str(ckpt / m), "templates": [t]} for m, t in TEMPLATES.items()]}
    table = plan_table([plan_entry(RequestTemplate(model=m, **t), text_encoder="device", slo_s=60.0,
                                   latency_source="estimated") for m, t in TEMPLATES.items()],
                       hardware=machine_fingerprint(ServeConfig.model_validate(args), 1))
    with running_app(args, table, tmp_path_factory.mktemp("plans")) as url:
        yield url


def _png(client, prompt: str, seed: int) -> bytes:  # type: ignore[no-untyped-def]
    resp = client.images.generate(model="tiny-flux2", prompt=prompt, size="64x64", response_format="b64_json",
                                  extra_body={"seed": seed})
    data = base64.b64decode(resp.data[0].b64_json)
    img = Image.open(io.BytesIO(data))
    assert img.format == "PNG" and img.size == (64, 64)
    return data


def test_openai_client_images_through_the_real_encoder(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    a = _png(client, "a red fox in the snow", 5)
    assert _png(client, "a red fox in the snow", 5) == a
    assert _png(client, "waves on a rocky shore", 5) != a


@pytest.mark.parametrize("model", ["tiny-cogvideox", "tiny-ltx2"])
def test_video_from_checkpoint_decodes_with_the_requested_frames(server: str, model: str) -> None:
    body = {"model": model, "prompt": "waves", "size": "64x64", "num_frames": 9, "seed": 2}
    r = requests.post(f"{server}/v1/videos/sync", json=body, timeout=300)
    assert r.status_code == 200, r.text
    frames = iio.imread(r.content, extension=".mp4")
    assert frames.shape[0] == 9 and frames.shape[1:3] == (64, 64)
    assert r.headers["X-Xema-Prompt-Truncated"] == "false"


def test_long_prompt_is_truncated_and_the_response_says_so(server: str) -> None:
    body = {"model": "tiny-flux2", "prompt": "a red fox " * 50, "size": "64x64", "seed": 1}
    r = requests.post(f"{server}/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.headers["X-Xema-Prompt-Truncated"] == "true" and int(r.headers["X-Xema-Prompt-Tokens"]) > 8
