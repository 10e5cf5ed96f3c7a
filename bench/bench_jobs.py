"""Video job API overhead (issue #17): create + polls + download against the synchronous MP4 path,
at the same steady Poisson rate, on the same app.

Runs the Serve app in-process on CPU (tiny-cogvideox 64x64x9, one worker, batch 1, SQLite job
store), sends the same open-loop Poisson arrival schedule three times: to ``POST /v1/videos/sync`` (one
HTTP call that returns the MP4), through the job API re-reading the server's
``openai-poll-after-ms`` hint after every poll, and with the official ``openai`` client's
``create_and_poll`` + ``download_content`` (which keeps the first hint for all its polls).
Overhead per request = job end-to-end − sync end-to-end (percentiles of each); also the number of
polls, the client-side time in API calls and the time to the first progress.

Optionally (``--loadtest-seconds``) runs ``loadtests/locustfile.py`` against the same app for that
long, to report time-to-first-progress and end-to-end latency per template from the load test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests

from xema_ray.net import free_port
from xema_ray.serving.api.ready import wait_ready

ROOT = Path(__file__).resolve().parent.parent


def _schedule(rate: float, n: int, seed: int) -> list[float]:
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        out.append(at)
    return out


def _run(schedule: list[float], fire) -> list[dict]:  # type: ignore[no-untyped-def]
    rows: list[dict] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        row = fire(i)
        with lock:
            rows.append(row)

    threads, start = [], time.perf_counter()
    for i, at in enumerate(schedule):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        th = threading.Thread(target=one, args=(i,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/jobs.json"))
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--requests", type=int, default=60, help="per path")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--loadtest-seconds", type=float, default=0.0)
    args = ap.parse_args()

    import ray
    from ray import serve

    from deployments.app import build_app
    from bench.scenarios.factories import plan_entry, plan_table
    from xema_ray.serving.config import ServeConfig
    from deployments.planning import machine_fingerprint
    from xema_ray.templates import RequestTemplate

    t = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=args.steps)
    tmp = Path(tempfile.mkdtemp())
    serve_args = {"device": "cpu", "worker_cpus": 0.5, "jobs": {"path": str(tmp / "jobs")},
                  "models": [{"model": t.model, "workers": 1, "wait_window_s": 0.0, "max_queue": 1000,
                              "templates": [{"width": 64, "height": 64, "frames": 9, "steps": args.steps}]}]}
    table = plan_table([plan_entry(t, peak_bytes=0, latency_s=3.0, goodput_rps=0, slo_s=120)],
                       hardware=machine_fingerprint(ServeConfig.model_validate(serve_args), 1))
    table.save(str(tmp / "plans.json"))
    serve_args["plan_table"] = str(tmp / "plans.json")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(serve_args), name="xema", route_prefix="/")
    wait_ready(url, timeout_s=300)  # /healthz 200: every group answers
    body = {"model": t.model, "prompt": "bench", "size": "64x64", "num_frames": 9}
    for i in range(3):  # warm-up: both paths, and the group's measured phase estimate
        requests.post(f"{url}/v1/videos/sync", json={**body, "seed": i}, timeout=120).raise_for_status()

    def sync(i: int) -> dict:
        t0 = time.perf_counter()
        r = requests.post(f"{url}/v1/videos/sync", json={**body, "seed": i}, timeout=600)
        r.raise_for_status()
        return {"e2e": time.perf_counter() - t0, "batch": float(r.headers["X-Xema-Batch-Seconds"])}

    def job(i: int) -> dict:
        t0 = time.perf_counter()
        api = 0.0
        c = time.perf_counter()
        r = requests.post(f"{url}/v1/videos", json={**body, "seed": i}, timeout=600)
        r.raise_for_status()
        create_s = time.perf_counter() - c
        api += create_s
        video, hint = r.json(), int(r.headers["openai-poll-after-ms"])
        polls, poll_s, first = 0, [], None
        while video["status"] in ("queued", "in_progress"):
            time.sleep(hint / 1000)
            c = time.perf_counter()
            g = requests.get(f"{url}/v1/videos/{video['id']}", timeout=600)
            g.raise_for_status()
            poll_s.append(time.perf_counter() - c)
            polls += 1
            video = g.json()
            hint = int(g.headers.get("openai-poll-after-ms", hint))
            if first is None and video["progress"] > 0:
                first = time.perf_counter() - t0
        if video["status"] != "completed":
            raise RuntimeError(f"job {video['id']} ended {video['status']}: {video.get('error')}")
        c = time.perf_counter()
        d = requests.get(f"{url}/v1/videos/{video['id']}/content", timeout=600)
        d.raise_for_status()
        download_s = time.perf_counter() - c
        api += sum(poll_s) + download_s
        return {"e2e": time.perf_counter() - t0, "polls": polls, "api": api, "create": create_s,
                "poll": float(np.median(poll_s)) if poll_s else 0.0, "download": download_s, "first": first}

    import warnings

    import openai

    warnings.filterwarnings("ignore", category=DeprecationWarning)  # openai marks the video API deprecated
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")

    def sdk(i: int) -> dict:
        t0 = time.perf_counter()
        video = client.videos.create_and_poll(model=t.model, prompt="bench", size="64x64", seconds="1", extra_body={"seed": i})
        if video.status != "completed":
            raise RuntimeError(f"job {video.id} ended {video.status}: {video.error}")
        client.videos.download_content(video.id).read()
        return {"e2e": time.perf_counter() - t0}

    schedule = _schedule(args.rate, args.requests, seed=0)
    sync_rows = _run(schedule, sync)
    job_rows = _run(schedule, job)
    sdk_rows = _run(schedule, sdk)

    loadtest = None
    if args.loadtest_seconds > 0:
        out_dir = tmp / "loadtest"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XEMA_RATE": str(args.rate), "XEMA_DURATION": str(args.loadtest_seconds),
               "XEMA_OUT": str(out_dir)}
        subprocess.run([str(Path(sys.executable).parent / "locust"), "-f", str(ROOT / "loadtests" / "locustfile.py"),
                        "--headless", "-u", "1", "-r", "1", "--host", url, "--only-summary"],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        loadtest = json.loads((out_dir / "summary.json").read_text())
    serve.shutdown()
    ray.shutdown()

    def pct(rows: list[dict], key: str, q: float) -> float:
        xs = [r[key] for r in rows if r.get(key) is not None]
        return float(np.percentile(xs, q)) * 1000 if xs else float("nan")

    res = {
        "sync_ms": {"p50": pct(sync_rows, "e2e", 50), "p99": pct(sync_rows, "e2e", 99)},
        "sync_batch_ms": {"p50": pct(sync_rows, "batch", 50)},
        "job_ms": {"p50": pct(job_rows, "e2e", 50), "p99": pct(job_rows, "e2e", 99)},
        "openai_client_ms": {"p50": pct(sdk_rows, "e2e", 50), "p99": pct(sdk_rows, "e2e", 99)},
        "overhead_ms": {"p50": pct(job_rows, "e2e", 50) - pct(sync_rows, "e2e", 50),
                        "p99": pct(job_rows, "e2e", 99) - pct(sync_rows, "e2e", 99)},
        "polls_per_request": float(np.mean([r["polls"] for r in job_rows])),
        "api_calls_ms": {"p50": pct(job_rows, "api", 50)},
        "create_ms": {"p50": pct(job_rows, "create", 50)},
        "poll_ms": {"p50": pct(job_rows, "poll", 50)},
        "download_ms": {"p50": pct(job_rows, "download", 50)},
        "first_progress_ms": {"p50": pct(job_rows, "first", 50), "p90": pct(job_rows, "first", 90)},
    }
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rate": args.rate, "requests": args.requests,
                                    "template": t.key, **res, "loadtest": loadtest}, indent=1))
    print(f"machine: {machine}; {args.requests} requests per path, Poisson {args.rate}/s, {t.key}\n")
    print("| path | p50 ms | p99 ms |")
    print("|---|---|---|")
    print(f"| POST /v1/videos/sync (one call, MP4 in the answer) | {res['sync_ms']['p50']:.0f} | {res['sync_ms']['p99']:.0f} |")
    print(f"| job API: create + polls at the hint + download | {res['job_ms']['p50']:.0f} | {res['job_ms']['p99']:.0f} |")
    print(f"| overhead of the job API (difference of percentiles) | {res['overhead_ms']['p50']:.0f} | {res['overhead_ms']['p99']:.0f} |")
    print(f"| openai client: create_and_poll + download_content | {res['openai_client_ms']['p50']:.0f} | "
          f"{res['openai_client_ms']['p99']:.0f} |")
    print(f"\npolls/request {res['polls_per_request']:.1f}; client time in API calls p50 {res['api_calls_ms']['p50']:.0f} ms "
          f"(create {res['create_ms']['p50']:.1f}, poll {res['poll_ms']['p50']:.1f}, download {res['download_ms']['p50']:.1f}); "
          f"time to first progress p50 {res['first_progress_ms']['p50']:.0f} ms, p90 {res['first_progress_ms']['p90']:.0f} ms")
    if loadtest:
        for name, v in loadtest["per_template"].items():
            print(f"loadtest {name}: sent {v['sent']}, ok {v['ok']}, e2e p50 {v['p50_s']:.2f} s, p90 {v['p90_s']:.2f} s, "
                  f"first progress p50 {v['first_progress_p50_s']:.2f} s, polls/request {v['polls_per_request']:.1f}")


if __name__ == "__main__":
    main()
