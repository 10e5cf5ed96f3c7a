"""The OpenAI video job API and image output options, with the official ``openai`` client against
the Serve app on CPU (SQLite job store, one router replica). ``test_video_jobs_redis.py`` runs the
same checks with the Redis store and two router replicas.

One application for the module: tiny-cogvideox 64x64x9 (1 s at 8 fps) planned at batch 2 on
SP 1, 64x64x17 (2 s) at SP 2 across both workers, tiny-flux2 64x64 at batch 2; 6 denoising steps
per video so that progress has values to pass through.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import imageio.v3 as iio
import numpy as np
import pytest
import requests
from PIL import Image

import openai
import ray
from ray import serve

from xema_ray.net import free_port
from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.jobs.store import JobRecord, JobStore, JobStoreConfig, new_job_id, open_store
from deployments.planning import machine_fingerprint
from xema_ray.templates import RequestTemplate
from xema_ray.serving.api.ready import wait_ready
from xema_ray.serving.ray_env import init_local_ray, shutdown_serve_and_ray
from bench.scenarios.factories import plan_entry

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

COG = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=6)
COG_SP = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=17, steps=6)
FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
FLUX_R1 = FLUX.with_(references=1, reference_width=64, reference_height=64)  # /v1/images/edits, one image
FLUX_R2 = FLUX.with_(references=2, reference_width=64, reference_height=64)  # ... two images
COG_I2V = RequestTemplate(model="tiny-cogvideox-i2v", width=64, height=64, frames=9, steps=2, references=1)


def _entry(t: RequestTemplate, batch: int = 1, ulysses: int = 1, latency_s: float = 4.0) -> PlanEntry:
    return plan_entry(t, batch=batch, ulysses=ulysses, latency_s=latency_s, slo_s=60.0)


def start_app(tmp: Path, jobs: dict[str, Any], router_replicas: int = 1) -> str:
    """Start Ray and the Serve app; returns its URL (the caller shuts both down)."""
    args: dict[str, Any] = {
        "device": "cpu", "worker_cpus": 0.25, "router_replicas": router_replicas,
        "jobs": {"ttl_s": 600, "lease_s": 2.0, "poll_min_ms": 20, **jobs},
        "models": [
            {"model": "tiny-flux2", "workers": 1, "wait_window_s": 0.3,
             "templates": [{"width": 64, "height": 64, "steps": 2},
                           {"width": 64, "height": 64, "steps": 2, "references": 1},
                           {"width": 64, "height": 64, "steps": 2, "references": 2}]},
            {"model": "tiny-cogvideox-i2v", "workers": 1, "wait_window_s": 0.3,
             "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 2, "references": 1}]},
            {"model": "tiny-cogvideox", "workers": 2, "wait_window_s": 1.0,
             "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 6},
                           {"width": 64, "height": 64, "frames": 17, "steps": 6}]},
        ],
    }
    table = PlanTable(
        hardware=machine_fingerprint(ServeConfig.model_validate(args), 2), gpus=2, budget_bytes=10**9,
        entries={COG.shape_key: _entry(COG, batch=2), COG_SP.shape_key: _entry(COG_SP, ulysses=2),
                 FLUX.shape_key: _entry(FLUX, batch=2, latency_s=0.5),
                 FLUX_R1.shape_key: _entry(FLUX_R1, batch=2, latency_s=0.5),
                 FLUX_R2.shape_key: _entry(FLUX_R2, batch=2, latency_s=0.5),
                 COG_I2V.shape_key: _entry(COG_I2V, batch=2)},
    )
    table.save(str(tmp / "table.json"))
    args["plan_table"] = str(tmp / "table.json")

    from deployments.app import build_app

    port = free_port()
    init_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="xema", route_prefix="/")
    wait_ready(f"http://127.0.0.1:{port}", timeout_s=300)
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def jobs_cfg(tmp_path_factory: pytest.TempPathFactory) -> JobStoreConfig:
    return JobStoreConfig(path=tmp_path_factory.mktemp("jobs"), ttl_s=600, lease_s=2.0, poll_min_ms=20)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, jobs_cfg: JobStoreConfig) -> Iterator[str]:
    url = start_app(tmp_path_factory.mktemp("plans"), {"path": str(jobs_cfg.path)})
    yield url
    shutdown_serve_and_ray()


@pytest.fixture(scope="module")
def store(server: str, jobs_cfg: JobStoreConfig) -> JobStore:
    return open_store(jobs_cfg)


class Seen:
    """Every Video object the client received, in order (an httpx response hook)."""

    def __init__(self) -> None:
        self.videos: list[dict[str, Any]] = []
        self.routers: set[str] = set()

    def __call__(self, response: Any) -> None:
        response.read()
        if "X-Xema-Router" in response.headers:
            self.routers.add(response.headers["X-Xema-Router"])
        if response.headers.get("content-type", "").startswith("application/json"):
            body = json.loads(response.content)
            if isinstance(body, dict) and body.get("object") == "video":
                self.videos.append(body)


@pytest.fixture()
def seen() -> Seen:
    return Seen()


@pytest.fixture()
def client(server: str, seen: Seen) -> Any:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=5,
                         http_client=openai.DefaultHttpxClient(event_hooks={"response": [seen]}))


def _progress_of(seen: Seen, video_id: str) -> list[int]:
    return [v["progress"] for v in seen.videos if v["id"] == video_id]


def _wait(store: JobStore, video_id: str, until: Any, timeout: float = 60.0) -> JobRecord:
    deadline = time.time() + timeout
    while time.time() < deadline:
        rec = store.get(video_id, include_deleted=True)
        if rec is not None and until(rec):
            return rec
        time.sleep(0.02)
    raise AssertionError(f"{video_id}: condition not reached in {timeout} s; last {rec}")


# ---------------------------------------------------------------------- the job life cycle
def test_create_and_poll_passes_through_progress_to_completed(client: Any, seen: Seen) -> None:
    video = client.videos.create_and_poll(model="tiny-cogvideox", prompt="waves at dusk", size="64x64", seconds="1")
    assert video.status == "completed" and video.progress == 100 and video.completed_at and video.expires_at
    assert video.size == "64x64" and video.seconds == "1" and video.model == "tiny-cogvideox"
    progress = _progress_of(seen, video.id)
    assert progress[0] == 0 and progress[-1] == 100 and progress == sorted(progress)
    # create_and_poll polls at the server's hint, a tenth of the *predicted* time (this module's plan:
    # 4 s), and the tiny job runs in a fraction of that: whether one of its polls lands mid-run is
    # chance. Progress moving while a job runs is read at a fixed 50 ms instead, over 60 steps.
    job = client.videos.create(model="tiny-cogvideox", prompt="waves at noon", size="64x64", seconds="1",
                               extra_body={"num_inference_steps": 60})
    deadline = time.time() + 120
    while job.status in ("queued", "in_progress") and time.time() < deadline:
        time.sleep(0.05)
        job = client.videos.retrieve(job.id)
    progress = _progress_of(seen, job.id)
    assert job.status == "completed" and progress == sorted(progress), progress
    assert any(0 < p < 100 for p in progress), progress  # it moved while the job ran


def test_download_content_is_an_mp4_with_the_mapped_frames(client: Any) -> None:
    video = client.videos.create_and_poll(model="tiny-cogvideox", prompt="a red kite", size="64x64", seconds="2")
    assert video.seconds == "2" and video.status == "completed"
    frames = iio.imread(client.videos.download_content(video.id).read(), extension=".mp4")
    assert frames.shape == (COG_SP.frames, 64, 64, 3)  # 2 s at 8 fps: 17 frames, the SP-2 template
    thumb = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="thumbnail").read()))
    assert thumb.format == "PNG" and thumb.size == (64, 64)
    assert np.abs(np.asarray(thumb, dtype=np.int16) - frames[0]).max() <= 2  # the first frame


def test_responses_carry_a_poll_hint_sized_to_the_remaining_time(server: str) -> None:
    r = requests.post(f"{server}/v1/videos", json={"model": "tiny-cogvideox", "prompt": "hint", "size": "64x64"}, timeout=60)
    assert r.status_code == 200, r.text
    first = int(r.headers["openai-poll-after-ms"])
    vid = r.json()["id"]
    hints = []
    while True:
        g = requests.get(f"{server}/v1/videos/{vid}", timeout=60)
        if g.json()["status"] == "completed":
            assert "openai-poll-after-ms" not in g.headers
            break
        hints.append(int(g.headers["openai-poll-after-ms"]))
        time.sleep(0.05)
    assert 20 <= first <= 10_000 and hints and min(hints) < first  # shrinks as the job nears its end


def test_list_pages(client: Any) -> None:
    made = [client.videos.create(model="tiny-cogvideox", prompt=f"page {i}", size="64x64", seconds="1").id for i in range(3)]
    page = client.videos.list(limit=2, order="desc")
    assert [v.id for v in page.data] == made[::-1][:2] and page.has_more and page.last_id == made[1]
    rest = client.videos.list(limit=2, order="desc", after=page.last_id)
    assert rest.data[0].id == made[0]
    asc = client.videos.list(limit=100, order="asc")
    ids = [v.id for v in asc.data]
    assert ids.index(made[0]) < ids.index(made[1]) < ids.index(made[2])
    listed = {v.id for v in client.videos.list(limit=100)}  # the SDK's auto-pagination walks every page
    assert set(made) <= listed
    for v in made:
        client.videos.delete(v)


def test_delete_of_a_queued_job_removes_it(client: Any, store: JobStore) -> None:
    # SP 2 uses both workers, batch 1: the third waits while the first two run; they run 10x the
    # template's steps, so both are still running when the delete arrives, however fast the machine
    running = [client.videos.create(model="tiny-cogvideox", prompt=f"q {i}", size="64x64", seconds="2",
                                    extra_body={"num_inference_steps": 60}).id for i in range(2)]
    last = client.videos.create(model="tiny-cogvideox", prompt="q 2", size="64x64", seconds="2").id
    ids = [*running, last]
    deleted = client.videos.delete(last)
    assert deleted.id == last and deleted.deleted and deleted.object == "video.deleted"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(last)
    for v in ids[:2]:
        assert client.videos.poll(v).status == "completed"
    tomb = store.get(last, include_deleted=True)
    assert tomb is not None and tomb.started_at is None  # it never ran


def test_job_survives_killing_the_router_replica(client: Any, server: str) -> None:
    video = client.videos.create(model="tiny-cogvideox", prompt="through a restart", size="64x64", seconds="1")
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["namespace"] == "serve" and "Router" in a["name"]]
    assert actors
    ray.kill(ray.get_actor(actors[0]["name"], namespace="serve"), no_restart=False)
    deadline = time.time() + 90
    while time.time() < deadline:  # Serve replaces the replica
        try:
            if requests.get(f"{server}/v1/videos/{video.id}", timeout=10).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    done = client.videos.poll(video.id)
    assert done.status == "completed"
    assert iio.imread(client.videos.download_content(video.id).read(), extension=".mp4").shape[0] == COG.frames


def test_a_job_no_group_holds_is_dispatched_again(client: Any, store: JobStore) -> None:
    def orphan(**kw: Any) -> JobRecord:
        return store.create(JobRecord(id=new_job_id(), model="tiny-cogvideox", template=COG.shape_key, prompt="orphan",
                                      seed=5, size="64x64", seconds="1", frames=9, predicted_s=4.0,
                                      created_at=time.time(), steps=COG.steps, **kw))

    # what a router replica that died between storing a job and handing it over leaves behind
    unsent = orphan()
    # and what a model group replica that died while running a job leaves (its lease lapses)
    stranded = orphan(status="in_progress", owner="tiny-cogvideox-dead", attempts=1, step=3, progress=0.5)
    for rec, attempts in ((unsent, 1), (stranded, 2)):
        done = client.videos.poll(rec.id)
        assert done.status == "completed" and (store.get(rec.id) or rec).attempts == attempts


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny-cogvideox", "prompt": "x", "size": "640x480", "seconds": "1"}, 400, "size"),
        ({"model": "tiny-cogvideox", "prompt": "x", "size": "64x64", "seconds": "8"}, 400, "seconds"),
        ({"model": "tiny-flux2", "prompt": "x", "size": "64x64"}, 400, "model"),
        ({"model": "tiny-cogvideox", "prompt": "x", "size": "64x64", "seed": "3"}, 422, "seed"),
        ({"model": "tiny-cogvideox", "prompt": "x", "size": "64x64", "fps": 24}, 400, "fps"),
        ({"model": "tiny-cogvideox", "prompt": "x", "size": "64x64", "seconds": "soon"}, 422, "seconds"),
        ({"model": "tiny-cogvideox", "prompt": "", "size": "64x64"}, 422, "prompt"),
    ],
)
def test_error_raised_if_create_is_bad(server: str, body: dict, status: int, param: str) -> None:
    r = requests.post(f"{server}/v1/videos", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    if status == 400 and param != "fps":
        assert "64x64 for 1 s (9 frames)" in err["message"] or "image model" in err["message"]
        assert err["supported_templates"]


def test_create_takes_json_or_a_form_and_nothing_else(server: str) -> None:
    url = f"{server}/v1/videos"
    form = {"model": "tiny-cogvideox", "prompt": "a form", "size": "64x64", "seconds": "1", "seed": "3"}
    r = requests.post(url, files={k: (None, v) for k, v in form.items()}, timeout=60)  # multipart, as openai sends
    assert r.status_code == 200 and r.json()["status"] in ("queued", "in_progress"), r.text
    requests.delete(f"{url}/{r.json()['id']}", timeout=60)
    for data, ctype, status in ((b"\xff\xfe", "application/json", 422), (b"[1]", "application/json", 422),
                                (b"hello", "text/plain", 415)):
        r = requests.post(url, data=data, headers={"content-type": ctype}, timeout=60)
        assert r.status_code == status and r.json()["error"]["message"], r.text


def test_error_raised_if_video_is_unknown_or_not_ready(client: Any, server: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    with pytest.raises(openai.NotFoundError):
        client.videos.delete("video_nope")
    v = client.videos.create(model="tiny-cogvideox", prompt="not yet", size="64x64", seconds="1")
    with pytest.raises(openai.BadRequestError, match="not ready"):
        client.videos.download_content(v.id)
    assert requests.get(f"{server}/v1/videos/{v.id}/content?variant=spritesheet", timeout=30).status_code == 400
    assert requests.get(f"{server}/v1/videos?after=video_nope", timeout=30).status_code == 404  # a cursor naming no job
    client.videos.delete(v.id)


def test_sync_path_still_returns_an_mp4(server: str) -> None:
    body = {"model": "tiny-cogvideox", "prompt": "sync", "size": "64x64", "num_frames": 9, "seed": 1}
    r = requests.post(f"{server}/v1/videos/sync", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    assert iio.imread(r.content, extension=".mp4").shape[0] == 9


# ---------------------------------------------------------------------- images
def test_image_url_and_output_formats_give_the_right_bytes(client: Any, server: str) -> None:
    ref = client.images.generate(model="tiny-flux2", prompt="a lighthouse", size="64x64", extra_body={"seed": 7})
    png = np.asarray(Image.open(io.BytesIO(base64.b64decode(ref.data[0].b64_json))))
    by_url = client.images.generate(model="tiny-flux2", prompt="a lighthouse", size="64x64", response_format="url",
                                    extra_body={"seed": 7})
    got = requests.get(by_url.data[0].url, timeout=30)
    assert got.headers["content-type"] == "image/png" and np.array_equal(np.asarray(Image.open(io.BytesIO(got.content))), png)
    for fmt, magic in (("png", b"\x89PNG"), ("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")):
        resp = client.images.generate(model="tiny-flux2", prompt="a lighthouse", size="64x64", output_format=fmt,
                                      output_compression=10, extra_body={"seed": 7})
        data = base64.b64decode(resp.data[0].b64_json)
        assert data.startswith(magic) and resp.output_format == fmt
        img = Image.open(io.BytesIO(data))
        assert img.format == fmt.upper() and img.size == (64, 64)
        if fmt == "png":  # lossless at any compression level
            assert np.array_equal(np.asarray(img.convert("RGB")), png)
        else:  # the same picture encoded at quality 90 (= 100 - output_compression)
            want = io.BytesIO()
            Image.fromarray(png).save(want, format=fmt.upper(), quality=90)
            assert data == want.getvalue()
    two = client.images.generate(model="tiny-flux2", prompt="two", size="64x64", n=2)
    assert len(two.data) == 2


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"n": 3}, "n"), ({"stream_options": {"x": 1}}, "stream_options"), ({"partial_images": 2}, "partial_images")],
)
def test_error_raised_if_image_option_is_unknown_or_too_large(server: str, extra: dict, param: str) -> None:
    body = {"model": "tiny-flux2", "prompt": "x", "size": "64x64", **extra}
    r = requests.post(f"{server}/v1/images/generations", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# last in the module: it restarts the video model group
def test_jobs_of_a_dead_model_group_replica_are_dispatched_again(client: Any, store: JobStore) -> None:
    video = client.videos.create(model="tiny-cogvideox", prompt="the group dies", size="64x64", seconds="2")
    before = _wait(store, video.id, lambda r: r.step >= 1)
    [replica] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == "serve" and "#ModelGroup:tiny-cogvideox#" in a["name"]]
    ray.kill(ray.get_actor(replica["name"], namespace="serve"), no_restart=False)  # its workers go with it
    done = client.videos.poll(video.id)
    assert done.status == "completed"
    after = store.get(video.id)
    assert after is not None and after.owner != before.owner and after.attempts == before.attempts + 1
    assert iio.imread(client.videos.download_content(video.id).read(), extension=".mp4").shape[0] == COG_SP.frames


def _picture(seed: int, size: tuple[int, int] = (96, 64)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_images_edit_with_one_and_two_references_through_the_openai_client(client: Any) -> None:
    def edit(*images: bytes, seed: int = 5) -> bytes:
        files = [(f"ref{i}.png", im, "image/png") for i, im in enumerate(images)]
        resp = client.images.edit(model="tiny-flux2", prompt="the fox, in winter", image=files[0] if len(files) == 1
                                  else files, size="64x64", response_format="b64_json", extra_body={"seed": seed})
        assert resp.size == "64x64"
        return base64.b64decode(resp.data[0].b64_json)

    one, two = edit(_picture(1)), edit(_picture(1), _picture(2))
    assert Image.open(io.BytesIO(one)).size == Image.open(io.BytesIO(two)).size == (64, 64)
    assert edit(_picture(1)) == one  # the same image and seed: the same bytes
    assert edit(_picture(3)) != one  # another image: another result


def test_a_bad_image_fails_alone_beside_good_edits(server: str) -> None:
    """Four edits at once (a batch of two is planned): the truncated one is refused at the door
    naming its field, the three others are served."""
    from concurrent.futures import ThreadPoolExecutor

    def post(image: bytes) -> requests.Response:
        return requests.post(f"{server}/v1/images/edits", data={"model": "tiny-flux2", "prompt": "p", "size": "64x64"},
                             files={"image": ("a.png", image, "image/png")}, timeout=120)

    images = [_picture(1), _picture(2)[:200], _picture(3), _picture(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(post, images))
    assert [r.status_code for r in answers] == [200, 422, 200, 200], [r.text[:200] for r in answers]
    assert answers[1].json()["error"]["param"] == "image" and "truncated" in answers[1].json()["error"]["message"]


def test_image_to_video_job_through_the_openai_client(client: Any) -> None:
    video = client.videos.create_and_poll(model="tiny-cogvideox-i2v", prompt="the sea moves", size="64x64",
                                          seconds="1", input_reference=("first.png", _picture(7, (128, 100)),
                                                                        "image/png"))
    assert video.status == "completed" and video.size == "64x64", video
    frames = iio.imread(io.BytesIO(client.videos.download_content(video.id).read()), extension=".mp4")
    assert frames.shape == (9, 64, 64, 3)
