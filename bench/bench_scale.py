"""Scale-out on a local multi-node Ray cluster of emulated GPUs: the front door at >= 32 GPUs and
>= 100 requests in flight, SLO-driven autoscaling through a load step up and down, and a node
removed under load. Writes ``bench/results/scale.json`` and a plot of replicas and attainment.

The cluster: a head (the HTTP proxy, the Router, Serve's controller; no GPUs) and ``--nodes``
worker nodes of ``--gpus`` emulated GPUs each, separate raylets on loopback
(``bench/scenarios/local_cluster.py``). The app: the real one (``deployments/app.py``) with
``device: emulated`` on ``plans/a6000x8.json`` at ``--time-scale``, one model group (Flux.2,
4 GPUs per replica, SP 2 x DP 2, as planned) whose replicas the SLO-driven autoscaler adds
and removes (min 1, max nodes x gpus / 4), each replica a placement group of its own 4 GPUs.

Phases (open-loop Poisson arrivals unless said):
  baseline  ``--base-rate`` req/s, one replica;
  step      ``--step-rate`` req/s until the running replicas have matched the autoscaler's
            target (Serve's replicas starting or running) for ``--settle-seconds`` (at most
            ``--step-seconds``): replicas rise; attainment is measured again once they all run;
  front     ``--in-flight`` closed-loop clients once every replica up to max runs (>= 32 GPUs):
            router overhead = the server's response time (``X-Xema-Proxy-Seconds``, stamped by
            the HTTP proxy: the bench's client is not in it) - time queued in the group - the
            batch's time on the workers, i.e. the HTTP proxy, Router, routing, handle and the
            group's dispatch loop and hand-back; the workers' own overhead beyond the emulated
            work and the client's side are reported next to it, not in it;
  node      one worker node killed during the closed loop: what it held completes elsewhere or
            fails with a JSON 503 (Retry-After); a request with any other end is lost;
  down      ``--base-rate`` again: replicas drain back towards one.

Example (<= 10 minutes on 2 cores):
    PYTHONPATH=. python bench/bench_scale.py --out bench/results/scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.report, bench.scenarios: run as a script from anywhere

from bench.report.scale_report import (
    TEMPLATE,
    Autoscale,
    FrontDoor,
    NodeLoss,
    Sample,
    Saturation,
    SaturationLevel,
    ScaleResult,
    overhead,
    overhead_parts,
    percentile,
    plot,
)

BODY = {"model": "flux2", "prompt": "a lighthouse at dusk", "size": "256x256", "response_format": "b64_json"}
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
               "RAY_health_check_timeout_ms": "1000"}
#: The front door's share of these 2 shared cores (docs/scale-out.md "The front door's CPU"): Ray
#: starts its workers — the HTTP proxy, the Router, the replicas — at nice 15, below the raylets, the
#: GCS, the log monitor, this bench's client and every other program here, so they ran only in what
#: those left; Serve exports every replica's and the proxy's metrics every 100 ms and runs its
#: controller's loop every 100 ms (the SLO policy included), for a cluster of 40-odd processes on 2 cores
FRONT_DOOR_ENV = {"RAY_worker_niceness": "0", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                  "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25"}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.time()
        self.samples: list[Sample] = []
        self.timeline: list[tuple[float, int]] = []
        self.targets: list[tuple[float, int]] = []
        self.url = f"http://127.0.0.1:{args.port}"
        from xema_ray.plan import PlanTable

        table = PlanTable.load(str(ROOT / "plans" / "a6000x8.json"))
        p = table.entries[TEMPLATE].prediction
        # what the emulated workers take for a batch of n (plan seconds / time_scale), and the SLO
        self.work = {n: s / args.time_scale for n, s in p.latency_by_batch.items()}
        self.work[table.entries[TEMPLATE].config.batch] = p.latency_s / args.time_scale
        self.slo = p.slo_s / args.time_scale
        self.max_replicas = args.nodes * args.gpus // 4

    def now(self) -> float:
        return time.time() - self.t0

    # ------------------------------------------------------------------ requests
    async def one(self, session, phase: str) -> Sample:  # type: ignore[no-untyped-def]
        import aiohttp

        sent = self.now()
        t = time.perf_counter()
        try:
            async with session.post(f"{self.url}/v1/images/generations", json=BODY,
                                    timeout=aiohttp.ClientTimeout(total=self.args.request_timeout)) as r:
                body = await r.read()
                s = Sample(phase=phase, sent=sent, seconds=time.perf_counter() - t, status=r.status)
                if r.status == 200:
                    h = r.headers
                    s.queued_s = float(h.get("X-Xema-Queue-Seconds", "nan"))
                    s.batch_s = float(h.get("X-Xema-Batch-Seconds", "nan"))
                    s.group_s = float(h.get("X-Xema-Group-Seconds", "nan"))
                    s.server_s = float(h.get("X-Xema-Proxy-Seconds", "nan"))
                    s.router_s = float(h.get("X-Xema-Router-Seconds", "nan"))
                    s.call_s = float(h.get("X-Xema-Call-Seconds", "nan"))
                    s.batch_size = int(h.get("X-Xema-Batch-Size", "0"))
                    s.replica = h.get("X-Xema-Replica")
                    s.met = s.seconds <= self.slo
                elif r.status == 503:
                    try:
                        s.json_503 = "error" in json.loads(body) and int(r.headers.get("Retry-After", "0")) >= 1
                    except ValueError:
                        s.json_503 = False
        except Exception:  # no answer within the timeout, or the connection broke: lost
            s = Sample(phase=phase, sent=sent, seconds=time.perf_counter() - t, status=0)
        self.samples.append(s)
        return s

    async def open_loop(self, session, phase: str, rate: float, seconds: float = 0.0,  # type: ignore[no-untyped-def]
                        until=None) -> None:  # type: ignore[no-untyped-def]
        rng = random.Random(sum(map(ord, phase)))
        tasks = []
        end = time.time() + seconds
        while (time.time() < end) if until is None else not until():
            tasks.append(asyncio.ensure_future(self.one(session, phase)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)

    async def closed_loop(self, session, phase: str, clients: int, until: asyncio.Event) -> None:  # type: ignore[no-untyped-def]
        async def client() -> None:
            while not until.is_set():
                await self.one(session, phase)
        await asyncio.gather(*(client() for _ in range(clients)))

    # ------------------------------------------------------------------ replicas
    def replicas(self) -> tuple[int, int]:
        """(running, target): the group's running replicas, and those Serve is starting or running."""
        from ray import serve

        try:
            states = serve.status().applications["xema"].deployments["ModelGroup:flux2"].replica_states
        except Exception:
            return -1, -1
        running = sum(n for state, n in states.items() if state == "RUNNING")
        return running, sum(n for state, n in states.items() if state not in ("STOPPING", "STOPPED"))

    async def watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            n, target = await asyncio.to_thread(self.replicas)
            if n >= 0:
                self.timeline.append((round(self.now(), 2), n))
                self.targets.append((round(self.now(), 2), target))
            await asyncio.sleep(1.0)

    async def wait_replicas(self, pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.timeline and pred(self.timeline[-1][1]):
                return True
            await asyncio.sleep(0.5)
        return False


def app_args(args: argparse.Namespace, jobs_dir: Path) -> dict:
    return {
        "device": "emulated", "time_scale": args.time_scale, "hardware": "a6000",
        "plan_table": str(ROOT / "plans" / "a6000x8.json"), "budget": "48GB", "emulated_host_memory": "1TB",
        "worker_cpus": 0.125, "router_resources": {"xema_head": 1},
        "jobs": {"backend": "sqlite", "path": str(jobs_dir)},
        "limits": {"max_in_flight": 1024},
        "models": [{"model": "flux2", "workers": 4, "templates": [{"width": 256, "height": 256, "steps": 50}],
                    "replicas": 1, "wait_window_s": 0.02, "max_queue": args.max_queue,
                    "autoscaling": {"min_replicas": 1, "max_replicas": args.nodes * args.gpus // 4,
                                    "target_attainment": 0.9, "window_s": 20.0, "scale_down_margin": 0.05,
                                    "upscale_delay_s": 2.0, "downscale_delay_s": 8.0, "metrics_interval_s": 0.5}}],
    }


async def drive(b: Bench, cluster) -> tuple[FrontDoor, Autoscale, NodeLoss | None]:  # type: ignore[no-untyped-def]
    import aiohttp

    a = b.args
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(b.watch(stop))
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await b.wait_replicas(lambda n: n >= 1, 120)
        start = b.timeline[-1][1]
        print(f"[{b.now():.0f}s] baseline {a.base_rate} req/s", flush=True)
        await b.open_loop(session, "baseline", a.base_rate, a.base_seconds)
        step_at = b.now()
        print(f"[{b.now():.0f}s] step {a.step_rate} req/s", flush=True)
        # the step lasts until the running replicas have matched the autoscaler's target (above the
        # start) for --settle-seconds, at most --step-seconds
        step_end = time.time() + a.step_seconds
        ended = ["max"]

        def step_over() -> bool:
            if _settled_since(b.timeline, b.targets, step_at, start, a.settle_seconds) is not None:
                ended[0] = "settled"
                return True
            return time.time() > step_end
        await b.open_loop(session, "step", a.step_rate, until=step_over)
        step_stop = max(s.sent for s in b.samples if s.phase == "step")
        scaled_at = _settled_since(b.timeline, b.targets, step_at, start, 0.0)
        front_at = b.now()
        print(f"[{b.now():.0f}s] step over ({ended[0]}): {b.timeline[-1][1]} replicas running since "
              f"{scaled_at}", flush=True)
        print(f"[{b.now():.0f}s] front door: {a.in_flight} clients", flush=True)
        done = asyncio.Event()
        loop = asyncio.ensure_future(b.closed_loop(session, "front", a.in_flight, done))
        full = await b.wait_replicas(lambda n: n >= b.max_replicas, a.scale_timeout)
        measure_from = b.now()
        cpu_before = await asyncio.to_thread(cpu_by_role, cluster, os.getpid())
        await asyncio.sleep(a.front_seconds)
        cpu_after = await asyncio.to_thread(cpu_by_role, cluster, os.getpid())
        measure_to = b.now()
        load_window = os.getloadavg()[0]  # the 1-minute load at the window's end (not the run's)
        cores = {k: round((cpu_after.get(k, 0.0) - cpu_before.get(k, 0.0)) / (measure_to - measure_from), 3)
                 for k in sorted(cpu_after) if cpu_after.get(k, 0.0) - cpu_before.get(k, 0.0) > 0.01}
        loss = None
        if a.kill_node:
            node = cluster.workers[-1]
            before = b.timeline[-1][1]
            killed_at = b.now()
            print(f"[{killed_at:.0f}s] killing a worker node", flush=True)
            await asyncio.to_thread(cluster.kill_node, node)
            await asyncio.sleep(a.after_kill_seconds)
            loss_replicas = before - min(n for t, n in b.timeline if t >= killed_at) if b.timeline else 0
        done.set()
        await loop
        if a.kill_node:
            hit = [s for s in b.samples if s.phase == "front" and s.sent <= killed_at <= s.sent + s.seconds]
            loss = NodeLoss(killed_at_s=round(killed_at, 2), replicas_on_node=max(0, loss_replicas),
                            in_flight_at_kill=len(hit), completed=sum(s.status == 200 for s in hit),
                            json_503=sum(s.status == 503 and s.json_503 for s in hit),
                            lost=sum(s.status not in (200, 503) or (s.status == 503 and not s.json_503) for s in hit))
        print(f"[{b.now():.0f}s] down {a.base_rate} req/s", flush=True)
        down_from = b.now()
        down = asyncio.ensure_future(b.open_loop(session, "down", a.base_rate, a.down_seconds))
        await b.wait_replicas(lambda n: n <= 1, a.down_seconds)
        await down
        await asyncio.sleep(2)
    stop.set()
    await watcher
    peak = max(n for _, n in b.timeline)
    peak_at = next((t for t, n in b.timeline if n == peak and t >= step_at), None)
    second_at = next((t for t, n in b.timeline if n >= 2 and t >= step_at), float("inf"))
    step_peak = max((n for t, n in b.timeline if step_at <= t <= front_at), default=start)

    def att(xs: list[Sample]) -> float:
        ok = [s for s in xs if s.status != 0]
        return round(sum(s.met for s in ok) / len(ok), 4) if ok else float("nan")

    step = [s for s in b.samples if s.phase == "step"]
    front = [s for s in b.samples if s.phase == "front" and measure_from <= s.sent and s.sent + s.seconds <= measure_to]
    ok = [s for s in front if s.status == 200]
    ok = [s for s in ok if None not in (s.server_s, s.group_s, s.queued_s, s.batch_s)]
    over = [overhead(s) for s in ok]
    parts = overhead_parts(ok, b.work)
    gpus = 4 * min((n for t, n in b.timeline if measure_from <= t <= measure_to), default=0)
    fd = FrontDoor(gpus=gpus if full else gpus, in_flight_max=a.in_flight, requests=len(front),
                   router_overhead_p50_s=round(percentile(over, 0.5), 4),
                   router_overhead_p99_s=round(percentile(over, 0.99), 4),
                   lost=sum(s.status == 0 for s in front), queued_p50_s=round(percentile([s.queued_s or 0.0 for s in front
                                                                                        if s.status == 200], 0.5), 4),
                   replicas_used=len({s.replica for s in front if s.replica}), load_avg_1m=round(load_window, 2),
                   parts_p50_s={k: round(percentile(v, 0.5), 4) for k, v in parts.items()},
                   parts_p99_s={k: round(percentile(v, 0.99), 4) for k, v in parts.items()},
                   client_response_p50_s=round(percentile([s.seconds for s in ok], 0.5), 4), cpu_cores_by_role=cores)
    after = [s for s in step if scaled_at is not None and s.sent >= scaled_at + a.recovery_grace]
    ascale = Autoscale(
        replicas_start=start, replicas_peak=peak, replicas_end=b.timeline[-1][1],
        attainment_before_step=att([s for s in b.samples if s.phase == "baseline"]),
        attainment_step_before_scale=att([s for s in step if s.sent < second_at]),
        attainment_after_scale=att(after) if after else None, after_scale_requests=len(after),
        after_scale_response_p50_s=round(percentile([s.seconds for s in after if s.status == 200], 0.5), 3)
        if any(s.status == 200 for s in after) else None,
        after_scale_503=sum(s.status == 503 for s in after),
        scaled_at_s=scaled_at, step_s=round(step_stop - step_at, 2), step_end=ended[0],
        replicas_step_peak=step_peak,
        lost=sum(s.status == 0 for s in b.samples if s.phase in ("baseline", "step", "down")),
        seconds_to_peak=None if peak_at is None else round(peak_at - step_at, 2),
        timeline=b.timeline, targets=b.targets)
    del down_from
    return fd, ascale, loss


def _settled_since(timeline: list[tuple[float, int]], targets: list[tuple[float, int]], since: float, start: int,
                   hold_s: float) -> float | None:
    """When the running replicas last came to match the target (risen above ``start`` since
    ``since``), provided they have matched it, unchanged, for ``hold_s``; else None."""
    pairs = [(t, n, m) for (t, n), (_, m) in zip(timeline, targets, strict=True) if t >= since]
    if not pairs:
        return None
    t_last, n_last, m_last = pairs[-1]
    if n_last != m_last or n_last <= start:
        return None
    changed = max((t for t, n, m in pairs if (n, m) != (n_last, m_last)), default=since)
    at = next(t for t, n, m in pairs if t > changed)
    return at if t_last - at >= hold_s else None


def role(cmdline: list[str]) -> str:
    """A process of the cluster by what it does (Ray names its workers ``ray::<actor>``)."""
    head = cmdline[0] if cmdline else "?"
    if head.startswith("ray::"):
        name = head[5:]
        for part in ("ProxyActor", "Router", "ModelGroup", "ServeController", "Stats"):
            if part in name:
                return part
        return "EmulatedWorker" if "EmulatedWorker" in name or "Worker" in name else "ray-other"
    text = " ".join(cmdline)
    for part in ("gcs_server", "raylet", "dashboard", "runtime_env", "log_monitor", "monitor.py"):
        if part in text:
            return part.replace(".py", "")
    return "other"


def cpu_by_role(cluster, me: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    import psutil

    out: dict[str, float] = {}
    procs = [p for n in [cluster.head, *cluster.workers] if n is not None for p in n.tree()]
    try:
        procs.append(psutil.Process(me))
    except psutil.Error:
        pass
    for p in procs:
        try:
            t = p.cpu_times()
            r = "client" if p.pid == me else role(p.cmdline())
            out[r] = out.get(r, 0.0) + t.user + t.system
        except psutil.Error:
            continue
    return out


async def saturate(b: Bench, cluster, levels: list[int], seconds: float) -> list[SaturationLevel]:  # type: ignore[no-untyped-def]
    import aiohttp

    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await b.one(session, "warm")
        for clients in levels:
            phase = f"sat{clients}"
            before = cpu_by_role(cluster, os.getpid())
            done = asyncio.Event()
            loop = asyncio.ensure_future(b.closed_loop(session, phase, clients, done))
            t0 = b.now()
            await asyncio.sleep(seconds)
            done.set()
            await loop
            t1 = b.now()
            after = cpu_by_role(cluster, os.getpid())
            got = [s for s in b.samples if s.phase == phase and s.status == 200 and s.sent + s.seconds <= t1]
            n = max(1, len(got))
            out.append(SaturationLevel(
                clients=clients, requests=len(got), rps=round(len(got) / (t1 - t0), 2),
                p50_s=round(percentile([s.seconds for s in got], 0.5), 4),
                cpu_s_per_request={k: round((after.get(k, 0.0) - before.get(k, 0.0)) / n, 4)
                                   for k in sorted(after) if after.get(k, 0.0) - before.get(k, 0.0) > 0.05 * n / 1000}))
            print(f"[{b.now():.0f}s] {clients} clients: {out[-1].rps} req/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    ap.add_argument("--plot", type=Path, default=None, help="default: next to --out, .png")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--wave", type=int, default=1, help="nodes started at once (a busy GCS drops raylets that take > 30 s)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=4.0,
                    help="a full batch of 3 takes 41.1 s / this, its SLO 46.9 s / this: at 4 the 1.4 s between them "
                         "is room for this box's front door under load, at 10 (0.6 s) it is not")
    ap.add_argument("--port", type=int, default=8260)
    ap.add_argument("--base-rate", type=float, default=0.15,
                    help="one replica meets 0.94 of its SLOs at 0.25 req/s of Poisson arrivals, 1.0 at 0.125 "
                         "(tests/serving/scale/test_scaling_low_rate.py): the base is a load one replica serves")
    ap.add_argument("--base-seconds", type=float, default=30.0)
    ap.add_argument("--step-rate", type=float, default=2.0,
                    help="one replica serves ~0.58 req/s at time_scale 4 in full batches (0.4 in batches of one); "
                         "8 replicas at 2.0 req/s leave room for the SLO, at 3.2 they run at the edge of it")
    ap.add_argument("--max-queue", type=int, default=24,
                    help="the group's queue per replica before a JSON 503 (deeper is past the SLO anyway)")
    ap.add_argument("--step-seconds", type=float, default=240.0, help="longest the step lasts")
    ap.add_argument("--settle-seconds", type=float, default=40.0,
                    help="the step ends once the running replicas have matched the autoscaler's target this long")
    ap.add_argument("--recovery-grace", type=float, default=10.0,
                    help="attainment after scaling counts the step's arrivals from this long after the target ran")
    ap.add_argument("--in-flight", type=int, default=128)
    ap.add_argument("--front-seconds", type=float, default=60.0)
    ap.add_argument("--scale-timeout", type=float, default=180.0)
    ap.add_argument("--kill-node", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--after-kill-seconds", type=float, default=20.0)
    ap.add_argument("--down-seconds", type=float, default=120.0)
    ap.add_argument("--saturation", action="store_true",
                    help="instead: the front door's saturation at --sat-time-scale on one node, added to --out")
    ap.add_argument("--sat-time-scale", type=float, default=2000.0)
    ap.add_argument("--sat-levels", default="4,16,64")
    ap.add_argument("--sat-seconds", type=float, default=15.0)
    ap.add_argument("--request-timeout", type=float, default=600.0, help="a request unanswered this long is lost")
    args = ap.parse_args()

    import platform

    import ray
    from bench.scenarios.local_cluster import LocalCluster
    from ray import serve

    from xema_ray.serving.api.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    b = Bench(args)
    cluster = LocalCluster(env={PROXY_CALLBACK_ENV: PROXY_CALLBACK, **FAST_HEALTH, **FRONT_DOOR_ENV},
                           auth_mode="disabled")
    os.environ.update({**FAST_HEALTH, **FRONT_DOOR_ENV})
    jobs_dir = Path(tempfile.mkdtemp(prefix="xema-scale-jobs-"))
    try:
        cluster.start_head(num_cpus=4, num_gpus=0, dashboard=False, resources={"xema_head": 100})
        cluster.connect(log_to_driver=False)
        cluster.add_nodes(args.nodes, num_cpus=2, num_gpus=args.gpus, timeout_s=300, wave=args.wave)
        print(f"[{b.now():.0f}s] cluster: head + {args.nodes} x {args.gpus} emulated GPUs", flush=True)
        from deployments.app import build_app

        serve.start(http_options={"host": "127.0.0.1", "port": args.port}, proxy_location="HeadOnly")
        config = app_args(args, jobs_dir)
        if args.saturation:  # fixed replicas filling the nodes, batches of milliseconds
            g = config["models"][0]
            del g["autoscaling"]
            g["replicas"] = b.max_replicas
            config["time_scale"] = args.sat_time_scale
        serve.run(build_app(config), name="xema", route_prefix="/")
        if args.saturation:
            sat_levels = asyncio.run(saturate(b, cluster, [int(x) for x in args.sat_levels.split(",")], args.sat_seconds))
            top = max(sat_levels, key=lambda lv: lv.rps)
            costs = top.cpu_s_per_request
            total = sum(costs.values())
            bound = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(costs.items(), key=lambda kv: -kv[1])[:4])
            sat = Saturation(time_scale=args.sat_time_scale, gpus=b.max_replicas * 4, levels=sat_levels,
                             saturated_rps=top.rps, load_avg_1m=round(os.getloadavg()[0], 2),
                             measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             bound=f"{total * top.rps:.2f} CPU-s/s of {os.cpu_count()} cores at {top.rps} req/s "
                                   f"({total * 1000:.0f} ms CPU per request): {bound}")
        else:
            fd, ascale, loss = asyncio.run(drive(b, cluster))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    if args.saturation:
        old = ScaleResult.model_validate_json(args.out.read_text())
        args.out.write_text(old.model_copy(update={"saturation": sat}).model_dump_json(indent=2) + "\n")
        print(sat.model_dump_json(indent=2))
        return
    kept = None  # the saturation section is measured by its own run (--saturation): kept across runs
    if args.out.exists():
        try:
            kept = ScaleResult.model_validate_json(args.out.read_text()).saturation
        except ValueError:
            kept = None
    result = ScaleResult(machine=f"{platform.node()} ({os.cpu_count()} CPUs)", time_scale=args.time_scale,
                         template=TEMPLATE, nodes=args.nodes, gpus_per_node=args.gpus, front_door=fd,
                         autoscale=ascale, node_loss=loss, saturation=kept, wall_s=round(b.now(), 1),
                         load_avg=os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result.model_dump_json(indent=2) + "\n")
    plot(b.timeline, b.targets, b.samples, args.time_scale, args.plot or args.out.with_suffix(".png"))
    print(result.model_dump_json(indent=2, exclude={"autoscale": {"timeline"}}))


if __name__ == "__main__":
    main()
