"""A video job's life cycle in a ModelGroup, without Ray (in-process workers, SQLite store):
accepted, started, progress after every step, the result stored; a job deleted while queued or
running; a batch-mate deleted; a job whose worker set fails handed back for another dispatch.
The HTTP API over it (``/v1/videos``, router replicas, reconciling orphans) is
test_video_jobs.py's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import imageio.v3 as iio
import pytest

from bench.scenarios.group_harness import Harness, entry, request, running_group
from xema_ray.runtime.worker import LoadedModel, ModelLoadConfig, Worker
from xema_ray.serving.jobs.store import JobRecord, JobStore, JobStoreConfig, new_job_id, open_store
from xema_ray.serving.jobs.store import result_name
from xema_ray.serving.group.worker_set import WORKER_KINDS, WorkerKind, worker_set_for
from xema_ray.templates import RequestTemplate

COG = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=6)


class _BrokenRebuildWorker(Worker):
    """Loads while ``ok`` is set; a rebuild started while it is clear fails."""

    ok = threading.Event()

    def load_model(self, load: ModelLoadConfig) -> LoadedModel:
        if not type(self).ok.is_set():
            raise RuntimeError("the replacement worker died while loading")
        return super().load_model(load)


@pytest.fixture(scope="module")
def jobs_cfg(tmp_path_factory: pytest.TempPathFactory) -> JobStoreConfig:
    return JobStoreConfig(path=tmp_path_factory.mktemp("jobs"), lease_s=2.0)


@pytest.fixture(scope="module")
def group(jobs_cfg: JobStoreConfig) -> Iterator[Harness]:
    """One worker, 64x64x9 videos at batch 2 (a second job joins within the 2 s wait window; a lone
    job waits that long in the queue, time enough to delete it there even on a loaded machine)."""
    _BrokenRebuildWorker.ok.set()
    WORKER_KINDS["broken-rebuild"] = WorkerKind(_BrokenRebuildWorker, platform="cpu", backend="inprocess")
    try:
        with running_group("tiny-cogvideox", {COG.shape_key: entry(COG, batch=2, latency_s=4.0)}, device="broken-rebuild",
                           worker_set=worker_set_for, wait_window_s=2.0, jobs=jobs_cfg) as h:
            yield h
    finally:
        del WORKER_KINDS["broken-rebuild"]


@pytest.fixture()
def store(jobs_cfg: JobStoreConfig) -> JobStore:
    return open_store(jobs_cfg)


def _job(store: JobStore, prompt: str = "waves", seed: int = 1) -> JobRecord:
    return store.create(JobRecord(id=new_job_id(), model="tiny-cogvideox", template=COG.shape_key, prompt=prompt, seed=seed,
                                  size="64x64", seconds="1", frames=COG.frames, predicted_s=4.0, created_at=time.time(),
                                  steps=COG.steps))


def _submit(h: Harness, rec: JobRecord) -> bool:
    return h.call(lambda g: g.submit_job(request(rec.template, rec.id, rec.prompt, rec.seed, steps=rec.steps)))


def _wait(store: JobStore, job_id: str, until: Callable[[JobRecord], bool], timeout: float = 120.0) -> JobRecord:
    deadline = time.time() + timeout
    rec = None
    while time.time() < deadline:
        rec = store.get(job_id, include_deleted=True)
        if rec is not None and until(rec):
            return rec
        time.sleep(0.01)
    raise AssertionError(f"{job_id}: condition not reached in {timeout} s; last {rec}")


def test_a_job_passes_through_progress_to_its_stored_result(group: Harness, store: JobStore, tmp_path: Path) -> None:
    rec = _job(store)
    assert _submit(group, rec)
    seen: list[JobRecord] = []

    def finished(r: JobRecord) -> bool:
        seen.append(r)
        return r.status in ("completed", "failed")

    done = _wait(store, rec.id, finished)
    assert done.status == "completed" and done.owner == group.group.owner and done.attempts == 1
    running = [r for r in seen if r.status == "in_progress"]
    assert running and any(0 < r.progress < 1 for r in running)
    assert [r.progress for r in running] == sorted(r.progress for r in running)  # never backwards
    got = store.get_file(result_name(rec.id, "video"))
    assert got is not None and got[1] == "video/mp4"
    (tmp_path / "v.mp4").write_bytes(got[0])
    assert iio.imread(tmp_path / "v.mp4").shape[:3] == (COG.frames, 64, 64)
    assert store.owner_alive(group.group.owner)  # the group's lease is kept alive


def test_a_job_handed_over_twice_runs_once(group: Harness, store: JobStore) -> None:
    rec = _job(store, seed=2)
    assert _submit(group, rec) and _submit(group, rec)  # two reconcilers saw it unowned
    assert _wait(store, rec.id, lambda r: r.status == "completed").attempts == 1
    assert not _submit(group, rec)  # finished: not queued again


def test_delete_of_a_queued_job_removes_it(group: Harness, store: JobStore) -> None:
    rec = _job(store, seed=3)
    assert _submit(group, rec)  # alone, it waits up to the 2 s window for a batch-mate
    store.delete(rec.id)
    assert group.call(lambda g: g.cancel_job(rec.id))
    time.sleep(2.5)
    tomb = store.get(rec.id, include_deleted=True)
    assert tomb is not None and tomb.started_at is None  # it never ran
    assert group.call(lambda g: g.status())["jobs"] == 0


def test_delete_of_a_running_job_stops_it_within_one_step(group: Harness, store: JobStore) -> None:
    rec = _job(store, seed=4)
    assert _submit(group, rec)
    _wait(store, rec.id, lambda r: r.step >= 1)
    store.delete(rec.id)
    tomb = _wait(store, rec.id, lambda r: r.stopped_step is not None)
    assert tomb.cancel_step is not None and tomb.stopped_step is not None
    assert tomb.stopped_step - tomb.cancel_step <= 1 and tomb.stopped_step < COG.steps
    deadline = time.time() + 10
    while group.call(lambda g: g.status())["running"] and time.time() < deadline:
        time.sleep(0.02)
    assert group.call(lambda g: g.status())["running"] == 0  # the worker is free
    nxt = _job(store, seed=5)
    assert _submit(group, nxt) and _wait(store, nxt.id, lambda r: r.status == "completed")  # and serves the next


def test_a_deleted_member_does_not_stop_its_batch(group: Harness, store: JobStore) -> None:
    a, b = _job(store, "member a", 6), _job(store, "member b", 7)
    assert _submit(group, a) and _submit(group, b)
    ra = _wait(store, a.id, lambda r: r.step >= 1)
    rb = store.get(b.id)
    assert rb is not None and rb.started_at is not None and ra.started_at is not None
    assert abs(rb.started_at - ra.started_at) < 0.5  # one batch
    store.delete(a.id)
    assert _wait(store, b.id, lambda r: r.status == "completed")
    tomb = store.get(a.id, include_deleted=True)
    assert tomb is not None and tomb.status != "completed"  # its output was dropped
    assert store.get_file(result_name(a.id, "video")) is None


def test_a_job_whose_worker_set_fails_is_handed_back_and_runs_again(group: Harness, store: JobStore) -> None:
    rec = _job(store, seed=8)
    _BrokenRebuildWorker.ok.clear()
    try:
        group.call(lambda g: g.kill_worker(0))
        assert _submit(group, rec)  # its batch finds the worker dead, and the rebuild fails
        back = _wait(store, rec.id, lambda r: r.status == "queued" and r.owner is None)
        assert back.attempts == 1 and group.call(lambda g: g.status())["status"] == "degraded"
    finally:
        _BrokenRebuildWorker.ok.set()
    assert _submit(group, rec)  # what the router's reconciler does with an unowned job
    done = _wait(store, rec.id, lambda r: r.status == "completed")
    assert done.attempts == 2 and group.call(lambda g: g.status())["status"] == "ok"


def test_a_job_whose_batch_mate_fails_its_denoising_is_run_again_and_completes(
        group: Harness, store: JobStore, jobs_cfg: JobStoreConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs in one batch, a fault planted inside the denoising loop for one of them: the batch
    runs again split; the poisoned job fails alone (500's reason, naming it), its batch-mate is
    never marked failed, completes on its first attempt, and its progress never goes back across
    the re-run while what remains is the re-run's prediction."""
    from tests.serving.planted_fault import planted_denoise_fault

    bad, ok = _job(store, "POISONED waves", 11), _job(store, "calm waves", 12)
    seen: list[JobRecord] = []
    stretched: list[tuple[float, float, float, float]] = []  # ok's re-run: predicted_s before, after, progress, remaining
    rerun = JobStore.rerun

    def spy(self: JobStore, job_id: str, owner: str, remaining_s: float) -> float | None:
        before = self.get(job_id)
        out = rerun(self, job_id, owner, remaining_s)
        after = self.get(job_id)
        if job_id == ok.id and before is not None and after is not None:
            stretched.append((before.predicted_s, after.predicted_s, after.progress, remaining_s))
        return out

    monkeypatch.setattr(JobStore, "rerun", spy)
    with planted_denoise_fault(monkeypatch, lambda prompts: "POISONED waves" in prompts,
                               lambda: RuntimeError("planted denoise fault")) as fault:
        assert _submit(group, bad) and _submit(group, ok)
        done = _wait(store, ok.id, lambda r: seen.append(r) or r.status in ("completed", "failed"))
    assert done.status == "completed" and done.attempts == 1
    assert sorted(fault.failed[0]) == ["POISONED waves", "calm waves"] and ["calm waves"] in fault.batches
    failed = _wait(store, bad.id, lambda r: r.status == "failed")
    assert failed.error_code == "generation_failed" and f"request {bad.id} failed" in (failed.error_message or "")
    since_start = seen[next(i for i, r in enumerate(seen) if r.status == "in_progress"):]
    assert {r.status for r in since_start} == {"in_progress", "completed"}  # never failed, never queued again
    running = [r for r in since_start if r.status == "in_progress"]
    assert [r.progress for r in running] == sorted(r.progress for r in running)  # never backwards
    # stretched for the re-run: what remains of the prediction after its progress is the re-run's own
    assert stretched and all(after >= before and after * (1 - min(p, 0.999)) == pytest.approx(left)
                             for before, after, p, left in stretched), stretched
    from xema_ray.serving.jobs.progress import publisher_for

    watched = publisher_for(jobs_cfg)._watched  # the failed run's observer let its jobs go
    assert bad.id not in watched and ok.id not in watched
