"""Tenancy and store faults on a live Serve app (tiny models on CPU, the Redis job store on a
redis-server of the module's own, which the tests pause, kill and restart empty), with the
official ``openai`` client: two API keys, no key and a wrong key; a paused and a dead store that
cost only the store's endpoints (503 with Retry-After) while synchronous and b64 image requests
go on; a store restarted without persistence whose in-flight jobs are written back and finish;
the thumbnail race; a connection that never finishes its headers is closed by the proxy."""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

import openai
import ray
import redis
from bench.scenarios.serve_app import running_app

from deployments.planning import machine_fingerprint
from xema_ray.net import free_port
from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.templates import RequestTemplate
from bench.scenarios.factories import plan_entry

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

COG = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=6)
FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
KEY_A, KEY_B = "alice-" + "a" * 26, "bob-" + "b" * 28
MAX_JOBS = 3
VIDEO = {"model": "tiny-cogvideox", "prompt": "waves", "size": "64x64", "seconds": "1"}
SYNC = {"model": "tiny-cogvideox", "prompt": "sync", "size": "64x64", "num_frames": 9}
IMAGE = {"model": "tiny-flux2", "prompt": "a fox", "size": "64x64"}


class Redis:
    """A redis-server on a fixed port that the tests pause, kill and start again (empty)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        self.binary, self.port = binary, free_port()
        self.dir = tempfile.mkdtemp()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                assert time.time() < deadline and self.proc.poll() is None
                time.sleep(0.05)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _entry(t: RequestTemplate, batch: int, latency_s: float) -> PlanEntry:
    return plan_entry(t, batch=batch, latency_s=latency_s, slo_s=60.0)


@pytest.fixture(scope="module")
def store_server() -> Iterator[Redis]:
    r = Redis()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, store_server: Redis) -> Iterator[str]:
    args: dict[str, Any] = {
        # the groups' workers threads of one shared replica, as make serve runs them (the API under test)
        "device": "cpu", "worker_cpus": 0.25, "worker_set": "inprocess", "shared_replicas": 1,
        "auth": {"api_keys": [{"key": KEY_A, "tenant": "alice"}, KEY_B], "max_jobs_in_flight": MAX_JOBS},
        "jobs": {"backend": "redis", "redis_url": store_server.url, "prefix": "tenancy", "ttl_s": 600, "lease_s": 2.0,
                 "poll_min_ms": 20, "timeout_s": 2.0},
        "models": [
            {"model": "tiny-flux2", "workers": 1, "wait_window_s": 0.05, "templates": [{"width": 64, "height": 64, "steps": 2}]},
            {"model": "tiny-cogvideox", "workers": 1, "wait_window_s": 0.05,
             "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 6}]},
        ],
    }
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(args), 2), gpus=2, budget_bytes=10**9,
                      entries={COG.shape_key: _entry(COG, 1, 2.0), FLUX.shape_key: _entry(FLUX, 1, 0.5)})
    os.environ["XEMA_HEADER_TIMEOUT_S"] = "2"
    try:
        with running_app(args, table, tmp_path_factory.mktemp("plans")) as url:
            yield url
    finally:
        os.environ.pop("XEMA_HEADER_TIMEOUT_S", None)


def _client(server: str, key: str | None) -> Any:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=key or "unused", max_retries=0, timeout=60,
                         **({} if key is not None else {"default_headers": {"Authorization": ""}}))


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_tenancy_matrix_with_the_openai_client(server: str) -> None:
    alice, bob = _client(server, KEY_A), _client(server, KEY_B)
    video = alice.videos.create_and_poll(**VIDEO)
    assert video.status == "completed"
    assert alice.videos.retrieve(video.id).id == video.id
    assert video.id in {v.id for v in alice.videos.list(limit=100)}
    assert video.id not in {v.id for v in bob.videos.list(limit=100)}
    for call in (lambda: bob.videos.retrieve(video.id), lambda: bob.videos.download_content(video.id),
                 lambda: bob.videos.delete(video.id)):
        with pytest.raises(openai.NotFoundError):  # another tenant's job is not there
            call()
    for client in (_client(server, None), _client(server, "wrong-" + "x" * 26)):
        with pytest.raises(openai.AuthenticationError):
            client.videos.retrieve(video.id)
        with pytest.raises(openai.AuthenticationError):
            client.videos.create(**VIDEO)
        with pytest.raises(openai.AuthenticationError):
            client.images.generate(**IMAGE)
    assert alice.videos.download_content(video.id).read()[4:8] == b"ftyp"  # still there: bob's DELETE did nothing
    assert alice.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.videos.retrieve(video.id)
    assert requests.get(f"{server}/healthz", timeout=30).status_code == 200  # probes need no key


def test_a_tenant_holds_at_most_its_jobs_in_flight(server: str) -> None:
    alice, bob = _client(server, KEY_A), _client(server, KEY_B)
    # each held job runs 10x the template's steps (seconds on this CPU), so all of them are still in
    # flight when the next one is asked for, however fast the machine runs the first
    made = [alice.videos.create(**VIDEO, extra_body={"num_inference_steps": 60}) for _ in range(MAX_JOBS)]
    with pytest.raises(openai.RateLimitError) as e:
        alice.videos.create(**VIDEO)
    assert e.value.response.headers.get("retry-after") and e.value.body["code"] == "too_many_jobs"  # type: ignore[index]
    other = bob.videos.create(**VIDEO)  # another tenant is not held up
    for v in [*made, other]:
        assert (alice if v in made else bob).videos.poll(v.id, poll_interval_ms=50).status == "completed"
    assert alice.videos.create_and_poll(**VIDEO).status == "completed"  # finished jobs free their places


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def test_a_paused_store_costs_only_the_store_endpoints(server: str, store_server: Redis) -> None:
    alice = _client(server, KEY_A)
    h = _auth(KEY_A)
    sync = lambda: requests.post(f"{server}/v1/videos/sync", json=SYNC, headers=h, timeout=60)  # noqa: E731
    base = [_timed(sync)[1] for _ in range(3)]
    running = alice.videos.create(**VIDEO)
    store_server.signal(signal.SIGSTOP)
    try:
        paused = []
        for _ in range(3):
            r, dt = _timed(sync)
            assert r.status_code == 200 and r.content[4:8] == b"ftyp"
            paused.append(dt)
        img = requests.post(f"{server}/v1/images/generations", json=IMAGE, headers=h, timeout=60)
        assert img.status_code == 200 and img.json()["data"][0]["b64_json"]
        url_img, dt_url = _timed(lambda: requests.post(f"{server}/v1/images/generations",
                                                       json={**IMAGE, "response_format": "url"}, headers=h, timeout=60))
        assert url_img.status_code == 503 and url_img.headers["retry-after"] and dt_url < 10
        for method, path in (("GET", f"/v1/videos/{running.id}"), ("GET", "/v1/videos"), ("POST", "/v1/videos")):
            r, dt = _timed(lambda: requests.request(method, f"{server}{path}", headers=h, timeout=60,
                                                    json=VIDEO if method == "POST" else None))
            assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "store_unavailable"
            assert dt < 10, (path, dt)
    finally:
        store_server.signal(signal.SIGCONT)
    print(f"\nsync 64x64x9 latency: store up {sorted(base)} s, store paused {sorted(paused)} s")
    assert max(paused) < 3 * max(base) + 1.0  # the workers never waited on the store
    assert alice.videos.poll(running.id, poll_interval_ms=50).status == "completed"  # nothing was lost


def test_a_store_restarted_empty_loses_no_accepted_job(server: str, store_server: Redis) -> None:
    alice = _client(server, KEY_A)
    h = _auth(KEY_A)
    jobs = [alice.videos.create(**VIDEO) for _ in range(2)]
    store_server.kill()
    try:
        r = requests.post(f"{server}/v1/videos/sync", json=SYNC, headers=h, timeout=60)
        assert r.status_code == 200  # a dead store does not stop synchronous work
        r = requests.get(f"{server}/v1/videos/{jobs[0].id}", headers=h, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"]
        img = requests.post(f"{server}/v1/images/generations", json={**IMAGE, "response_format": "url"}, headers=h,
                            timeout=60)
        assert img.status_code == 503 and img.headers["retry-after"]  # said before the work, not a 500 after it
    finally:
        store_server.start()  # without persistence: it comes back empty
    for job in jobs:  # the group wrote back the jobs it held; they finish instead of "never existed"
        deadline = time.time() + 60
        while True:
            r = requests.get(f"{server}/v1/videos/{job.id}", headers=h, timeout=60)
            if r.status_code == 200 and r.json()["status"] in ("completed", "failed"):
                break
            assert r.status_code in (200, 503) or r.json()["error"].get("code") == "job_store_lost", r.text
            assert "never existed" not in r.text
            assert time.time() < deadline, r.text
            time.sleep(0.1)
        assert r.json()["status"] == "completed", r.text


def _get_honouring_retry_after(url: str, headers: dict[str, str], attempts: int = 4) -> requests.Response:
    """GET as a client of the API does: a 503 (a store call that outlasted the module's 2 s store timeout on
    a loaded machine) must be JSON with Retry-After, and is tried again after it; anything else is the answer."""
    for _ in range(attempts - 1):
        r = requests.get(url, headers=headers, timeout=60)
        if r.status_code != 503:
            return r
        assert r.headers.get("Retry-After") and r.json()["error"]["message"], (r.headers, r.text)
        time.sleep(min(float(r.headers["Retry-After"]), 5.0))
    return requests.get(url, headers=headers, timeout=60)


def test_concurrent_thumbnails_and_a_racing_delete(server: str, store_server: Redis) -> None:
    alice = _client(server, KEY_A)
    h = _auth(KEY_A)
    video = alice.videos.create_and_poll(**VIDEO)
    url = f"{server}/v1/videos/{video.id}/content?variant=thumbnail"
    with cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda _: _get_honouring_retry_after(url, h), range(16)))
    assert [r.status_code for r in got] == [200] * 16 and len({r.content for r in got}) == 1
    client = redis.Redis.from_url(store_server.url)
    for _ in range(3):
        v = alice.videos.create_and_poll(**VIDEO)
        u = f"{server}/v1/videos/{v.id}/content?variant=thumbnail"
        with cf.ThreadPoolExecutor(9) as pool:
            thumbs = [pool.submit(requests.get, u, headers=h, timeout=60) for _ in range(8)]
            gone = pool.submit(requests.delete, f"{server}/v1/videos/{v.id}", headers=h, timeout=60)
            assert gone.result().status_code == 200
            assert {t.result().status_code for t in thumbs} <= {200, 404}
        assert list(client.scan_iter(match=f"tenancy:file:{v.id}*")) == []  # no thumbnail left behind


def test_a_connection_that_never_finishes_its_headers_is_closed(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(10)]
    for s in socks:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    t0 = time.monotonic()
    for s in socks:
        s.settimeout(15)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        assert data.startswith(b"HTTP/1.1 408")
        s.close()
    assert time.monotonic() - t0 < 10  # at about the 2 s header timeout of this module
    assert requests.get(f"{server}/healthz", timeout=30).status_code == 200


def test_the_malformed_bodies_get_the_same_4xx_on_every_endpoint(server: str) -> None:
    h = {**_auth(KEY_A), "Content-Type": "application/json"}
    nested = b'{"model": "tiny-flux2", "size": "64x64", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    digits = b'{"model": "tiny-flux2", "prompt": "p", "size": "64x64", "seed": ' + b"9" * 5000 + b"}"
    for body in (nested, digits):
        got = {path: requests.post(f"{server}{path}", data=body, headers=h, timeout=60)
               for path in ("/v1/images/generations", "/v1/videos", "/v1/videos/sync")}
        assert {p: r.status_code for p, r in got.items()} == dict.fromkeys(got, 422), {p: r.text[:200] for p, r in got.items()}
    files = {"prompt": ("prompt.txt", b"a red fox", "text/plain")}
    for path, fields in (("/v1/videos", {"model": "tiny-cogvideox", "size": "64x64"}),
                         ("/v1/images/generations", {"model": "tiny-flux2", "size": "64x64"})):
        r = requests.post(f"{server}{path}", data=fields, files=files, headers=_auth(KEY_A), timeout=60)
        assert r.status_code == 422 and r.json()["error"]["param"] == "prompt", r.text
