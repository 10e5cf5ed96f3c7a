"""Synchronous latency while the job store is paused: the Serve app on CPU (tiny-cogvideox on
one worker, the Redis job store on a redis-server of its own) with video jobs running, then
``/v1/videos/sync`` requests timed with the store up and with redis-server stopped (SIGSTOP).

    .venv/bin/python bench/store_pause.py [--port 8300] [--pause-s 25]

It uses only what ``build_app`` has long accepted, so the same file measures an older checkout
(run it with that checkout's interpreter, from its root). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import ray
import redis
import requests
from ray import serve

from bench.scenarios.factories import plan_entry
from deployments.app import build_app
from deployments.planning import machine_fingerprint
from xema_ray.net import free_port
from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.jobs.store import JobStoreConfig
from xema_ray.templates import RequestTemplate

SYNC = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=4)
JOB = RequestTemplate(model="tiny-cogvideox", width=128, height=96, frames=17, steps=4)


def _entry(t: RequestTemplate, latency_s: float) -> PlanEntry:
    return plan_entry(t, batch=2, latency_s=latency_s, slo_s=60.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--pause-s", type=float, default=25.0)
    ap.add_argument("--samples", type=int, default=4)
    a = ap.parse_args()
    binary = shutil.which("redis-server")
    assert binary, "redis-server is needed (apt-get install -y redis-server)"
    rport, tmp = free_port(), tempfile.mkdtemp()
    proc = subprocess.Popen([binary, "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--dir", tmp],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    rurl = f"redis://127.0.0.1:{rport}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(rurl).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    jobs = {"backend": "redis", "redis_url": rurl, "prefix": "bench", "lease_s": 10.0}
    if "timeout_s" in JobStoreConfig.model_fields:
        jobs["timeout_s"] = 2.0
    args = {"device": "cpu", "worker_cpus": 0.25, "jobs": jobs,
            "models": [{"model": "tiny-cogvideox", "workers": 1, "wait_window_s": 0.05,
                        "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 4},
                                      {"width": 128, "height": 96, "frames": 17, "steps": 4}]}]}
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(args), 1), gpus=1, budget_bytes=10**9,
                      entries={SYNC.shape_key: _entry(SYNC, 0.5), JOB.shape_key: _entry(JOB, 2.0)})
    path = os.path.join(tmp, "table.json")
    table.save(path)
    args["plan_table"] = path
    out: dict = {}
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        serve.run(build_app(args), name="xema", route_prefix="/")
        url = f"http://127.0.0.1:{a.port}"
        body = {"model": "tiny-cogvideox", "prompt": "sync", "size": "64x64", "num_frames": 9}
        job = {"model": "tiny-cogvideox", "prompt": "job", "size": "128x96", "num_frames": 17}
        stop = threading.Event()

        def keep_jobs_running() -> None:  # the worker always has job batches, whose steps report progress
            while not stop.is_set():
                try:
                    requests.post(f"{url}/v1/videos", json=job, timeout=5)
                except requests.RequestException:
                    pass
                time.sleep(1.0)

        def sync_latencies(n: int, until: float | None = None) -> list[float]:
            got = []
            while len(got) < n and (until is None or time.time() < until):
                t0 = time.perf_counter()
                try:
                    r = requests.post(f"{url}/v1/videos/sync", json=body, timeout=60)
                    ok = r.status_code == 200
                except requests.RequestException:
                    ok = False
                got.append(round(time.perf_counter() - t0, 3) if ok else -1.0)
            return got

        sync_latencies(2)  # warm-up
        feeder = threading.Thread(target=keep_jobs_running, daemon=True)
        feeder.start()
        time.sleep(3)
        out["sync_s_store_up"] = sync_latencies(a.samples)
        os.kill(proc.pid, signal.SIGSTOP)
        t_pause = time.time()
        out["sync_s_store_paused"] = sync_latencies(a.samples, until=t_pause + a.pause_s)
        t0 = time.perf_counter()
        try:
            r = requests.get(f"{url}/v1/videos", timeout=60)
            out["list_while_paused"] = {"status": r.status_code, "seconds": round(time.perf_counter() - t0, 3),
                                        "retry_after": r.headers.get("retry-after")}
        except requests.RequestException as e:
            out["list_while_paused"] = {"error": type(e).__name__, "seconds": round(time.perf_counter() - t0, 3)}
        left = t_pause + a.pause_s - time.time()
        if left > 0:
            time.sleep(left)
        os.kill(proc.pid, signal.SIGCONT)
        out["pause_s"] = a.pause_s
        stop.set()
        out["sync_s_after"] = sync_latencies(2)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        serve.shutdown()
        ray.shutdown()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    out["load_avg"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
