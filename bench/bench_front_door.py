"""The front door against the number of requests in flight, at a fixed replica count: what the
router overhead of ``make bench-scale`` is made of and what bounds it on this machine.

The cluster and app are ``bench/bench_scale.py``'s (head + ``--nodes`` x ``--gpus`` emulated
GPUs, Flux.2 256x256 at ``--time-scale``, 4 GPUs per replica), with the group held at
``--replicas`` (autoscaling min = max, so the SLO policy and the replicas' summaries run as in
the bench). Closed-loop clients are added level by level (``--levels``, ascending; 0 measures
the cluster's CPU with nothing in flight); at each level, after ``--warm-seconds``, for
``--seconds``: answered requests, requests/s, the router overhead (the server's response time -
queued - the batch) and its parts (``scale_report.overhead_parts``: proxy, router, call,
dispatch), and the CPU each kind of process used.

``--serve-env KEY=VALUE`` (repeatable) sets an environment variable on every node (Ray Serve's
and Ray's settings, for A/B runs), over ``bench_scale.FRONT_DOOR_ENV``.

Example (about 6 minutes on 2 cores):
    PYTHONPATH=. python bench/bench_front_door.py --port 18610 --out /tmp/front.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # bench.report; bench_scale beside this file

from bench_scale import FAST_HEALTH, FRONT_DOOR_ENV, Bench, app_args, cpu_by_role
from bench.report.scale_report import CurveLevel, FrontCurve, overhead, overhead_parts, percentile


async def curve(b: Bench, cluster, levels: list[int], warm_s: float, seconds: float,  # type: ignore[no-untyped-def]
                replicas: int) -> list[CurveLevel]:
    import aiohttp

    out: list[CurveLevel] = []
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(b.watch(stop))
    clients: list[asyncio.Future] = []
    done = asyncio.Event()

    async def client(phase_of: list[str]) -> None:
        while not done.is_set():
            await b.one(session, phase_of[0])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        if not await b.wait_replicas(lambda n: n >= replicas, 600):
            raise RuntimeError(f"{replicas} replicas did not all run within 600 s")
        phase = ["warm"]
        for n in levels:
            phase[0] = f"in{n}"
            clients += [asyncio.ensure_future(client(phase)) for _ in range(n - len(clients))]
            print(f"[{b.now():.0f}s] {n} in flight", flush=True)
            await asyncio.sleep(warm_s)
            t0 = b.now()
            before = await asyncio.to_thread(cpu_by_role, cluster, os.getpid())
            await asyncio.sleep(seconds)
            after = await asyncio.to_thread(cpu_by_role, cluster, os.getpid())
            t1 = b.now()
            # answered within the window (sent during the warm-up or the window: in steady state)
            got = [s for s in b.samples if s.phase == phase[0] and s.status == 200 and t0 <= s.sent + s.seconds <= t1
                   and None not in (s.server_s, s.group_s, s.queued_s, s.batch_s)]
            used = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(after)}
            parts = overhead_parts(got, b.work)
            over = [overhead(s) for s in got]
            level = CurveLevel(
                in_flight=n, requests=len(got), rps=round(len(got) / (t1 - t0), 3),
                router_overhead_p50_s=round(percentile(over, 0.5), 4),
                router_overhead_p99_s=round(percentile(over, 0.99), 4),
                parts_p50_s={k: round(percentile(v, 0.5), 4) for k, v in parts.items()},
                parts_p99_s={k: round(percentile(v, 0.99), 4) for k, v in parts.items()},
                cpu_cores_by_role={k: round(v / (t1 - t0), 3) for k, v in used.items() if v > 0.01},
                cpu_s_per_request={k: round(v / len(got), 4) for k, v in used.items() if v > 0.01} if got else {},
                load_avg_1m=round(os.getloadavg()[0], 2))
            out.append(level)
            print(f"[{b.now():.0f}s] {n} in flight: {level.requests} answered, overhead p50 "
                  f"{level.router_overhead_p50_s} p99 {level.router_overhead_p99_s} s, parts p50 {level.parts_p50_s}, "
                  f"cores {sum(level.cpu_cores_by_role.values()):.2f}, load {level.load_avg_1m}", flush=True)
        done.set()
        await asyncio.gather(*clients)
    stop.set()
    await watcher
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "front_curve.json")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=None, help="default: nodes x gpus / 4")
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--port", type=int, default=8261)
    ap.add_argument("--levels", default="0,16,64,128")
    ap.add_argument("--warm-seconds", type=float, default=15.0)
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--max-queue", type=int, default=24)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    extra = {**FRONT_DOOR_ENV, **dict(kv.split("=", 1) for kv in args.serve_env)}

    import ray
    from bench.scenarios.local_cluster import LocalCluster
    from ray import serve

    from deployments.app import build_app
    from xema_ray.serving.api.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    b = Bench(args)
    replicas = args.replicas or b.max_replicas
    cluster = LocalCluster(env={PROXY_CALLBACK_ENV: PROXY_CALLBACK, **FAST_HEALTH, **extra}, auth_mode="disabled")
    os.environ.update({**FAST_HEALTH, **extra})
    try:
        cluster.start_head(num_cpus=4, num_gpus=0, dashboard=False, resources={"xema_head": 100})
        cluster.connect(log_to_driver=False)
        cluster.add_nodes(args.nodes, num_cpus=2, num_gpus=args.gpus, timeout_s=300, wave=1)
        print(f"[{b.now():.0f}s] cluster: head + {args.nodes} x {args.gpus} emulated GPUs", flush=True)
        serve.start(http_options={"host": "127.0.0.1", "port": args.port}, proxy_location="HeadOnly")
        config = app_args(args, Path(tempfile.mkdtemp(prefix="xema-front-jobs-")))
        g = config["models"][0]
        g["replicas"] = replicas
        g["autoscaling"].update(min_replicas=replicas, max_replicas=replicas)
        serve.run(build_app(config), name="xema", route_prefix="/")
        levels = asyncio.run(curve(b, cluster, [int(x) for x in args.levels.split(",")], args.warm_seconds,
                                   args.seconds, replicas))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    result = FrontCurve(machine=f"{platform.node()} ({os.cpu_count()} CPUs)", time_scale=args.time_scale,
                        gpus=4 * replicas, replicas=replicas, serve_env=extra, levels=levels,
                        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), wall_s=round(b.now(), 1),
                        load_avg=os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result.model_dump_json(indent=2) + "\n")
    print(result.model_dump_json(indent=2))


if __name__ == "__main__":
    main()
