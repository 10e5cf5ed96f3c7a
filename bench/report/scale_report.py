"""What ``bench/bench_scale.py`` writes: the result schema of ``bench/results/scale.json`` (one
model per phase of the bench) and the plot of replicas and attainment over time."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

TEMPLATE = "flux2/256x256x1"


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
    router_s: float | None = None  # the Router's handler: start -> response (X-Xema-Router-Seconds)
    call_s: float | None = None  # the Router's call to the group: sent -> answered (X-Xema-Call-Seconds)
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


class CurveLevel(BaseModel):
    """The front door at one number of requests in flight (closed loop), replicas fixed."""

    in_flight: int
    requests: int = Field(description="requests of this level answered within the measured window")
    rps: float
    router_overhead_p50_s: float
    router_overhead_p99_s: float
    parts_p50_s: dict[str, float] = Field(default_factory=dict, description="see overhead_parts")
    parts_p99_s: dict[str, float] = Field(default_factory=dict)
    cpu_cores_by_role: dict[str, float] = Field(description="CPU seconds / second by process role in the window")
    cpu_s_per_request: dict[str, float] = Field(default_factory=dict,
                                                description="the same, per answered request (empty when idle)")
    load_avg_1m: float


class FrontCurve(BaseModel):
    """``bench/bench_front_door.py``: router overhead and CPU against requests in flight at a fixed
    replica count — what bounds the front door on this machine."""

    machine: str
    time_scale: float
    gpus: int
    replicas: int
    serve_env: dict[str, str] = Field(default_factory=dict, description="environment given to every node")
    levels: list[CurveLevel]
    measured_at: str
    wall_s: float
    load_avg: tuple[float, float, float]


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


def overhead(s: Sample) -> float:
    """The router overhead of an answered request: the server's response time - queued - the batch."""
    return s.server_s - s.queued_s - s.batch_s  # type: ignore[operator]


def overhead_parts(ok: list[Sample], work: dict[int, float]) -> dict[str, list[float]]:
    """The parts of each answered request's time outside its emulated work (seconds):

    * front = proxy + router + call: the server's time less the group's, split by the Router's
      headers into proxy (the HTTP proxy and its hop to the Router and back), router (the Router's
      own work around its call: parsing, the image's base64, JSON) and call (the Router's call to
      the group less the group's time: Serve's routing, the two hops, the group's loop picking the
      call up and handing its answer back);
    * dispatch: in the group, beyond the queue and the batch (its loop and hand-back);
    * not in the overhead: workers (the batch's time on the workers beyond its emulated work) and
      client (the bench client's side)."""
    full = work[max(work)]
    parts: dict[str, list[float]] = {
        "front": [s.server_s - s.group_s for s in ok],  # type: ignore[operator]
        "dispatch": [s.group_s - s.queued_s - s.batch_s for s in ok],  # type: ignore[operator]
        "workers": [s.batch_s - work.get(s.batch_size or 0, full) for s in ok],  # type: ignore[operator]
        "client": [s.seconds - s.server_s for s in ok]}  # type: ignore[operator]
    split = [s for s in ok if s.router_s is not None and s.call_s is not None
             and s.router_s == s.router_s and s.call_s == s.call_s]  # headers present (not NaN)
    if split:
        parts["proxy"] = [s.server_s - s.router_s for s in split]  # type: ignore[operator]
        parts["router"] = [s.router_s - s.call_s for s in split]  # type: ignore[operator]
        parts["call"] = [s.call_s - s.group_s for s in split]  # type: ignore[operator]
    return parts


def plot(timeline: list[tuple[float, int]], targets: list[tuple[float, int]], samples: list[Sample],
         time_scale: float, out: Path) -> None:
    """Replicas (running and target) and SLO attainment over the run, by arrival time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ts, ns = zip(*timeline, strict=True) if timeline else ((), ())
    ax.step(ts, ns, where="post", color="tab:blue", label="replicas (running)")
    if targets:
        tt, ms = zip(*targets, strict=True)
        ax.step(tt, ms, where="post", color="tab:blue", ls="--", lw=0.8, alpha=0.6,
                label="replicas (target: starting or running)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas", color="tab:blue")
    ax2 = ax.twinx()
    ok = sorted((s for s in samples if s.status != 0), key=lambda s: s.sent)
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
        first = min((s.sent for s in samples if s.phase == phase), default=None)
        if first is not None:
            ax.axvline(first, color="grey", ls=":", lw=1)
            ax.text(first, ax.get_ylim()[1] * 0.95, f" {phase}", fontsize=8, color="grey")
    fig.legend(loc="lower center", ncol=3, fontsize=8)
    ax.set_title(f"{TEMPLATE} on emulated A6000s (time_scale {time_scale:g}): replicas and attainment")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out, dpi=110)
