"""A ModelGroup replica's published summary and its drain on scale-down, without Ray
(in-process workers, SQLite store): the summary shows its queue and running batch; draining
hands its queued jobs back to the store at once (another replica's reconciler takes them) and
lets the running batch finish here. Nothing accepted is lost."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from bench.scenarios.group_harness import Harness, entry, request, running_group
from xema_ray.serving.jobs.store import JobRecord, JobStore, JobStoreConfig, new_job_id, open_store
from xema_ray.serving.scale.replica_summary import ReplicaSummary
from xema_ray.serving.scale.scaling import summary_from_metrics, summary_metrics
from xema_ray.templates import RequestTemplate

COG = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=6)


@pytest.fixture()
def jobs_cfg(tmp_path) -> JobStoreConfig:  # type: ignore[no-untyped-def]
    return JobStoreConfig(path=tmp_path / "jobs", lease_s=5.0)


@pytest.fixture()
def group(jobs_cfg: JobStoreConfig) -> Iterator[Harness]:
    with running_group("tiny-cogvideox", {COG.shape_key: entry(COG, batch=1, latency_s=3.0)}, device="cpu",
                       wait_window_s=0.0, jobs=jobs_cfg) as h:
        yield h


def _job(store: JobStore, seed: int) -> JobRecord:
    return store.create(JobRecord(id=new_job_id(), model="tiny-cogvideox", template=COG.shape_key, prompt="waves",
                                  seed=seed, size="64x64", seconds="1", frames=COG.frames, predicted_s=3.0,
                                  created_at=time.time(), steps=COG.steps))


def test_draining_hands_queued_jobs_back_and_finishes_the_running_batch(group: Harness, jobs_cfg: JobStoreConfig) -> None:
    store = open_store(jobs_cfg)
    first, second = _job(store, 1), _job(store, 2)
    assert group.call(lambda g: g.submit_job(request(first.template, first.id, first.prompt, first.seed, steps=first.steps)))
    assert group.call(lambda g: g.submit_job(request(second.template, second.id, second.prompt, second.seed, steps=second.steps)))
    deadline = time.time() + 60
    while (store.get(first.id).status != "in_progress") and time.time() < deadline:  # type: ignore[union-attr]
        time.sleep(0.02)
    s = ReplicaSummary.model_validate(group.call(lambda g: g.replica_summary()))
    assert s.replica == group.group.owner and s.workers == 1
    assert s.queues[COG.shape_key].queued == 1 and len(s.running) == 1 and s.running[0].requests == 1
    assert 0 < s.running[0].remaining_s <= 3.0 and s.free_groups == {COG.shape_key: 0}
    back = summary_from_metrics(s.replica, summary_metrics(s), s.plans)
    assert back.queues[COG.shape_key].queued == 1 and back.running[0].workers == [0]

    report = group.call(lambda g: g.drain(budget_s=60.0))
    assert report == {"handed_back": 1, "unfinished_batches": 0}
    done, queued = store.get(first.id), store.get(second.id)
    assert done is not None and done.status == "completed"  # the running batch finished here
    assert queued is not None and queued.status == "queued" and queued.owner is None  # handed back, never started
    assert queued.started_at is None
    assert ReplicaSummary.model_validate(group.call(lambda g: g.replica_summary())).draining
