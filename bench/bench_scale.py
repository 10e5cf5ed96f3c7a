"""Scale-out on a local multi-node Ray cluster of emulated GPUs: the front door at >= 32 GPUs and
>= 100 requests in flight, SLO-driven autoscaling through a load step up and down, and a node
removed under load. Writes ``bench/results/scale.json`` and a plot of replicas and attainment.

The cluster: a head (the HTTP proxy, the Router, Serve's controller; no GPUs) and ``--nodes``
worker nodes of ``--gpus`` emulated GPUs each, separate raylets on loopback
(``tests/local_cluster.py``). The app: the real one (``deployments/app.py``) with
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

from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

TEMPLATE = "flux2/256x256x1"
BODY = {"model": "flux2", "prompt": "a lighthouse at dusk", "size": "256x256", "response_format": "b64_json"}
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
               "RAY_health_check_timeout_ms": "1000"}


class Sample(BaseModel):
    """One request as the client saw it."""

    phase: str
    sent: float  # seconds since the bench began
    seconds: float
    status: int  # 0: no HTTP answer (lost)
    json_503: bool = False
    queued_s: float | None = None
    batch_s: float | None = None  # the batch's time on the workers, as the group measured it
    group_s: float | None = None  # queued + batch + hand-back, in the group
    server_s: float | None = None  # the HTTP proxy's response time (request in -> response headers out)
    batch_size: int | None = None
    replica: str | None = None
    met: bool = False


class FrontDoor(BaseModel):
    gpus: int
    in_flight_max: int
    requests: int
    router_overhead_p50_s: float = Field(description="server response time (HTTP proxy's) - queued in the group - "
                                                     "the batch's time on the workers: front + dispatch below")
    router_overhead_p99_s: float
    lost: int
    queued_p50_s: float = Field(description="time in the group's queue (capacity, not overhead)")
    parts_p50_s: dict[str, float] = Field(description="front (HTTP proxy, Router, routing, handle: server time - the "
                                                      "group's time) and dispatch (the group's loop and hand-back), "
                                                      "which make up the router overhead; and, not in it: workers "
                                                      "(the batch's time on the workers beyond its emulated work: Ray "
                                                      "calls, SP step agreement) and client (the bench client's side: "
                                                      "its response time - the server's)")
    parts_p99_s: dict[str, float]
    client_response_p50_s: float = Field(description="response time as the bench client saw it")
    cpu_cores_by_role: dict[str, float] = Field(default_factory=dict, description=(
        "CPU cores each kind of process of the cluster used during the measured window (CPU seconds / "
        "seconds), 'client' the bench itself; the machine has os.cpu_count() cores for all of them and others"))
    replicas_used: int = Field(description="replicas that served the closed loop's requests")
    load_avg_1m: float


class Autoscale(BaseModel):
    replicas_start: int
    replicas_peak: int
    replicas_end: int
    attainment_before_step: float
    attainment_step_before_scale: float = Field(description="arrivals of the step before a second replica ran")
    attainment_after_scale: float | None = Field(description="arrivals of the step from --recovery-grace after the "
                                                           "running replicas reached the autoscaler's target to the "
                                                           "step's end (None: the step ended before they did)")
    after_scale_requests: int = Field(description="the arrivals attainment_after_scale counts")
    after_scale_response_p50_s: float | None = Field(default=None, description="their response time p50 (200s)")
    after_scale_503: int = Field(default=0, description="of them, answered JSON 503 (a queue full)")
    scaled_at_s: float | None = Field(description="when the running replicas reached the target the step settled on")
    step_s: float = Field(description="how long the step's arrivals lasted")
    step_end: str = Field(description="settled: running = target for --settle-seconds; max: --step-seconds ran out")
    replicas_step_peak: int = Field(description="replicas the step itself rose to (the closed loop then asks for more)")
    lost: int
    seconds_to_peak: float | None = None
    timeline: list[tuple[float, int]] = Field(description="(seconds, running replicas)")
    targets: list[tuple[float, int]] = Field(description="(seconds, replicas Serve is starting or running: the "
                                                         "autoscaler's target as the controller carries it out)")


class NodeLoss(BaseModel):
    killed_at_s: float
    replicas_on_node: int
    in_flight_at_kill: int
    completed: int
    json_503: int
    lost: int


class SaturationLevel(BaseModel):
    clients: int
    requests: int
    rps: float
    p50_s: float
    cpu_s_per_request: dict[str, float] = Field(description="CPU seconds per answered request, by process role")


class Saturation(BaseModel):
    """The front door with (nearly) no GPU time: where requests/s stop growing with clients."""

    time_scale: float
    gpus: int
    levels: list[SaturationLevel]
    saturated_rps: float
    bound: str = Field(description="what the CPU went to at the top level")
    load_avg_1m: float
    measured_at: str = Field(default="", description="UTC time of the run (a run without --saturation keeps this section)")


class ScaleResult(BaseModel):
    machine: str
    time_scale: float
    template: str
    nodes: int
    gpus_per_node: int
    front_door: FrontDoor
    autoscale: Autoscale
    node_loss: NodeLoss | None
    saturation: Saturation | None = None
    wall_s: float
    load_avg: tuple[float, float, float]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


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
                                    "upscale_delay_s": 0.0, "downscale_delay_s": 8.0, "metrics_interval_s": 0.5}}],
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
    over = [s.server_s - s.queued_s - s.batch_s for s in ok]  # type: ignore[operator]
    parts = {"front": [s.server_s - s.group_s for s in ok],  # type: ignore[operator]
             "dispatch": [s.group_s - s.queued_s - s.batch_s for s in ok],  # type: ignore[operator]
             "workers": [s.batch_s - b.work.get(s.batch_size or 0, b.work[max(b.work)]) for s in ok],  # type: ignore[operator]
             "client": [s.seconds - s.server_s for s in ok]}  # type: ignore[operator]
    gpus = 4 * min((n for t, n in b.timeline if measure_from <= t <= measure_to), default=0)
    fd = FrontDoor(gpus=gpus if full else gpus, in_flight_max=a.in_flight, requests=len(front),
                   router_overhead_p50_s=round(percentile(over, 0.5), 4),
                   router_overhead_p99_s=round(percentile(over, 0.99), 4),
                   lost=sum(s.status == 0 for s in front), queued_p50_s=round(percentile([s.queued_s or 0.0 for s in front
                                                                                        if s.status == 200], 0.5), 4),
                   replicas_used=len({s.replica for s in front if s.replica}), load_avg_1m=round(os.getloadavg()[0], 2),
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


def plot(b: Bench, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ts, ns = zip(*b.timeline, strict=True) if b.timeline else ((), ())
    ax.step(ts, ns, where="post", color="tab:blue", label="replicas (running)")
    if b.targets:
        tt, ms = zip(*b.targets, strict=True)
        ax.step(tt, ms, where="post", color="tab:blue", ls="--", lw=0.8, alpha=0.6,
                label="replicas (target: starting or running)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas", color="tab:blue")
    ax2 = ax.twinx()
    ok = sorted((s for s in b.samples if s.status != 0), key=lambda s: s.sent)
    width = 10.0
    xs, ys = [], []
    t = 0.0
    while ok and t <= ok[-1].sent:
        w = [s for s in ok if t <= s.sent < t + width]
        if w:
            xs.append(t + width / 2)
            ys.append(sum(s.met for s in w) / len(w))
        t += width / 2
    ax2.plot(xs, ys, color="tab:orange", marker=".", label=f"SLO attainment ({width:.0f} s windows by arrival)")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("attainment", color="tab:orange")
    for phase in ("step", "front", "down"):
        first = min((s.sent for s in b.samples if s.phase == phase), default=None)
        if first is not None:
            ax.axvline(first, color="grey", ls=":", lw=1)
            ax.text(first, ax.get_ylim()[1] * 0.95, f" {phase}", fontsize=8, color="grey")
    fig.legend(loc="lower center", ncol=3, fontsize=8)
    ax.set_title(f"{TEMPLATE} on emulated A6000s (time_scale {b.args.time_scale:g}): replicas and attainment")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out, dpi=110)


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
    ap.add_argument("--base-rate", type=float, default=0.25)
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
    ap.add_argument("--scale-timeout", type=float, default=120.0)
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
    from ray import serve

    from local_cluster import LocalCluster
    from xema_ray.serving.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    b = Bench(args)
    cluster = LocalCluster(env={PROXY_CALLBACK_ENV: PROXY_CALLBACK, **FAST_HEALTH}, auth_mode="disabled")
    os.environ.update(FAST_HEALTH)
    jobs_dir = Path(tempfile.mkdtemp(prefix="xema-scale-jobs-"))
    try:
        cluster.start_head(num_cpus=4, num_gpus=0, dashboard=False, resources={"xema_head": 100})
        ray.init(address=cluster.gcs_address, log_to_driver=False)
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
    plot(b, args.plot or args.out.with_suffix(".png"))
    print(result.model_dump_json(indent=2, exclude={"autoscale": {"timeline"}}))


if __name__ == "__main__":
    main()
