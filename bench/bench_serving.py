"""Router + dispatch overhead (issue #7): latency added by the Serve app over calling the engine
directly, at a steady Poisson rate with a tiny model.

Runs the real application in-process on CPU (one tiny-flux2 worker, plan pinned to SP 1, batch 1),
sends open-loop Poisson requests over HTTP, and compares with ``ExecutionEngine.execute`` called
directly on the same template in this process. Added latency = HTTP latency − direct latency
(percentiles of each), plus the per-request time outside the batch the server reports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests
import torch
from xema_ray.serving.ray_env import apply_ray_env
from xema_ray.net import free_port
from xema_ray.serving.api.ready import wait_ready



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/serving.json"))
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second")
    ap.add_argument("--requests", type=int, default=120)
    args = ap.parse_args()

    import ray
    from ray import serve

    from deployments.app import build_app
    from xema_ray.models import BuildOptions
    from bench.scenarios.factories import plan_entry, plan_table
    from xema_ray.plan import ExecutionConfig
    from xema_ray.runtime.engine import Batch, ExecutionEngine, GenerationRequest
    from xema_ray.serving.config import ServeConfig
    from deployments.planning import machine_fingerprint
    from xema_ray.templates import RequestTemplate

    t = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=4)
    cfg = ExecutionConfig(template=t)

    # direct: the engine in this process, same template, same number of requests
    spec = t.spec
    engine = ExecutionEngine(spec.build_pipeline(BuildOptions(device="cpu", dtype=torch.float32)), spec,
                             torch.device("cpu"), torch.float32)
    batch = lambda i: Batch(config=cfg, requests=(GenerationRequest(request_id=f"d{i}", prompt="fox", seed=i),), steps=cfg.template.steps)  # noqa: E731
    engine.execute(batch(10_000))  # warm-up
    direct = []
    for i in range(args.requests):
        t0 = time.perf_counter()
        engine.execute(batch(i))
        direct.append(time.perf_counter() - t0)

    serve_args = {"device": "cpu", "worker_cpus": 0.5,
                  "models": [{"model": "tiny-flux2", "workers": 1, "wait_window_s": 0.0, "max_queue": 1000,
                              "templates": [{"width": 64, "height": 64, "steps": 4}]}]}
    table = plan_table([plan_entry(cfg, peak_bytes=0, latency_s=float(np.median(direct)), goodput_rps=0, slo_s=60)],
                       hardware=machine_fingerprint(ServeConfig.model_validate(serve_args), 1))
    path = Path(tempfile.mkdtemp()) / "plans.json"
    table.save(str(path))
    serve_args["plan_table"] = str(path)
    port = free_port()
    apply_ray_env()  # local-only ports, JSON errors from the proxy: as `make serve`
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(serve_args), name="xema", route_prefix="/")
    wait_ready(f"http://127.0.0.1:{port}", timeout_s=300)  # /healthz 200: every group answers
    url = f"http://127.0.0.1:{port}/v1/images/generations"
    body = {"model": "tiny-flux2", "prompt": "fox", "size": "64x64"}
    for _ in range(5):
        requests.post(url, json={**body, "seed": 0}, timeout=60).raise_for_status()  # warm-up

    rng = random.Random(0)
    e2e: list[float] = []
    outside: list[float] = []
    lock = threading.Lock()

    def fire(i: int) -> None:
        t0 = time.perf_counter()
        r = requests.post(url, json={**body, "seed": i}, timeout=120)
        r.raise_for_status()
        dt = time.perf_counter() - t0
        with lock:
            e2e.append(dt)
            outside.append(dt - float(r.headers["X-Xema-Batch-Seconds"]))

    threads, start, at = [], time.perf_counter(), 0.0
    for i in range(args.requests):
        at += rng.expovariate(args.rate)
        time.sleep(max(0.0, start + at - time.perf_counter()))
        th = threading.Thread(target=fire, args=(i,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    serve.shutdown()
    ray.shutdown()

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) * 1000

    rows = {
        "direct_ms": {"p50": pct(direct, 50), "p99": pct(direct, 99)},
        "http_ms": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)},
        "added_ms": {"p50": pct(e2e, 50) - pct(direct, 50), "p99": pct(e2e, 99) - pct(direct, 99)},
        "outside_batch_ms": {"p50": pct(outside, 50), "p99": pct(outside, 99)},
    }
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rate": args.rate, "requests": args.requests, **rows}, indent=1))
    print(f"machine: {machine}; {args.requests} requests, Poisson {args.rate}/s, tiny-flux2 64x64, 4 steps\n")
    print("| path | p50 ms | p99 ms |")
    print("|---|---|---|")
    print(f"| engine called directly | {rows['direct_ms']['p50']:.1f} | {rows['direct_ms']['p99']:.1f} |")
    print(f"| HTTP → Router → ModelGroup → worker | {rows['http_ms']['p50']:.1f} | {rows['http_ms']['p99']:.1f} |")
    print(f"| added by serving (difference of percentiles) | {rows['added_ms']['p50']:.1f} | {rows['added_ms']['p99']:.1f} |")
    print(f"| time outside the batch, per request | {rows['outside_batch_ms']['p50']:.1f} | {rows['outside_batch_ms']['p99']:.1f} |")


if __name__ == "__main__":
    main()
