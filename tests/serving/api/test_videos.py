"""Mapping ``seconds`` / ``size`` onto served templates, the Video view, the poll hint and the
image output formats (no server)."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

from xema_ray.runtime.encode import encode_mp4, encode_png
from xema_ray.serving.api.schemas import UnsupportedTemplate
from xema_ray.serving.jobs.store import JobRecord, JobStoreConfig
from xema_ray.serving.jobs.progress import PhaseEstimate
from xema_ray.serving.api.media import first_frame_png, transcode_image
from xema_ray.serving.api.videos import VideoCreate, map_video_request, poll_after_ms, served_seconds, video_view
from xema_ray.templates import RequestTemplate

SERVED = {t.shape_key: t for t in (
    RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=4),
    RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=17, steps=4),
    RequestTemplate(model="tiny-cogvideox", width=128, height=96, frames=13, steps=4),
    RequestTemplate(model="tiny-ltx2", width=64, height=64, frames=25, steps=4),
    RequestTemplate(model="tiny-flux2", width=64, height=64, steps=4),
)}


def _map(**kw: object) -> RequestTemplate:
    return map_video_request(VideoCreate.model_validate({"model": "tiny-cogvideox", "prompt": "x", **kw}), SERVED)


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"size": "64x64", "seconds": "1"}, "tiny-cogvideox/64x64x9"),  # 1 + 1 s x 8 fps = 9 frames
        ({"size": "64x64", "seconds": "2"}, "tiny-cogvideox/64x64x17"),
        ({"size": "64x64", "seconds": 1.8}, "tiny-cogvideox/64x64x17"),  # nearest duration
        ({"size": "64x64"}, "tiny-cogvideox/64x64x9"),  # no seconds: the shortest served
        ({"size": "120x100", "seconds": "1.5"}, "tiny-cogvideox/128x96x13"),  # nearest size within 25 %
        ({}, "tiny-cogvideox/64x64x9"),  # nothing: the smallest size
        ({"size": "64x64", "num_frames": 17}, "tiny-cogvideox/64x64x17"),
    ],
)
def test_seconds_and_size_map_to_the_nearest_served_template(kw: dict, key: str) -> None:
    assert _map(**kw).shape_key == key


def test_frame_rate_is_the_models_own() -> None:
    t = map_video_request(VideoCreate(model="tiny-ltx2", prompt="x", size="64x64", seconds="1"), SERVED)
    assert t.frames == 25 and served_seconds(t) == "1"  # LTX-2 at 24 fps


def test_a_step_count_is_served_by_the_same_template() -> None:
    # the step count is a request option (xema_ray.serving.api.options), not part of the template
    base = map_video_request(VideoCreate(model="tiny-cogvideox", prompt="x", size="64x64"), SERVED)
    assert map_video_request(VideoCreate(model="tiny-cogvideox", prompt="x", size="64x64", num_inference_steps=50),
                             SERVED) == base


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"size": "640x480"}, "does not serve a size near 640x480; served: 64x64 for 1 s"),
        ({"size": "64x64", "seconds": "8"}, "does not serve 8 s"),
        ({"size": "64x64", "num_frames": 13}, "does not serve 13 frames"),
    ],
)
def test_error_raised_if_request_maps_to_no_served_template(kw: dict, match: str) -> None:
    with pytest.raises(UnsupportedTemplate, match=match) as info:
        _map(**kw)
    assert "tiny-cogvideox/64x64x9" in info.value.supported


def test_error_raised_if_model_is_an_image_model_or_unknown() -> None:
    with pytest.raises(UnsupportedTemplate, match="image model"):
        map_video_request(VideoCreate(model="tiny-flux2", prompt="x"), SERVED)
    with pytest.raises(UnsupportedTemplate, match="video models: tiny-cogvideox, tiny-ltx2"):
        map_video_request(VideoCreate(model="sora-2", prompt="x"), SERVED)


@pytest.mark.parametrize("seconds", ["soon", "0", "-1", "nan", True])
def test_error_raised_if_seconds_is_not_a_duration(seconds: object) -> None:
    with pytest.raises(ValueError, match="seconds"):
        VideoCreate.model_validate({"model": "m", "prompt": "x", "seconds": seconds})


def _rec(**kw: object) -> JobRecord:
    base = {"id": "video_1", "model": "m", "template": "m/64x64x9", "prompt": "p", "seed": 1, "steps": 4, "size": "64x64",
            "seconds": "1", "frames": 9, "predicted_s": 10.0, "created_at": time.time()}
    return JobRecord.model_validate({**base, **kw})


def test_video_view_reports_progress_in_percent() -> None:
    assert video_view(_rec(status="in_progress", progress=0.999)).progress == 99  # 100 only when completed
    assert video_view(_rec(status="completed", progress=1.0)).progress == 100
    failed = video_view(_rec(status="failed", error_code="generation_failed", error_message="boom"))
    assert failed.error is not None and failed.error.message == "boom"


def test_poll_hint_is_a_tenth_of_the_remaining_time_within_bounds() -> None:
    cfg = JobStoreConfig(poll_min_ms=50, poll_max_ms=5000)
    now = time.time()
    assert poll_after_ms(_rec(), cfg, now) == 1000  # queued: a tenth of the predicted 10 s
    assert poll_after_ms(_rec(status="in_progress", progress=0.5, progress_at=now), cfg, now) == 500
    assert poll_after_ms(_rec(status="in_progress", progress=0.5, progress_at=now - 4), cfg, now) == 100
    assert poll_after_ms(_rec(status="in_progress", progress=0.9, progress_at=now - 60), cfg, now) == 50
    assert poll_after_ms(_rec(predicted_s=7200.0), cfg, now) == 5000


def test_progress_is_the_fraction_of_predicted_time() -> None:
    est = PhaseEstimate(steps=4, text_s=1.0, denoise_step_s=2.0, decode_s=2.0, encode_s=1.0)
    assert est.total_s == 12.0
    assert [round(est.after_step(k), 3) for k in range(5)] == [0.083, 0.25, 0.417, 0.583, 0.75]
    assert est.after_decode() == 11 / 12
    plan = PhaseEstimate.from_plan(steps=5, latency_s=10.0, video=True)
    assert plan.total_s == pytest.approx(10.0) and plan.decode_s == pytest.approx(1.0)


def test_image_formats_and_thumbnail() -> None:
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    png = encode_png(img)
    assert transcode_image(png, "png") == png
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(transcode_image(png, "png", 100)))), img)  # lossless
    small, large = transcode_image(png, "jpeg", 90), transcode_image(png, "jpeg", 0)
    assert Image.open(io.BytesIO(small)).format == "JPEG" and len(small) < len(large)
    assert Image.open(io.BytesIO(transcode_image(png, "webp", 50))).format == "WEBP"
    frames = np.stack([np.full((16, 24, 3), v, np.uint8) for v in (40, 200)])
    thumb = np.asarray(Image.open(io.BytesIO(first_frame_png(encode_mp4(frames, 8.0)))), dtype=np.int16)
    assert thumb.shape == (16, 24, 3) and np.abs(thumb - 40).max() <= 3


def test_an_unreachable_store_costs_progress_not_the_batch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from xema_ray.serving.jobs.progress import JobProgress, close_publisher, publisher_for

    cfg = JobStoreConfig(backend="redis", redis_url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    try:
        obs = JobProgress(cfg, ["video_a"], others=0, estimate=PhaseEstimate(4, 0.0, 1.0, 0.0, 0.0))
        assert obs.on_step(1, 4) is False  # keep going
        obs.on_decoded()
    finally:  # its publisher's retries end with the test, not with the process
        pub = publisher_for(cfg)
        close_publisher(cfg)
        assert not pub._thread.is_alive()


def test_concurrent_thumbnail_requests_make_it_once_and_a_deleted_job_gets_404(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from bench.scenarios.factories import plan_table
    from xema_ray.serving.api import video_jobs
    from xema_ray.serving.jobs.store import open_store, result_name

    frames = np.zeros((3, 16, 16, 3), dtype=np.uint8)
    frames[0, :, :, 0] = 200
    mp4 = encode_mp4(frames, 8.0)
    made: list[int] = []

    def counted(data: bytes) -> bytes:
        made.append(1)
        time.sleep(0.2)  # slow enough that every request below arrives while it is being made
        return first_frame_png(data)

    monkeypatch.setattr(video_jobs, "first_frame_png", counted)
    cfg = JobStoreConfig(path=tmp_path)
    store = open_store(cfg)
    for job_id in ("vid_a", "vid_b"):
        store.create(JobRecord(id=job_id, model="tiny-cogvideox", template="tiny-cogvideox/16x16x3", prompt="p", seed=0,
                               steps=2, size="16x16", seconds="1", frames=3, predicted_s=1.0, created_at=time.time()))
        assert store.complete(job_id, {result_name(job_id, "video"): (mp4, "video/mp4")})
    jobs = video_jobs.VideoJobs(cfg, groups={}, served={}, table=plan_table([]))

    async def many(job_id: str, n: int) -> list:  # type: ignore[type-arg]
        return await asyncio.gather(*(jobs.content(job_id, "thumbnail") for _ in range(n)), return_exceptions=True)

    got = asyncio.run(many("vid_a", 16))
    assert made == [1] and {r.status_code for r in got} == {200} and len({bytes(r.body) for r in got}) == 1
    assert store.get_file(result_name("vid_a", "thumbnail")) is not None  # later requests read it from the store
    asyncio.run(many("vid_a", 4))
    assert made == [1]

    async def racing_delete() -> list:  # type: ignore[type-arg]
        thumbs = asyncio.gather(*(jobs.content("vid_b", "thumbnail") for _ in range(4)), return_exceptions=True)
        await asyncio.sleep(0.05)  # the thumbnail is being made
        await asyncio.to_thread(store.delete, "vid_b")
        return await thumbs

    raced = asyncio.run(racing_delete())
    assert all(isinstance(r, video_jobs.ApiError) and r.status == 404 for r in raced), raced
    assert store.get_file(result_name("vid_b", "thumbnail")) is None  # taken back, not left behind
