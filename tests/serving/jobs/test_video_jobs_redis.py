"""The video job checks of ``test_video_jobs.py`` with the Redis job store (a real redis-server on
a free port) and two router replicas: any replica answers for any job, and killing one loses none."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.serving.jobs.redis_server import redis_server
from tests.serving.jobs.test_video_jobs import (  # noqa: F401 - fixtures and checks reused with this module's server
    Seen,
    client,
    seen,
    serve,
    start_app,
    test_a_job_no_group_holds_is_dispatched_again,
    test_create_and_poll_passes_through_progress_to_completed,
    test_delete_of_a_queued_job_removes_it,
    test_download_content_is_an_mp4_with_the_mapped_frames,
    test_image_url_and_output_formats_give_the_right_bytes,
    test_job_survives_killing_the_router_replica,
    test_list_pages,
)
from xema_ray.serving.jobs.store import JobStore, JobStoreConfig, open_store
from xema_ray.serving.ray_env import shutdown_serve_and_ray

import ray

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def jobs_cfg() -> Iterator[JobStoreConfig]:
    with redis_server() as url:
        yield JobStoreConfig(backend="redis", redis_url=url, prefix="xema-test", ttl_s=600, lease_s=2.0, poll_min_ms=20)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, jobs_cfg: JobStoreConfig) -> Iterator[str]:
    url = start_app(tmp_path_factory.mktemp("plans"),
                    {"backend": "redis", "redis_url": jobs_cfg.redis_url, "prefix": jobs_cfg.prefix}, router_replicas=2)
    yield url
    shutdown_serve_and_ray()


@pytest.fixture(scope="module")
def store(server: str, jobs_cfg: JobStoreConfig) -> JobStore:
    return open_store(jobs_cfg)


def test_two_router_replicas_answer_for_the_same_jobs(client: Any, seen: Seen) -> None:
    video = client.videos.create(model="tiny-cogvideox", prompt="seen by both", size="64x64", seconds="1")
    deadline = time.time() + 60
    while len(seen.routers) < 2 and time.time() < deadline:
        client.videos.retrieve(video.id)
    assert len(seen.routers) == 2  # the proxy spread the polls over both replicas
    assert client.videos.poll(video.id).status == "completed"
