"""Integration: the Ray Serve application on CPU (tiny models, CPU worker bundles), HTTP in and out.

One application for the module (start-up costs seconds): tiny-flux2 64² planned at batch 2
(SP 1, DP 1 on one worker), tiny-flux2 128² at batch 1, and tiny-cogvideox 64²×9 planned at SP 2
across two workers. Plans are given as a table so each behaviour is pinned. The tiny-flux2 group
serves LoRA adapters (two from its folder, one hot-added through the admin API).
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import time
from concurrent.futures import ThreadPoolExecutor

import imageio.v3 as iio
import pytest
import requests
from PIL import Image

import ray
from ray import serve
from bench.scenarios.serve_app import running_app

from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.serving.config import ServeConfig
from deployments.planning import machine_fingerprint
from xema_ray.templates import RequestTemplate
from bench.scenarios.factories import plan_entry
from tests.batch_sizes import assert_same_picture_across_batch_sizes
from loadtests.prometheus import ALWAYS_AFTER_TRAFFIC, documented_metrics, metrics_urls, scrape
from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec

pytestmark = pytest.mark.slow

FLUX_S = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
FLUX_L = RequestTemplate(model="tiny-flux2", width=128, height=128, steps=2)
COG = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2)



def _entry(t: RequestTemplate, batch: int = 1, ulysses: int = 1, dp: int = 1) -> PlanEntry:
    return plan_entry(t, batch=batch, ulysses=ulysses, dp=dp)


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A (diffusers names) and B (ai-toolkit's Flux.2 names) in the group's folder; C to hot-add."""
    folder, hot = tmp_path_factory.mktemp("adapters"), tmp_path_factory.mktemp("hot")
    dit = get_model_spec("tiny-flux2").build_pipeline(BuildOptions(device="meta")).transformer  # shapes only
    write_adapter(folder / "A.safetensors", dit, rank=4, seed=1)
    write_adapter(folder / "B.safetensors", dit, rank=8, seed=2, layout="ai-toolkit-flux2")
    return {"folder": folder, "hot": hot, "C": write_adapter(hot / "c.safetensors", dit, rank=4, seed=3, layout="ai-toolkit-flux2")}


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter_files):  # type: ignore[no-untyped-def]
    args = {
        "device": "cpu",
        "worker_cpus": 0.25,
        "jobs": {"path": str(tmp_path_factory.mktemp("jobs"))},
        "models": [
            {"model": "tiny-flux2", "workers": 1, "wait_window_s": 0.5, "max_queue": 3,
             "templates": [{"width": 64, "height": 64, "steps": 2}, {"width": 128, "height": 128, "steps": 2}],
             "adapters": {"dir": str(adapter_files["folder"]), "slots": 2, "max_rank": 8,
                          "roots": [str(adapter_files["folder"]), str(adapter_files["hot"])]}},
            {"model": "tiny-cogvideox", "workers": 2, "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 2}]},
        ],
    }
    table = PlanTable(
        hardware=machine_fingerprint(ServeConfig.model_validate(args), 2), gpus=2, budget_bytes=10**9,
        entries={FLUX_S.shape_key: _entry(FLUX_S, batch=2), FLUX_L.shape_key: _entry(FLUX_L),
                 COG.shape_key: _entry(COG, ulysses=2)},
    )
    with running_app(args, table, tmp_path_factory.mktemp("plans"), metrics_report_ms=500) as url:
        yield url


def _image(url: str, **overrides) -> requests.Response:  # type: ignore[no-untyped-def]
    body = {"model": "tiny-flux2", "prompt": "a red fox", "size": "64x64", "seed": 3, **overrides}
    return requests.post(f"{url}/v1/images/generations", json=body, timeout=120)


def test_templates_and_models_are_listed(server: str) -> None:
    got = requests.get(f"{server}/v1/templates", timeout=30).json()
    assert {g["template"] for g in got} == {FLUX_S.shape_key, FLUX_L.shape_key, COG.shape_key}
    assert {m["id"] for m in requests.get(f"{server}/v1/models", timeout=30).json()["data"]} == {"tiny-flux2", "tiny-cogvideox"}


def test_image_request_returns_a_png(server: str) -> None:
    r = _image(server, size="128x128")
    assert r.status_code == 200, r.text
    img = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    assert img.format == "PNG" and img.size == (128, 128)
    assert r.headers["X-Xema-Template"] == FLUX_L.shape_key
    # where it ran travels from the group as a typed result and comes back as headers
    assert r.headers["X-Xema-Batch-Size"] == "1" and r.headers["X-Xema-Workers"] == "0"
    assert int(r.headers["X-Xema-Batch-Id"]) >= 0 and float(r.headers["X-Xema-Batch-Seconds"]) > 0


def test_openai_client_gets_a_png(server: str) -> None:
    import openai
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    resp = client.images.generate(model="tiny-flux2", prompt="a lighthouse", size="64x64", response_format="b64_json")  # type: ignore[arg-type]
    img = Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json)))
    assert img.format == "PNG" and img.size == (64, 64)


