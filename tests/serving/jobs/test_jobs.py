"""The job store's semantics, identical on both backends (SQLite file, a real redis-server):
creation order and paging, the run life cycle, cancellation tombstones, expiry, leases and the
compare-and-set that keeps two model groups from running one job."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from xema_ray.serving.jobs.store import JobRecord, JobStore, JobStoreConfig, new_job_id
from xema_ray.serving.jobs.sqlite_store import SQLiteJobStore


def _job(**kw: object) -> JobRecord:
    base = {"id": new_job_id(), "model": "m", "template": "m/64x64x9", "prompt": "p", "seed": 1, "steps": 4, "size": "64x64",
            "seconds": "1", "frames": 9, "predicted_s": 2.0, "created_at": time.time()}
    return JobRecord.model_validate({**base, **kw})


def test_list_pages_in_creation_order(store: JobStore) -> None:
    ids = [store.create(_job()).id for _ in range(5)]
    page, more = store.list(limit=2, order="asc")
    assert [r.id for r in page] == ids[:2] and more
    page2, more2 = store.list(after=page[-1].id, limit=2, order="asc")
    assert [r.id for r in page2] == ids[2:4] and more2
    last, more3 = store.list(after=page2[-1].id, limit=2, order="asc")
    assert [r.id for r in last] == ids[4:] and not more3
    assert [r.id for r in store.list(limit=10)[0]] == ids[::-1]  # newest first by default
    with pytest.raises(KeyError):
        store.list(after="video_nope")


def test_life_cycle_progress_and_result(store: JobStore) -> None:
    j = store.create(_job())
    assert store.accept(j.id, "g1") is not None
    assert not store.start(j.id, "g2", 3.0)  # not its owner
    assert store.start(j.id, "g1", 3.0)
    store.set_progress(j.id, 0.4, 2)
    store.set_progress(j.id, 0.3, 3)  # progress never moves backwards
    rec = store.get(j.id)
    assert rec is not None and rec.status == "in_progress" and rec.progress == 0.4 and rec.step == 3
    assert store.complete(j.id, {f"{j.id}.mp4": (b"\x00mp4", "video/mp4")})
    rec = store.get(j.id)
    assert rec is not None and rec.status == "completed" and rec.progress == 1.0 and rec.expires_at
    assert store.get_file(f"{j.id}.mp4") == (b"\x00mp4", "video/mp4")
    assert store.accept(j.id, "g1") is None  # a finished job is never dispatched again


def test_delete_leaves_a_tombstone_that_running_batches_see(store: JobStore) -> None:
    j = store.create(_job())
    store.accept(j.id, "g1")
    store.start(j.id, "g1", 3.0)
    store.set_progress(j.id, 0.5, 2)
    before = store.delete(j.id)
    assert before is not None and before.status == "in_progress"
    assert store.get(j.id) is None and store.cancelled([j.id]) == {j.id}
    assert store.delete(j.id) is None  # deleting twice: nothing left to delete
    store.stopped(j.id, 3)
    tomb = store.get(j.id, include_deleted=True)
    assert tomb is not None and tomb.cancel_step == 2 and tomb.stopped_step == 3
    assert not store.complete(j.id, {f"{j.id}.mp4": (b"x", "video/mp4")})
    assert store.get_file(f"{j.id}.mp4") is None


def test_orphans_are_unaccepted_or_of_dead_owners(store: JobStore) -> None:
    lost = store.create(_job(created_at=time.time() - 5))
    fresh = store.create(_job())
    owned = store.create(_job())
    store.heartbeat("g1")
    store.accept(owned.id, "g1")
    ids = {r.id for r in store.orphans(grace_s=2)}
    assert lost.id in ids and fresh.id not in ids and owned.id not in ids
    time.sleep(0.6)  # g1's lease (0.5 s) lapses
    assert owned.id in {r.id for r in store.orphans(grace_s=2)}
    assert store.requeue(owned.id, expected_owner="g1") is not None
    assert store.requeue(owned.id, expected_owner="g1") is None  # compare-and-set: only one taker


def test_finished_jobs_expire(tmp_path: Path) -> None:
    s = SQLiteJobStore(JobStoreConfig(path=tmp_path, ttl_s=0.2))
    j = s.create(_job())
    s.accept(j.id, "g")
    s.start(j.id, "g", 1.0)
    s.complete(j.id, {f"{j.id}.mp4": (b"x", "video/mp4")})
    time.sleep(0.3)
    assert s.get(j.id) is None and s.get_file(f"{j.id}.mp4") is None
    assert s.purge_expired() == 1 and not (tmp_path / "results" / f"{j.id}.mp4").exists()


def test_error_raised_if_redis_backend_has_no_url() -> None:
    with pytest.raises(ValueError, match="redis_url"):
        JobStoreConfig(backend="redis")


def test_an_owner_reclaiming_its_job_counts_no_new_attempt(store: JobStore) -> None:
    """Two reconcilers may hand the same unowned job to a group: the second hand-over re-claims it."""
    j = store.create(_job())
    store.accept(j.id, "g1")
    store.accept(j.id, "g1")
    assert store.get(j.id).attempts == 1  # type: ignore[union-attr]
    store.accept(j.id, "g2")  # another owner taking it over is another attempt
    assert store.get(j.id).attempts == 2  # type: ignore[union-attr]


def _overwrite(store: JobStore, job_id: str, doc: str) -> None:
    """Write ``doc`` as ``job_id``'s stored record, as another version of the app would."""
    if isinstance(store, SQLiteJobStore):
        with store._lock:
            store._db.execute("UPDATE jobs SET doc = ? WHERE id = ?", (doc, job_id))
    else:
        store.r.set(store._k("job", job_id), doc)  # type: ignore[attr-defined]


