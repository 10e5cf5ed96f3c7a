"""The serving application's configuration: one typed object, read from ``serve run``'s YAML args.

It composes each room's own config (a group's ``ModelGroupConfig``, the job store's, the API's auth and
limits), so it ranks above them all (``tests/test_layering.py`` ``SERVING_LAYERS``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xema_ray.serving.api.auth import AuthConfig
from xema_ray.serving.api.schemas import RequestLimits
from xema_ray.serving.group.settings import ModelGroupConfig
from xema_ray.serving.jobs.store import JobStoreConfig


class ServeConfig(BaseModel):
    """The whole application (``deployments/xema.yaml`` ``args``)."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["cpu", "cuda", "emulated"] = Field(
        default="cpu", description="cpu: CPU worker bundles (no GPU needed); cuda: one GPU per worker; emulated: "
                                   "one Ray GPU per worker on nodes that declare GPUs, no model runs (docs/emulated.md)")
    time_scale: float = Field(
        default=1.0, gt=0, description="emulated: reference seconds per emulated second (100: a 2,154 s batch of the "
                                       "plan table takes 21.5 s); every latency, SLO and switch cost is divided by it")
    emulated_host_memory: str = Field(
        default="1TB", description="emulated: the host memory of the emulated node (the residency and paused-state "
                                   "checks use it instead of this machine's)")
    host_memory: str | None = Field(
        default=None, description="the node's RAM, e.g. 512GB: start-up refuses a deployment whose workers' host-homed "
                                  "weights (one replica of each group on one node, while loading too) exceed it, or "
                                  "exceed this machine's RAM where that is less; None: this machine's RAM")
    models: list[ModelGroupConfig] = Field(min_length=1)
    plan_table: Path | None = Field(default=None, description="planner output; None = plan at start-up")
    force_plan_table: bool = Field(default=False, description="use a plan table made for other hardware")
    budget: str = Field(default="48GB", description="per-GPU budget used when planning at start-up")
    hardware: str | None = Field(default=None, description="latency profile for start-up planning (None: measure)")
    slo_scale: float = Field(default=1.0, gt=0)
    cache_dir: Path | None = Field(
        default=Path.home() / ".cache" / "xema-ray",
        description="profile store and analyzer traces kept across restarts (None: keep nothing)")
    worker_cpus: float = Field(default=0.25, gt=0, description="CPUs reserved per worker bundle")
    worker_set: Literal["ray", "inprocess"] = Field(
        default="ray", description="where a group's workers run: ray, one Ray actor per worker in the replica's "
                                   "placement group (any SP degree, any device); inprocess, threads of the group's own "
                                   "replica (device: cpu, plans of SP 1 only: no process per worker to start, the "
                                   "replica reserves workers x worker_cpus)")
    shared_replicas: int = Field(
        default=0, ge=0, description="worker_set: inprocess only: the groups of one replica (no replicas: above 1, no "
                                     "autoscaling:) share this many replica processes (SharedReplica:<i> deployments, "
                                     "groups dealt in YAML order), each group still its own ModelGroup with its own "
                                     "queues and workers: torch and the model libraries are imported once per shared "
                                     "replica, not once per group; 0: one replica process per group (ModelGroup:<model>)")
    max_ongoing_requests: int = Field(default=64, ge=1)
    max_queued_requests: int = Field(default=256, ge=1)
    router_replicas: int = Field(default=1, ge=1, description="HTTP ingress replicas (they share the job store)")
    jobs: JobStoreConfig = Field(default_factory=JobStoreConfig,
                                 description="video jobs and image URLs: sqlite (one node) or redis (several)")
    router_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray resources the Router and Stats replicas ask for (e.g. a custom "
                                          "resource of the head node, to keep them next to the HTTP proxy)")
    auth: AuthConfig = Field(default_factory=AuthConfig,
                             description="API keys (each a tenant owning its video jobs); none: the API is open")
    limits: RequestLimits = Field(default_factory=RequestLimits,
                                  description="body and field size limits, and the Router's in-flight limit")

    @model_validator(mode="after")
    def _emulated(self) -> ServeConfig:
        if self.host_memory is not None:
            from xema_ray.memory.analysis import parse_bytes

            try:
                parse_bytes(self.host_memory)
            except ValueError as e:
                raise ValueError(f"host_memory: {e}") from None
        scaled = self.time_scale != 1.0 or any(g.time_scale is not None for g in self.models)
        if self.device != "emulated" and scaled:
            raise ValueError(f"time_scale applies to device: emulated only (device is {self.device!r})")
        if self.worker_set == "inprocess" and self.device != "cpu":
            raise ValueError(f"worker_set: inprocess runs on device: cpu only (device is {self.device!r}): one "
                             "process cannot hold several GPUs' workers")
        if self.shared_replicas and self.worker_set != "inprocess":
            raise ValueError("shared_replicas: groups share a replica process only with worker_set: inprocess (a ray "
                             "worker set's placement group is the replica's own)")
        pooled = [i for i, g in enumerate(self.models) if g.decode is not None]
        if self.device == "emulated" and pooled:
            raise ValueError(f"models[{pooled[0]}].decode: a decode pool runs on device: cpu or cuda (an emulated "
                             "worker decodes in place, its decode priced in the batch's latency)")
        if self.device == "emulated" and self.plan_table is None:
            raise ValueError("device: emulated takes its latencies from a plan table: give plan_table")
        return self

    def group_deployments(self) -> dict[str, str]:
        """Model -> the Serve deployment that runs its group: ``SharedReplica:<i>`` for the groups of
        one replica when ``shared_replicas`` is set (dealt in YAML order over them), ``ModelGroup:<model>``
        for the rest (every group when ``shared_replicas`` is 0)."""
        single = [g.model for g in self.models if g.replicas == 1 and g.autoscaling is None]
        n = min(self.shared_replicas, len(single))
        out = {g.model: f"ModelGroup:{g.model}" for g in self.models}
        for i, m in enumerate(single if n else []):
            out[m] = f"SharedReplica:{i % n}"
        return out

    def time_scale_of(self, model: str) -> float:
        """The time scale of ``model``'s group (its own, else the app's)."""
        for g in self.models:
            if g.model == model and g.time_scale is not None:
                return g.time_scale
        return self.time_scale
