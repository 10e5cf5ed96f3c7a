"""A model group with a decode pool (issue #54), without Ray (in-process DiT and decode workers,
SQLite jobs): a pooled plan's latents go to the pool and its DiT worker is free for the next batch
while they decode; the job's stage is decode meanwhile; a decode failure fails that request alone;
a decode worker killed mid-decode is replaced and the request decoded again from its latents,
without running the denoising again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import imageio.v3 as iio
import pytest

from bench.scenarios.group_harness import Harness, entry, request, running_group
from xema_ray.plan import DecodeStage
from xema_ray.runtime import decode_worker
from xema_ray.runtime.worker import Worker
from xema_ray.serving.group.decode_pool import DecodePool
from xema_ray.serving.jobs.store import JobRecord, JobStoreConfig, new_job_id, open_store, result_name
from xema_ray.templates import RequestTemplate

COG = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2)


class Gate:
    """Holds every decode until opened; fails the decode of any request id in ``fail``."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.waiting = threading.Semaphore(0)
        self.fail: set[str] = set()


GATE = Gate()
DIT_RUNS: list[str] = []


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    real_decode, real_execute = decode_worker.DecodeWorker.decode, Worker.execute

    def gated(self, handed, mitigations=()):  # type: ignore[no-untyped-def]
        GATE.waiting.release()
        GATE.open.wait(120)
        if handed.request_id in GATE.fail:
            raise ValueError(f"decode of {handed.request_id} failed")
        return real_decode(self, handed, mitigations)

    def counted(self, batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        DIT_RUNS.extend(r.request_id for r in batch.requests)
        return real_execute(self, batch, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(decode_worker.DecodeWorker, "decode", gated)
    mp.setattr(Worker, "execute", counted)
    pooled = entry(COG, batch=2, latency_s=2.0)
    pooled = pooled.model_copy(update={"config": pooled.config.model_copy(
        update={"decode": DecodeStage(workers=1, gpus_per_worker=1)})})
    jobs = JobStoreConfig(path=tmp_path_factory.mktemp("jobs"), lease_s=2.0)
    try:
        with running_group("tiny-cogvideox", {COG.shape_key: pooled}, wait_window_s=0.3, jobs=jobs,
                           decode={"workers": 1}) as h:
            yield h
    finally:
        mp.undo()


def _pool(h: Harness) -> DecodePool:
    assert h.group.decode_pool is not None
    return h.group.decode_pool


def _mp4_frames(data: bytes) -> int:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        shape = iio.imread(f.name).shape
    assert shape[1:3] == (64, 64)
    return int(shape[0])


def test_the_pool_decodes_and_the_dit_worker_is_free_while_it_does(group: Harness) -> None:
    pool = _pool(group)
    assert pool.backend == "inprocess" and pool.report()["alive"] == 1
    GATE.open.clear()
    fut = group.submit(lambda g: g.generate(request(COG.shape_key, "r1", "a fox", 1, steps=COG.steps)))
    assert GATE.waiting.acquire(timeout=120), "the latents never reached the decode pool"
    # the batch's latents are on the pool: its DiT worker is free (no running batch) while it decodes
    deadline = time.time() + 10
    while group.group.dispatcher.running and time.time() < deadline:
        time.sleep(0.01)
    assert not group.group.dispatcher.running and DIT_RUNS.count("r1") == 1 and not fut.done()
    GATE.open.set()
    out = fut.result(120)
    assert out.media_type == "video/mp4" and out.frames == 9 and _mp4_frames(out.data) == 9
    assert pool.report()["decoded"] >= 1


def test_a_decode_failure_fails_that_request_alone(group: Harness) -> None:
    GATE.fail = {"bad"}
    try:
        futs = {rid: group.submit(lambda g, rid=rid: g.generate(request(COG.shape_key, rid, "a fox", 2, steps=COG.steps)))
                for rid in ("good", "bad")}
        assert futs["good"].result(120).frames == 9
        with pytest.raises(ValueError, match="decode of bad failed"):
            futs["bad"].result(120)
    finally:
        GATE.fail = set()


def test_a_video_job_shows_its_decode_stage_and_survives_a_killed_decode_worker(group: Harness) -> None:
    pool, store = _pool(group), open_store(group.group.jobs.cfg)  # type: ignore[arg-type]
    rec = store.create(JobRecord(id=new_job_id(), model="tiny-cogvideox", template=COG.shape_key, prompt="waves",
                                 seed=3, size="64x64", seconds="1", frames=9, predicted_s=2.0,
                                 created_at=time.time(), steps=COG.steps))
    GATE.open.clear()
    before = dict(pool.report())
    assert group.call(lambda g: g.submit_job(request(COG.shape_key, rec.id, rec.prompt, rec.seed, steps=COG.steps)))
    assert GATE.waiting.acquire(timeout=120)
    deadline = time.time() + 30
    while (r := store.get(rec.id)) is not None and r.stage != "decode" and time.time() < deadline:
        time.sleep(0.02)
    assert r is not None and r.status == "in_progress" and r.stage == "decode"
    pool.kill(0)  # the decode worker dies under the job's decode
    GATE.open.set()
    deadline = time.time() + 120
    while (r := store.get(rec.id)) is not None and r.status != "completed" and time.time() < deadline:
        time.sleep(0.05)
    assert r is not None and r.status == "completed" and r.stage is None
    after = pool.report()
    assert after["retried"] == before["retried"] + 1 and after["replaced"] == before["replaced"] + 1
    assert after["alive"] == 1
    assert DIT_RUNS.count(rec.id) == 1  # decoded again from its latents: the denoising ran once
    stored = store.get_file(result_name(rec.id, "video"))
    assert stored is not None and stored[1] == "video/mp4" and _mp4_frames(stored[0]) == 9
