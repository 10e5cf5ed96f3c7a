"""An emulated deployment of two models through the real app (deployments/emulated_box.py): a
Ray node that declares 3 GPUs, Flux.2 on 2 emulated GPUs (SP 2: the per-step agreement runs over
gloo between them), CogVideoX-5B on 1, the reference plans (plans/a6000x8.json, shrunk to those
groups) at time_scale 2000. Responses say ``emulated: true``; a video job shows per-step progress;
a 720p job arriving behind a 1080p one preempts it (``/v1/stats``)."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from PIL import Image


from deployments.emulated_box import start_box, stop_box
from xema_ray.net import free_port
from xema_ray.plan import PlanTable
from xema_ray.serving.api.ready import wait_ready

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCALE = 2000.0
FLUX = "flux2/256x256x1"
C720, C1080 = "cogvideox-5b/1280x720x49", "cogvideox-5b/1920x1088x49"


def small_table() -> PlanTable:
    """The reference plans of three templates on groups of 2 (Flux.2: SP 2 x DP 1) and 1 GPU."""
    ref = PlanTable.load(str(ROOT / "plans" / "a6000x8.json"))
    entries = {k: ref.entries[k].model_copy(update={"config": ref.entries[k].config.model_copy(update={"dp": 1})})
               for k in (FLUX, C720, C1080)}
    return ref.model_copy(update={"entries": entries, "gpus": 3, "group_gpus": {"flux2": 2, "cogvideox-5b": 1}})


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("emulated")
    table = small_table()
    table.save(str(tmp / "table.json"))
    args = {
        "device": "emulated", "time_scale": SCALE, "plan_table": str(tmp / "table.json"), "worker_cpus": 0.25,
        "jobs": {"backend": "sqlite", "path": str(tmp / "jobs")},
        "models": [
            {"model": "flux2", "workers": 2, "templates": [{"width": 256, "height": 256, "steps": 50}]},
            {"model": "cogvideox-5b", "workers": 1, "templates": [{"width": 1280, "height": 720, "frames": 49},
                                                                  {"width": 1920, "height": 1088, "frames": 49}]},
        ],
    }
    port = free_port()
    t0 = time.monotonic()
    start_box(args, port=port, num_cpus=4)
    try:
        # serve.run returns once Serve's replicas run; the Router takes a group in once it has
        # heard so itself: /healthz 200 is what a client waits for (docs/serving.md)
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=120)
        print(f"emulated app of two models ready in {time.monotonic() - t0:.0f} s")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_box()


def _wait_done(base: str, vid: str, timeout_s: float = 60) -> tuple[dict, list[int]]:
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = requests.get(f"{base}/v1/videos/{vid}", timeout=10).json()
        seen.append(v["progress"])
        if v["status"] in ("completed", "failed"):
            return v, seen
        time.sleep(0.1)
    raise AssertionError(f"video {vid} not done after {timeout_s} s: {seen[-5:]}")


def test_an_image_runs_on_two_emulated_gpus_and_says_emulated(box: str) -> None:
    table = small_table()
    r = requests.post(f"{box}/v1/images/generations", json={"model": "flux2", "prompt": "a cat", "size": "256x256"},
                      timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["emulated"] is True and r.headers["X-Xema-Emulated"] == "true"
    assert r.headers["X-Xema-Workers"] == "0,1"  # its SP-2 group, both emulated GPUs
    png = Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))
    assert png.size == (256, 256)
    p = table.entries[FLUX].prediction
    planned = p.latency_by_batch.get(int(r.headers["X-Xema-Batch-Size"]), p.latency_s) / SCALE
    # the plan's time (10 ms here), plus the group's Ray call and 50 per-step gloo agreements
    assert planned <= float(r.headers["X-Xema-Batch-Seconds"]) < planned + 0.25


def test_a_video_job_shows_per_step_progress_and_a_720p_job_preempts_a_1080p_one(box: str) -> None:
    long = requests.post(f"{box}/v1/videos", json={"model": "cogvideox-5b", "prompt": "a long one",
                                                   "size": "1920x1088", "seconds": "6"}, timeout=30).json()
    assert long["emulated"] is True
    time.sleep(1.5)  # the 1080p job (4.8 s here) is running on the group's only GPU
    short = requests.post(f"{box}/v1/videos", json={"model": "cogvideox-5b", "prompt": "a short one",
                                                    "size": "1280x720", "seconds": "6"}, timeout=30).json()
    done_short, seen_short = _wait_done(box, short["id"])
    during = requests.get(f"{box}/v1/videos/{long['id']}", timeout=10).json()
    done_long, seen_long = _wait_done(box, long["id"])
    assert done_short["status"] == done_long["status"] == "completed"
    assert during["status"] == "in_progress"  # the 720p finished first: the 1080p was paused meanwhile
    steps = sorted(set(seen_long) - {0, 100})
    assert len(steps) >= 10, seen_long  # per-step progress, not 0 then 100
    stats = requests.get(f"{box}/v1/stats", timeout=30).json()
    pre = stats["preemption"]["cogvideox-5b"]
    assert pre["per_template"][C1080]["preemptions"] >= 1 and pre["decisions"] >= 1
    assert pre["recent"][0]["kind"] == "preempt" and pre["recent"][0]["template"] == C1080
    # the pause handshake beyond the predicted step boundary is measured (the simulator is charged it):
    # Ray calls and the group's event loop, a few ms to a few hundred on a loaded 2-core machine
    park = pre["park_overhead"]
    assert park["total"] >= 1 and len(park["recent_s"]) == min(park["total"], 1000)
    assert -0.1 < park["p50_s"] < 2.0, park
    content = requests.get(f"{box}/v1/videos/{short['id']}/content", timeout=30)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4" and len(content.content) > 1000
