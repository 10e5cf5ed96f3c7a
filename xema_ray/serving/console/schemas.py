"""What ``/v1/console/operator`` and ``/v1/console/traces/{template}`` answer (the operator view's data)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.plan import Mitigation
from xema_ray.serving.group.preemption import PreemptionReport
from xema_ray.serving.messages import GroupLayoutStats
from xema_ray.serving.scale.replica_summary import ReplicaSummary


class PlanRow(BaseModel):
    """One served template's plan, as the operator table shows it."""

    model_config = ConfigDict(extra="forbid")

    template: str
    kind: str = Field(description="image or video")
    config: str = Field(description="ExecutionConfig.describe(): SP, DP, batch and mitigations")
    mitigations: list[str] = Field(description="each mitigation: kind, intensity and where it applies")
    predicted_latency_s: float
    predicted_peak_bytes: int
    slo_s: float
    budget_bytes: int
    layout_armed: bool = Field(description="the static layout is armed for this template on the group's workers")
    layout_why: str = Field(description="why (or why not) the static layout is armed")
    runner_up: str | None = Field(default=None, description="the next-best configuration and why it lost")


class Attainment(BaseModel):
    """Observed SLO attainment of one template over the recent window (requests this Router answered)."""

    model_config = ConfigDict(extra="forbid")

    requests: int = Field(ge=0)
    met: int = Field(ge=0)
    fraction: float | None = Field(default=None, ge=0, le=1, description="met / requests; None: no request yet")
    window_s: float = Field(gt=0)


class GroupView(BaseModel):
    """One model group: its plans, live state per replica, preemption and scaling."""

    model_config = ConfigDict(extra="forbid")

    model: str
    status: str = Field(description="/healthz's state of the group: ok, starting, degraded")
    reason: str | None = None
    workers: int = Field(ge=0, description="workers (GPUs) per replica")
    plans: list[PlanRow]
    queued: int = Field(ge=0, description="requests queued in the replica that answered the status call")
    running: int = Field(ge=0, description="batches running there")
    paused: int = Field(ge=0, description="batches paused there (step-level preemption)")
    replicas: list[ReplicaSummary] = Field(
        default_factory=list, description="each replica's backlog summary (as the request router reads it)")
    replicas_running: int | None = Field(default=None, description="Serve's count of running replicas")
    replicas_target: int | None = Field(default=None, description="replicas Serve (its autoscaler) is moving to")
    autoscaling: str | None = Field(default=None, description="min..max replicas and target attainment, if autoscaled")
    attainment: dict[str, Attainment] = Field(default_factory=dict, description="per template, observed recently")
    preemption: PreemptionReport | None = None
    static_layouts: GroupLayoutStats | None = None


class OperatorView(BaseModel):
    """``GET /v1/console/operator``."""

    model_config = ConfigDict(extra="forbid")

    t: float = Field(description="time of the answer (Unix seconds)")
    hardware: str
    budget_bytes: int
    received: int = Field(ge=0, description="generation requests received since the app started (/v1/stats)")
    groups: list[GroupView]


class Span(BaseModel):
    """An event range [start, stop) of a template's trace, with a label."""

    model_config = ConfigDict(extra="forbid")

    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    label: str
    peak_bytes: int | None = Field(default=None, description="pressure intervals: the peak inside")


class TraceView(BaseModel):
    """``GET /v1/console/traces/{template}``: the analyzer's memory trace of a served template at its
    planned configuration, against the budget, down-sampled to at most ``MAX_POINTS`` buckets
    (each bucket's maximum, so no peak is hidden)."""

    model_config = ConfigDict(extra="forbid")

    template: str
    config: str
    events: int = Field(ge=0, description="events (allocations and frees) of the traced run")
    steps_traced: int = Field(ge=1, description="denoising steps the analyzer traced (each step repeats the same pattern)")
    budget_bytes: int
    x: list[int] = Field(description="first event of each bucket")
    unmitigated: list[int] = Field(description="per bucket, the reserved bytes per GPU without mitigations (max)")
    mitigated: list[int] = Field(description="per bucket, the reserved bytes per GPU with the plan's mitigations (max)")
    predicted_peak_bytes: int = Field(description="the plan's predicted peak per GPU")
    pressure: list[Span] = Field(description="pressure intervals of the unmitigated curve against the budget")
    mitigations: list[Span] = Field(description="where each of the plan's mitigations changes the curve")
    phases: list[Span] = Field(description="phase runs: text, denoise, decode, ...")


def _where(m: Mitigation) -> str:
    if m.blocks is not None:
        b = m.blocks
        return f"blocks {b[0]}–{b[-1]}" if len(b) > 1 and tuple(range(b[0], b[-1] + 1)) == b else \
            f"blocks {','.join(map(str, b))}"
    if m.modules:
        return ", ".join(m.modules)
    if m.events is not None:
        return f"events {m.events[0]}–{m.events[1]}"
    return ""


def mitigation_label(m: Mitigation) -> str:
    """E.g. 'block_offload×4 (blocks 0–3)'."""
    where = _where(m)
    return f"{m.kind}×{m.intensity}" + (f" ({where})" if where else "")
