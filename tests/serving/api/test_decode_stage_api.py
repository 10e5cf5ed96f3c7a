"""The decode stage through the real Router (issue #54), in-process groups and decode workers:
``/v1/templates`` shows a pooled template's ``decode``; a video job's object shows ``stage``
``denoise`` then ``decode`` while in progress (absent once it is done), and its content is the
pool's video."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from bench.scenarios.factories import plan_entry
from tests.serving.api.router_harness import RouterHarness, running_router
from xema_ray.plan import DecodeStage
from xema_ray.runtime import decode_worker
from xema_ray.serving.api.videos import video_view
from xema_ray.serving.jobs.store import JobRecord, JobStoreConfig
from xema_ray.templates import RequestTemplate

COG = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2)
FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
HOLD = threading.Event()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterHarness]:
    real = decode_worker.DecodeWorker.decode

    def held(self, handed, mitigations=()):  # type: ignore[no-untyped-def]
        HOLD.wait(120)
        return real(self, handed, mitigations)

    mp = pytest.MonkeyPatch()
    mp.setattr(decode_worker.DecodeWorker, "decode", held)
    cog = plan_entry(COG, batch=1, latency_s=1.0, slo_s=120.0)
    cog = cog.model_copy(update={"config": cog.config.model_copy(
        update={"decode": DecodeStage(workers=1, gpus_per_worker=0.5)})})
    plans = {COG.shape_key: cog, FLUX.shape_key: plan_entry(FLUX, latency_s=0.5, slo_s=60.0)}
    jobs = JobStoreConfig(path=str(tmp_path_factory.mktemp("jobs")))
    try:
        with running_router(plans, wait_window_s=0.2, jobs=jobs, decode={"tiny-cogvideox": {"workers": 1}}) as h:
            yield h
    finally:
        HOLD.set()
        mp.undo()


def test_templates_show_the_decode_pool_of_a_pooled_template_only(served: RouterHarness) -> None:
    info = {t["template"]: t for t in served.get("/v1/templates").json()}
    assert info[COG.shape_key]["decode"] == {"workers": 1, "gpus_per_worker": 0.5}
    assert info[FLUX.shape_key]["decode"] is None


def test_a_video_job_reports_its_decode_stage_and_completes(served: RouterHarness) -> None:
    HOLD.clear()
    job = served.post("/v1/videos", {"model": "tiny-cogvideox", "prompt": "a fox", "size": "64x64", "seconds": "1",
                                     "seed": 5, "num_inference_steps": 2})
    assert job.status == 200, job.body[:300]
    vid = job.json()["id"]
    seen: list[str | None] = []
    deadline = time.monotonic() + 120
    while (v := served.get(f"/v1/videos/{vid}").json())["status"] != "completed":
        assert time.monotonic() < deadline and v["status"] != "failed", v
        seen.append(v.get("stage"))
        if v.get("stage") == "decode":
            HOLD.set()  # seen: let the decode worker finish
        time.sleep(0.05)
    assert "decode" in seen and "stage" not in v
    assert set(seen) <= {None, "denoise", "decode"}
    content = served.get(f"/v1/videos/{vid}/content")
    assert content.status == 200 and content.body[4:8] == b"ftyp"


def test_the_video_object_carries_stage_only_in_progress() -> None:
    rec = JobRecord(id="video_x", model="tiny-cogvideox", template=COG.shape_key, prompt="p", seed=1, size="64x64",
                    seconds="1", frames=9, predicted_s=1.0, created_at=time.time(), steps=2, status="in_progress",
                    stage="decode")
    assert video_view(rec).body()["stage"] == "decode"
    done = rec.model_copy(update={"status": "completed", "stage": None})
    assert "stage" not in video_view(done).body()