def test_sp2_video_runs_across_two_workers_and_decodes(server: str) -> None:
    body = {"model": "tiny-cogvideox", "prompt": "waves", "size": "64x64", "num_frames": 9, "seed": 1}
    r = requests.post(f"{server}/v1/videos/sync", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4" and r.headers["X-Xema-Workers"] == "0,1"
    frames = iio.imread(r.content, extension=".mp4")
    assert frames.shape[0] == 9 and frames.shape[1:3] == (64, 64)


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/images/generations", {"model": "nope", "prompt": "x", "size": "64x64"}, 400),
        ("/v1/images/generations", {"model": "tiny-flux2", "prompt": "x", "size": "96x96"}, 400),
        ("/v1/videos/sync", {"model": "tiny-flux2", "prompt": "x", "size": "64x64", "num_frames": 9}, 400),
        ("/v1/images/generations", {"model": "tiny-flux2", "prompt": "x", "size": "64x64", "num_inference_steps": -1}, 422),
        ("/v1/images/generations", {"model": "tiny-flux2", "prompt": "x", "size": "64x64", "num_inference_steps": 201}, 422),
        ("/v1/images/generations", {"model": "tiny-flux2", "prompt": "", "size": "64x64"}, 422),
        ("/v1/images/generations", {"model": "tiny-flux2", "prompt": "x" * 100_000, "size": "64x64"}, 422),
        ("/v1/images/generations", {"model": "tiny-flux2", "prompt": 5, "size": "64x64"}, 422),
        ("/v1/images/generations", {"model": "tiny-flux2", "prompt": "x", "size": 64}, 422),
        ("/v1/images/generations", {"model": "tiny-flux2", "prompt": "x", "size": "64x64", "seed": "1"}, 422),
        ("/v1/videos/sync", {"model": "tiny-cogvideox", "prompt": "x", "size": "64by64", "num_frames": 9}, 422),
    ],
)
def test_error_raised_if_input_is_bad(server: str, path: str, body: dict, status: int) -> None:
    r = requests.post(f"{server}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["supported_templates"]
    assert _image(server, size="128x128").status_code == 200  # and the server keeps serving


def _png(r: requests.Response) -> bytes:
    return base64.b64decode(r.json()["data"][0]["b64_json"])


def test_requests_with_different_adapters_share_a_batch_and_keep_their_bytes(server: str) -> None:
    def together(*bodies: dict) -> list[requests.Response]:  # type: ignore[type-arg]
        # sent at once, they land in one batch when both reach the group within its 0.5 s wait window;
        # on a loaded machine the second can miss it: only that timing is tried again (3 times at most)
        for _ in range(3):
            with ThreadPoolExecutor(len(bodies)) as pool:
                out = list(pool.map(lambda b: _image(server, **b), bodies))
            assert all(r.status_code == 200 for r in out), [r.text for r in out]
            if len({r.headers["X-Xema-Batch-Id"] for r in out}) == 1:
                break
        assert {r.headers["X-Xema-Batch-Id"] for r in out} == {out[0].headers["X-Xema-Batch-Id"]}
        assert all(r.headers["X-Xema-Batch-Size"] == "2" for r in out)  # different adapters, one batch
        return out

    a, b = together({"seed": 21, "lora": [{"name": "A", "scale": 1.0}]},
                    {"seed": 22, "lora": [{"name": "B", "scale": 0.7}, {"name": "A", "scale": 0.5}]})
    assert a.json()["data"][0]["b64_json"] != b.json()["data"][0]["b64_json"]
    # beside another neighbour (no adapter) the same request gets the same bytes
    a2, plain = together({"seed": 21, "lora": [{"name": "A", "scale": 1.0}]}, {"seed": 23})
    assert a2.json()["data"][0]["b64_json"] == a.json()["data"][0]["b64_json"]
    alone = _image(server, seed=21, lora=[{"name": "A", "scale": 1.0}])  # a batch of one: the same picture
    assert alone.headers["X-Xema-Batch-Size"] == "1"
    assert_same_picture_across_batch_sizes(_png(alone), _png(a))
    stats = requests.get(f"{server}/v1/stats", timeout=30).json()["adapters"]["tiny-flux2"]
    assert stats[0]["slots"] == 2 and stats[0]["copies"] >= 2


def test_openai_client_with_a_hot_added_adapter_then_removed(server: str, adapter_files) -> None:  # type: ignore[no-untyped-def]
    import openai
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    args = {"model": "tiny-flux2", "prompt": "a lighthouse", "size": "64x64", "response_format": "b64_json"}
    with pytest.raises(openai.NotFoundError, match="unknown adapter 'C'"):
        client.images.generate(**args, extra_body={"lora": [{"name": "C", "scale": 1.0}], "seed": 5})  # type: ignore[arg-type]
    bad = requests.post(f"{server}/v1/adapters", json={"name": "D", "model": "tiny-flux2",
                                                       "path": str(adapter_files["folder"] / "missing.safetensors")}, timeout=60)
    assert bad.status_code == 422 and "'D'" in bad.json()["error"]["message"], bad.text
    r = requests.post(f"{server}/v1/adapters", json={"name": "C", "model": "tiny-flux2", "path": str(adapter_files["C"])},
                      timeout=60)
    assert r.status_code == 201, r.text
    assert {"A", "B", "C"} <= {a["name"] for a in requests.get(f"{server}/v1/adapters", timeout=30).json()["data"]}
    resp = client.images.generate(**args, extra_body={"lora": [{"name": "C", "scale": 1.0}], "seed": 5})  # type: ignore[arg-type]
    plain = client.images.generate(**args, extra_body={"seed": 5})  # type: ignore[arg-type]
    assert resp.data[0].b64_json != plain.data[0].b64_json
    assert requests.delete(f"{server}/v1/adapters/C", timeout=60).json()["deleted"] is True
    with pytest.raises(openai.NotFoundError, match="unknown adapter 'C'"):
        client.images.generate(**args, extra_body={"lora": [{"name": "C", "scale": 1.0}], "seed": 5})  # type: ignore[arg-type]


def test_killed_worker_of_an_sp2_set_is_replaced_and_the_request_retried(server: str) -> None:
    # Ray's part: an actor's death is seen, the two-actor set gets a new torch.distributed world
    # (the group's retry and rebuild logic is test_model_group.py's, without Ray)
    group = serve.get_deployment_handle("ModelGroup:tiny-cogvideox", app_name="xema")
    before = group.status.remote().result()["generation"]
    group.kill_worker.remote(1).result()
    deadline = time.time() + 30
    while group.probe_workers.remote(2.0).result()[1] != "dead" and time.time() < deadline:
        time.sleep(0.2)  # Ray says the actor died: a fact, not a slow answer
    assert group.probe_workers.remote(2.0).result() == ["ok", "dead"]
    body = {"model": "tiny-cogvideox", "prompt": "after the crash", "size": "64x64", "num_frames": 9, "seed": 2}
    r = requests.post(f"{server}/v1/videos/sync", json=body, timeout=300)
    assert r.status_code in (200, 503), r.text  # a retried success, or a clean error naming the failure
    deadline = time.time() + 120
    while group.status.remote().result()["generation"] == before and time.time() < deadline:
        time.sleep(1)
    assert group.status.remote().result()["generation"] == before + 1
    r2 = requests.post(f"{server}/v1/videos/sync", json={**body, "seed": 4}, timeout=300)
    assert r2.status_code == 200, r2.text  # the group recovered


def _wait_of(got: dict, template: str) -> float:
    return max((x.value for x in got.get("xema_predicted_queue_wait_s", []) if x.labels.get("template") == template),
               default=-1.0)


def test_prometheus_endpoint_has_the_documented_metrics_and_the_queue_wait_rises_under_a_burst(server: str) -> None:
    urls = metrics_urls()  # Ray's Prometheus endpoint of this node (reported every 0.5 s here)
    deadline = time.time() + 30
    while (idle := _wait_of(scrape(urls), FLUX_L.shape_key)) < 0 and time.time() < deadline:
        time.sleep(0.5)  # a group's figures from start-up on
    assert idle >= 0

    # a burst at the 128² template (batches of 1, 0.5 s planned, a queue of 3) from 8 clients for 4 s:
    # the queue stays full, the rest are refused (queue_full); the endpoint is read meanwhile
    stop = time.time() + 4.0
    statuses: list[int] = []

    def client(i: int) -> None:
        while time.time() < stop:
            statuses.append(_image(server, size="128x128", seed=i).status_code)

    waits = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, i) for i in range(8)]
        while time.time() < stop + 1.0:
            waits.append(_wait_of(scrape(urls), FLUX_L.shape_key))
            time.sleep(0.25)
        for f in futures:
            f.result()
    assert 200 in statuses and 503 in statuses
    assert max(waits) >= idle + 1.0, waits  # at least two planned batches ahead at some point

    video = {"model": "tiny-cogvideox", "prompt": "waves", "size": "64x64", "num_frames": 9, "seed": 5}
    assert requests.post(f"{server}/v1/videos/sync", json=video, timeout=120).status_code == 200
    assert _image(server, size="96x96").status_code == 400  # unknown_template
    assert _image(server, seed=-1).status_code == 422  # bad_request_field
    expected = {n for n, d in documented_metrics().items() if d.exported_from in ALWAYS_AFTER_TRAFFIC}
    deadline = time.time() + 30
    while True:
        got = scrape(urls)
        reasons = {x.labels["reason"] for x in got.get("xema_requests_refused", [])}
        if (expected <= set(got) and {"queue_full", "unknown_template", "bad_request_field"} <= reasons) \
                or time.time() > deadline:
            break
        time.sleep(0.5)
    assert expected - set(got) == set()
    assert {"queue_full", "unknown_template", "bad_request_field"} <= reasons
    assert set(got) <= set(documented_metrics())  # nothing exported that the table does not document
    assert _wait_of(got, FLUX_L.shape_key) < max(waits)  # drained: it falls back
    realtime = [x.value for x in got["xema_video_realtime_factor"] if x.labels["template"] == COG.shape_key]
    assert realtime and realtime[0] > 0
