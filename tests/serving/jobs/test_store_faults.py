"""Tenancy, races and faults of the job store, in-process on both backends (SQLite, a real
redis-server): jobs scoped to a tenant and its in-flight limit, refused creates that leave
nothing, one temporary file per writer, DELETE removing every derived file, the store epoch, and
a progress publisher that never makes a denoising step wait for a store that is paused."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from xema_ray.serving.jobs.progress import SYNC_WAIT_S, JobProgress, PhaseEstimate, publisher_for
from xema_ray.serving.jobs.store import JobRecord, JobStore, JobStoreConfig, TenantBusy, epoch_of, new_job_id
from xema_ray.serving.jobs.sqlite_store import SQLiteJobStore


def _job(**kw: object) -> JobRecord:
    base = {"id": new_job_id(), "model": "m", "template": "m/64x64x9", "prompt": "p", "seed": 1, "steps": 4, "size": "64x64",
            "seconds": "1", "frames": 9, "predicted_s": 2.0, "created_at": time.time()}
    return JobRecord.model_validate({**base, **kw})


def test_a_tenant_lists_and_reads_only_its_own_jobs(store: JobStore) -> None:
    a = [store.create(_job(tenant="alice")).id for _ in range(3)]
    b = store.create(_job(tenant="bob")).id
    store.create(_job())  # the open API's jobs belong to no one
    assert [r.id for r in store.list(limit=10, tenant="alice")[0]] == a[::-1]
    assert [r.id for r in store.list(limit=10, tenant="bob")[0]] == [b]
    assert len(store.list(limit=10)[0]) == 1
    with pytest.raises(KeyError):  # another tenant's id is no cursor
        store.list(after=b, tenant="alice")


def test_error_raised_if_a_tenant_exceeds_its_jobs_in_flight(store: JobStore) -> None:
    made = [store.create(_job(tenant="alice"), max_active=2) for _ in range(2)]
    with pytest.raises(TenantBusy) as e:
        store.create(_job(tenant="alice"), max_active=2)
    assert e.value.active == 2
    store.create(_job(tenant="bob"), max_active=2)  # other tenants are not affected
    store.fail(made[0].id, "x", "y")  # a finished job frees its place
    store.create(_job(tenant="alice"), max_active=2)


def test_the_limit_holds_under_concurrent_creates(store: JobStore) -> None:
    def create(_: int) -> bool:
        try:
            store.create(_job(tenant="carol"), max_active=3)
            return True
        except TenantBusy:
            return False
    with cf.ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(create, range(16))) == 3


def test_a_discarded_create_leaves_nothing(store: JobStore) -> None:
    j = store.create(_job())
    store.discard(j.id)
    assert store.get(j.id, include_deleted=True) is None
    assert store.list(limit=10)[0] == []


def test_concurrent_writers_of_one_file_never_collide(store: JobStore) -> None:
    name = f"{new_job_id()}.thumbnail.png"
    payloads = [bytes([i]) * (50_000 + i) for i in range(16)]

    def put(data: bytes) -> None:
        store.put_file(name, data, "image/png", time.time() + 60)
    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(put, payloads))  # none raises (they shared one .part file before)
    got = store.get_file(name)
    assert got is not None and got[0] in payloads  # one whole file won
    if isinstance(store, SQLiteJobStore):
        assert not list(store.results.glob("*.part"))  # and no temporary file is left


def test_delete_removes_every_derived_file(store: JobStore) -> None:
    j = store.create(_job())
    for name in (f"{j.id}.mp4", f"{j.id}.thumbnail.png", f"{j.id}.extra.bin"):
        store.put_file(name, b"x", "application/octet-stream", time.time() + 60)
    other = f"{new_job_id()}.mp4"
    store.put_file(other, b"y", "video/mp4", time.time() + 60)
    assert store.delete(j.id) is not None
    assert all(store.get_file(n) is None for n in (f"{j.id}.mp4", f"{j.id}.thumbnail.png", f"{j.id}.extra.bin"))
    assert store.get_file(other) is not None
    if isinstance(store, SQLiteJobStore):
        assert sorted(p.name for p in store.results.iterdir()) == [other]


def test_the_epoch_is_stable_and_job_ids_carry_it(store: JobStore) -> None:
    e = store.epoch()
    assert store.epoch() == e and len(e) == 8
    assert epoch_of(new_job_id(e)) == e and epoch_of(new_job_id()) is None
    rec = store.create(_job(id=new_job_id(e)))
    store._remove(rec.id)  # the store lost it
    assert store.restore(rec) and not store.restore(rec)  # written back once
    assert store.get(rec.id) is not None


def test_a_redis_restarted_empty_has_a_new_epoch(redis_url: str) -> None:
    import redis

    from xema_ray.serving.jobs.redis_store import RedisJobStore

    s = RedisJobStore(JobStoreConfig(backend="redis", redis_url=redis_url, prefix=f"e{time.time_ns()}"))
    before = s.epoch()
    redis.Redis.from_url(redis_url).flushdb()  # what a restart without persistence leaves
    assert s.epoch() != before


@pytest.fixture
def paused_redis() -> Iterator[tuple[str, int]]:
    """A redis-server of its own (the test pauses it), its URL and pid."""
    import shutil
    import subprocess
    import tempfile

    import redis

    from xema_ray.net import free_port

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", d],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.time() + 20
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                assert time.time() < deadline and proc.poll() is None
                time.sleep(0.05)
        try:
            yield url, proc.pid
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            proc.wait(timeout=10)


def test_steps_never_wait_for_a_paused_store(paused_redis: tuple[str, int]) -> None:
    from xema_ray.serving.jobs.redis_store import RedisJobStore

    url, pid = paused_redis
    cfg = JobStoreConfig(backend="redis", redis_url=url, prefix="p", timeout_s=0.5)
    store = RedisJobStore(cfg)
    job = store.create(_job())
    store.accept(job.id, "g")
    store.start(job.id, "g", 2.0)
    observer = JobProgress(cfg, [job.id], 0, PhaseEstimate(steps=40, text_s=0, denoise_step_s=0.05, decode_s=0.1, encode_s=0))
    rounds, waited = publisher_for(cfg)._rounds, []  # the steps that waited for a round, with the wait granted
    wait_for = rounds.wait_for

    def counted(predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        waited.append(timeout)
        return wait_for(predicate, timeout=timeout)

    rounds.wait_for = counted  # type: ignore[method-assign]
    os.kill(pid, signal.SIGSTOP)
    try:
        seconds = []
        for step in range(1, 21):
            t0 = time.perf_counter()
            assert not observer.on_step(step, 40)
            seconds.append(time.perf_counter() - t0)
            time.sleep(0.02)  # the step's compute
        # one step gives the store its SYNC_WAIT_S; once that overran, no step waits any more (counted,
        # not timed: on a loaded machine a granted 0.05 s ends late). The clock only guards against
        # steps waiting for the store's own timeout
        assert waited == [SYNC_WAIT_S], waited
        assert sum(seconds) < 20 * cfg.timeout_s / 2, seconds
    finally:
        rounds.wait_for = wait_for  # type: ignore[method-assign]
        os.kill(pid, signal.SIGCONT)
    pub = publisher_for(cfg)
    deadline = time.time() + 10
    while (not pub.idle() or (store.get(job.id) or job).step < 20) and time.time() < deadline:
        time.sleep(0.05)
    rec = store.get(job.id)
    assert rec is not None and rec.step == 20  # the coalesced progress caught up once the store answered


def test_a_deleted_job_stops_its_batch_within_a_step_or_two(tmp_path: Path) -> None:
    cfg = JobStoreConfig(path=tmp_path)
    store = SQLiteJobStore(cfg)
    job = store.create(_job())
    store.accept(job.id, "g")
    store.start(job.id, "g", 2.0)
    observer = JobProgress(cfg, [job.id], 0, PhaseEstimate(steps=50, text_s=0, denoise_step_s=0.05, decode_s=0.1, encode_s=0))
    stopped_at = None
    for step in range(1, 51):
        if step == 5:
            store.delete(job.id)
        if observer.on_step(step, 50):
            stopped_at = step
            break
        time.sleep(0.1)  # a step of compute: the publisher polls deletions meanwhile
    assert stopped_at == 5  # the DELETE landed before step 5 was reported: honoured at that report
    deadline = time.time() + 5
    while (store.get(job.id, include_deleted=True) or job).stopped_step is None and time.time() < deadline:
        time.sleep(0.02)
    assert (store.get(job.id, include_deleted=True) or job).stopped_step == stopped_at