def test_a_record_another_version_wrote_is_left_alone_and_scans_go_on_past_it(
        store: JobStore, caplog: pytest.LogCaptureFixture) -> None:
    """A shared store (Redis) during a rolling upgrade: a job record with a field this version does
    not know is skipped (one warning), never an error that stops the orphan scan for every job."""
    foreign = store.create(_job(created_at=time.time() - 5))
    lost = store.create(_job(created_at=time.time() - 5))
    newer = foreign.model_dump(mode="json") | {"a_field_of_a_later_version": 1}
    import json

    _overwrite(store, foreign.id, json.dumps(newer))
    with caplog.at_level("WARNING", logger="xema_ray.serving"):
        assert {r.id for r in store.orphans(grace_s=2)} == {lost.id}
        assert [r.id for r in store.list(limit=10)[0]] == [lost.id]
        assert store.get(foreign.id) is None and store.accept(foreign.id, "g1") is None
        store.orphans(grace_s=2)
    warned = [r for r in caplog.records if foreign.id in r.getMessage()]
    assert len(warned) == 1 and "a_field_of_a_later_version" in warned[0].getMessage()
    # a page holding nothing but unreadable records does not end a scan early
    for _ in range(3):
        _overwrite(store, store.create(_job()).id, "{not json")
    last = store.create(_job(created_at=time.time() - 5))
    assert store._scan(lost.seq, 2, False) == [store.get(last.id)]


def test_another_versions_active_job_still_counts_for_its_tenant(store: JobStore) -> None:
    """A tenant's job written by another version (unreadable here) stays active for the tenant's
    limit on both backends; a damaged record breaks no create."""
    import json

    from xema_ray.serving.jobs.store import TenantBusy

    foreign = store.create(_job(tenant="t1"), max_active=1)
    _overwrite(store, foreign.id, json.dumps(foreign.model_dump(mode="json") | {"a_later_field": True}))
    with pytest.raises(TenantBusy):
        store.create(_job(tenant="t1"), max_active=1)
    _overwrite(store, store.create(_job(tenant="t2")).id, "{not json")
    assert store.create(_job(tenant="t3"), max_active=1).tenant == "t3"
