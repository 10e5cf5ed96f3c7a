"""Integration: a Wan2.2 LoRA pair on the live app (Ray Serve on CPU, tiny-wan2.2, whose 4 steps run
the high-noise expert for steps 0-1 and the low-noise one for steps 2-3).

The same file registered through ``experts: {low_noise: FILE}`` adapts the low-noise expert and as
a single ``path`` the high-noise one: the two videos differ, and each repeats bit for bit; a file
whose keys fit no layer of its expert is a 4xx naming the file; ``path`` with ``experts`` a 422.
"""

from __future__ import annotations

import pytest
import requests

from bench.scenarios.factories import plan_entry
from bench.scenarios.serve_app import running_app
from deployments.planning import machine_fingerprint
from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.slow

T = RequestTemplate(model="tiny-wan2.2", width=64, height=64, frames=9, steps=4)


@pytest.fixture(scope="module")
def app(tmp_path_factory):  # type: ignore[no-untyped-def]
    roots = tmp_path_factory.mktemp("adapters")
    wan = get_model_spec("tiny-wan2.2").build_pipeline(BuildOptions(device="meta")).transformer  # shapes only
    flux = get_model_spec("tiny-flux2").build_pipeline(BuildOptions(device="meta")).transformer
    files = {"style": write_adapter(roots / "style.safetensors", wan, rank=4, seed=5, std=0.2),
             "flux": write_adapter(roots / "flux.safetensors", flux, rank=4, seed=6)}  # fits no Wan layer
    args = {
        # the worker a thread of the group's replica, as make serve runs it
        "device": "cpu", "worker_cpus": 0.25, "worker_set": "inprocess", "jobs": {"path": str(tmp_path_factory.mktemp("jobs"))},
        "models": [{"model": "tiny-wan2.2", "workers": 1, "wait_window_s": 0.05, "max_queue": 16,
                    "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 4}],
                    "adapters": {"roots": [str(roots)], "slots": 2, "max_rank": 8}}],
    }
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(args), 1), gpus=1, budget_bytes=10**9,
                      entries={T.shape_key: plan_entry(T, batch=1)})
    with running_app(args, table, tmp_path_factory.mktemp("plans")) as url:
        yield url, files


def _video(url: str, adapter: str | None) -> bytes:
    body = {"model": "tiny-wan2.2", "prompt": "a fox in the snow", "size": "64x64", "num_frames": 9, "seed": 7,
            **({"lora": [{"name": adapter, "scale": 1.0}]} if adapter else {})}
    r = requests.post(f"{url}/v1/videos/sync", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.content


def _add(url: str, **body: object) -> requests.Response:
    return requests.post(f"{url}/v1/adapters", json={"model": "tiny-wan2.2", **body}, timeout=120)


def test_a_low_noise_file_adapts_the_low_noise_expert_and_repeats(app) -> None:  # type: ignore[no-untyped-def]
    url, files = app
    low = _add(url, name="style-low", experts={"low_noise": str(files["style"])})
    assert low.status_code == 201, low.text
    assert low.json()["expert_layers"].keys() == {"transformer_2"}
    high = _add(url, name="style-high", path=str(files["style"]))
    assert high.status_code == 201, high.text
    assert high.json()["expert_layers"].keys() == {"transformer"}

    plain, as_low, as_high = _video(url, None), _video(url, "style-low"), _video(url, "style-high")
    assert len({plain, as_low, as_high}) == 3  # each expert's adapter changes the video its own way
    assert _video(url, "style-low") == as_low and _video(url, "style-high") == as_high  # bit for bit


def test_error_raised_if_a_file_fits_neither_expert_or_the_fields_clash(app) -> None:  # type: ignore[no-untyped-def]
    url, files = app
    for body in ({"experts": {"low_noise": str(files["flux"])}}, {"experts": {"high_noise": str(files["flux"])}},
                 {"path": str(files["flux"])}):
        r = _add(url, name="misfit", **body)
        assert 400 <= r.status_code < 500, r.text
        assert "flux.safetensors" in r.json()["error"]["message"], r.text
    both = _add(url, name="both", path=str(files["style"]), experts={"low_noise": str(files["style"])})
    assert both.status_code == 422 and both.json()["error"]["param"] == "experts", both.text
    unknown = _add(url, name="odd", experts={"mid_noise": str(files["style"])})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "experts.mid_noise", unknown.text
    outside = _add(url, name="outside", experts={"low_noise": "/etc/passwd"})
    assert outside.status_code == 403 and outside.json()["error"]["param"] == "experts.low_noise", outside.text
    assert {a["name"] for a in requests.get(f"{url}/v1/adapters", timeout=30).json()["data"]} \
        == {"style-low", "style-high"}  # nothing refused was kept
