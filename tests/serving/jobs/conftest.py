"""Fixtures shared by the job-store tests: a redis-server of the module's own, and a store on
each backend (a SQLite file, that redis-server), so that every store test runs on both."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving.jobs.redis_server import redis_server
from xema_ray.serving.jobs.sqlite_store import SQLiteJobStore
from xema_ray.serving.jobs.store import JobStore, JobStoreConfig


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """The URL of a redis-server started for the module (skips where redis-server is not installed)."""
    with redis_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> JobStore:
    """An empty job store on each backend: 60 s TTL, 0.5 s leases; on Redis, a prefix of its own."""
    if request.param == "sqlite":
        return SQLiteJobStore(JobStoreConfig(path=tmp_path, ttl_s=60, lease_s=0.5))
    from xema_ray.serving.jobs.redis_store import RedisJobStore

    url = request.getfixturevalue("redis_url")
    return RedisJobStore(JobStoreConfig(backend="redis", redis_url=url, prefix=f"t{time.time_ns()}", ttl_s=60, lease_s=0.5))
