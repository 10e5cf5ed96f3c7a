"""How a model group is configured: its own ``ModelGroupConfig`` (one entry of the YAML's ``models:``)
and what it is given beside it (``GroupSettings``: the app's settings, the plan table's choices)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xema_ray.deployment import DecodePoolConfig, GroupShape
from xema_ray.plan import AdmissionPolicy
from xema_ray.profiling.phases import PhaseShares
from xema_ray.runtime.emulation import EmulationConfig
from xema_ray.scheduling.batch_key import DEFAULT_BATCH_POLICY, BatchPolicy
from xema_ray.scheduling.preemption_policy import PreemptionPolicy
from xema_ray.serving.jobs.store import JobStoreConfig
from xema_ray.serving.scale.scaling import AutoscalingSpec


class ModelGroupConfig(GroupShape):
    """One model's worker set (its model, workers, decode pool and templates are ``GroupShape``'s)."""

    model_config = ConfigDict(extra="forbid")

    weights_dir: Path | None = Field(default=None, description="local diffusers directory; None = random weights")
    replicas: int = Field(default=1, ge=1, description="replicas of the group (each with its own GPUs); "
                                                        "with autoscaling, the count it starts with")
    autoscaling: AutoscalingSpec | None = Field(
        default=None, description="add and remove replicas from the dispatchers' predicted attainment "
                                  "(min_replicas, max_replicas, target_attainment, window_s, ...); None: fixed replicas")
    wait_window_s: float = Field(default=0.05, ge=0, description="longest wait for a batch to fill")
    max_queue: int = Field(default=64, ge=1, description="queued requests per template before 503")
    batching: BatchPolicy = Field(
        default=DEFAULT_BATCH_POLICY,
        description="what one batch may mix: by_key (requests of one step count, guidance and quality tier only) "
                    "or mixed (any guidance of one step count and tier, run as one sub-batch per guidance); "
                    "either way a batch is priced as it runs (docs/internals.md, 'One batch key')")
    residency: Literal["per_template", "shared"] | None = Field(
        default=None,
        description="weight residency: per_template (each batch's plan decides where blocks live; a switch moves "
                    "only the difference) or shared (every plan's offloaded blocks stay on the host: no switches); "
                    "None = what the plan table chose for the group (per_template if it chose nothing)")
    share_host_weights: Literal["auto", "on", "off"] = Field(
        default="auto", description="the group's workers on a node share one copy of their host-homed weights "
                                    "(a /dev/shm segment): auto = on GPUs; off = each worker its own exact buffer")
    host_copy: Literal["auto", "on", "off"] = Field(
        default="auto", description="keep every weight in the node's host copy (a /dev/shm segment the node keeps): a "
                                    "new replica or a wake maps it instead of reading the checkpoint; auto = on for a "
                                    "group that scales to zero (autoscaling.min_replicas 0)")
    max_preemptions: int = Field(
        default=2, ge=0, le=16,
        description="step-level preemption: most times one request is paused for a more urgent batch "
                    "of another template (0: never preempt in this group)")
    time_scale: float | None = Field(
        default=None, gt=0, description="device: emulated: this group's reference seconds per emulated second "
                                        "(None: the app's time_scale); groups of requests minutes or hours long "
                                        "can run faster than groups of seconds")
    bundle_resources: dict[str, float] = Field(
        default_factory=dict, description="extra Ray resources each worker bundle asks for: a custom resource "
                                          "that only some nodes have pins the group to them")

    @property
    def scales_to_zero(self) -> bool:
        return self.autoscaling is not None and self.autoscaling.scales_to_zero

    def wants_host_copy(self) -> bool:
        """Whether the group's workers keep the node's host copy of the model (``host_copy``)."""
        return self.host_copy == "on" or (self.host_copy == "auto" and self.scales_to_zero)

    @model_validator(mode="after")
    def _known(self) -> ModelGroupConfig:
        if self.weights_dir is not None:
            # workers run in other directories: a relative path means the one `serve run` started in
            # (its contents are checked where the weights are read: on the workers' machines)
            self.weights_dir = self.weights_dir.expanduser().resolve()
        a = self.autoscaling
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) must be within autoscaling's min_replicas "
                             f"({a.min_replicas}) and max_replicas ({a.max_replicas})")
        return self


class GroupSettings(BaseModel):
    """What a model group is given beside its own ``ModelGroupConfig``: the app's settings and
    what the plan table chose for the group (``deployments/app.py`` composes it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(default="cpu", description='the kind of worker (``worker_set.WORKER_KINDS``: "cpu", '
                                                   '"cuda", "emulated")')
    worker_cpus: float = Field(default=0.25, description="CPUs per worker")
    worker_set: Literal["ray", "inprocess"] | None = Field(
        default=None, description="the worker set's backend (``worker_set.worker_set_for``); None: the device's own")
    jobs: JobStoreConfig | None = Field(default=None, description="the job store's config; None: no video jobs")
    layouts_dir: Path | None = Field(default=None, description="the plan table's layouts folder (plans with a "
                                                               "layout_ref arm theirs)")
    budget_bytes: int | None = Field(default=None, description="device memory per worker (the plan table's budget): "
                                     "the static allocator's arena is sized for it (``xema_ray.runtime.arena``); "
                                     "None: not known")
    preemption: PreemptionPolicy | None = Field(default=None, description="the step-level preemption policy; None: off")
    admission: AdmissionPolicy | None = Field(default=None, description="the SLO-aware admission policy the plan "
                                              "table chose for this group's load; None: plain EDF, every request served")
    phases: dict[str, PhaseShares] | None = Field(
        default=None, description="each template's phase shares on the plan table's hardware (``phase_shares``, as "
                                  "the simulator's): where its step boundaries fall until its first batch is "
                                  "measured; None: the fallback split (``PhaseEstimate.from_plan``)")
    emulation: EmulationConfig | None = Field(default=None, description='device "emulated": the templates\' phases '
                                              "from the plan table (docs/emulated.md)")
    app: str | None = Field(default=None, min_length=1,
                            description="the Serve application the group belongs to: names its workers' shared host "
                                        "segments; None: the replica's own (Serve's replica context), else 'default'")
