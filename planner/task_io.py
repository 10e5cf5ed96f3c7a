"""What one planning task is told (``PlanOptions``) and what it sends back (``TemplateResult``):
the types the template pass (``planner.driver``) and the passes after it (``planner.finishing``,
``planner.pipeline``) share, below all of them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.deployment import DecodePoolConfig
from xema_ray.plan import LoraPoolConfig, PlanEntry
from xema_ray.tier_plan import WeightFormat

from planner.decode_stage import DecodeFacts
from planner.text_encoder import EncoderFacts


class PlanOptions(BaseModel):
    """What every planning task of one run is told (``plan_one``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hardware: str = Field(description="hardware profile for latency (planner.latency.hardware_names)")
    budget: int = Field(description="per-GPU memory budget, bytes")
    gpus: int = Field(description="GPUs a template may use where its model has no group of its own")
    group_gpus: dict[str, int] = Field(default_factory=dict, description="model -> GPUs of its deployment group (its "
                                                                      "DiT workers and its decode pool's)")
    decode_pools: dict[str, DecodePoolConfig] = Field(
        default_factory=dict, description="model -> its deployment group's decode pool (the YAML's decode:), on top of "
                                          "its DiT workers: the decode-stage pass plans that pool and no other")
    slo_scale: float = 1.0
    max_batch: int = 8
    planner: str = Field(default="xema", description="xema or a baseline (planner.baselines.BASELINES)")
    trace_cache: str | None = Field(default=None, description="directory keeping analyzer traces (JSON)")
    time_limit_s: float | None = Field(default=None, description="seconds per template for grid-style baselines")
    profile_store: str | None = Field(default=None, description="profile store JSON (measurements reused)")
    measure: Literal["auto", "always", "never"] = "auto"
    text_encoder: Literal["plan", "none"] = Field(
        default="none", description="plan: the task measures the text encoder's facts for its placement")
    loaded_models: tuple[str, ...] = Field(
        default=(), description="models with an expected load: their tasks send their other candidates too")
    host_budget: int | None = Field(
        default=None, ge=1, description="host memory per node, bytes (--host-budget, or the deployment's host_memory): "
                                        "plans whose node fits it are preferred (planner.host_choice)")
    send_candidates: bool = Field(
        default=False, description="every task sends its other candidates (the host budget's second pass)")
    scheduler_configs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="model -> the scheduler config of the checkpoint its group serves (the "
                                          "deployment's weights_dir: scheduler/scheduler_config.json): its expert "
                                          "switch is priced on the steps each expert runs there")
    adapter_pools: dict[str, LoraPoolConfig] = Field(
        default_factory=dict, description="model -> its group's LoRA adapter pool (the deployment's adapters:): "
                                          "its plans are traced with the pool and every sample's adapters")
    stages: Literal["joint", "split", "auto"] = Field(
        default="joint", description="where video decodes run (planner.decode_stage): joint: in place; split: a "
                                     "decode pool wherever one fits; auto: the better of the two per template")
    weights: dict[str, WeightFormat] = Field(
        default_factory=dict, description="model -> its transformer's weight format, the hardware's for the tier "
                                          "planned (xema plan --quality balanced); absent: its own dtype")
    template_loads: dict[str, float] = Field(
        default_factory=dict, description="shape key -> its expected requests/s (from --load): the decode choice's "
                                          "goodput is capped there")

    def group_size(self, model: str) -> int:
        """The GPUs ``model``'s group occupies (its deployment group's, else ``gpus``): what its plan
        table records (``PlanTable.group_gpus``) and the decode-stage pass plans on."""
        return self.group_gpus.get(model, self.gpus)

    def dit_gpus(self, model: str) -> int:
        """The GPUs ``model``'s DiT workers have: its group's less a deployment's decode pool (which
        serving runs on top of the group's ``workers``). Every template's own search plans on them."""
        pool = self.decode_pools.get(model)
        return self.group_size(model) - (pool.whole_gpus if pool is not None else 0)

    def dit_workers(self) -> dict[str, int]:
        """model -> its deployment group's DiT workers, each holding the model's host weights (the
        host-memory passes count them; a decode worker holds the VAE alone)."""
        return {m: self.dit_gpus(m) for m in self.group_gpus}


class TemplateResult(BaseModel):
    """What one planning task sends back (``plan_one``; Ray pickles it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    template: str = Field(description="the template's shape key")
    slo_s: float | None = Field(description="the SLO it was planned for (None: no configuration fits the budget)")
    entry: PlanEntry | None = Field(description="the chosen plan (None: infeasible)")
    candidates: tuple[PlanEntry, ...] = Field(
        default=(), description="its other assembled configurations, when its model group has an expected load")
    encoder_facts: EncoderFacts | None = Field(default=None, description="what placing its text encoder needs")
    decode_facts: DecodeFacts | None = Field(default=None, description="what choosing its decode stage needs "
                                                                       "(--stages split|auto)")
    device: str = Field(description="where candidates were measured: cuda, cpu, or none (the cost model)")
    traced: int = Field(description="analyzer traces taken (not found in the trace cache)")
    profiled: int = Field(description="candidates whose latency was asked")
    analysed: int = Field(description="candidates whose memory was analysed")
    finished: bool = Field(description="False: a baseline stopped at its time limit")
    pruned_memory: int | None = Field(default=None, description="Xema: candidates pruned for memory")
    pruned_slo: int | None = Field(default=None, description="Xema: candidates pruned for the SLO")
    measured: int = Field(description="candidates' latencies measured")
    estimated: int = Field(description="candidates' latencies estimated")
    not_measured: tuple[str, ...] = Field(default=(), description="measuring on the device failed: why (first 5)")
    seconds: float = Field(description="the task's wall time")
    cpu_s: float = Field(description="the task's CPU time (other jobs stretch only the wall time)")
    started_unix: float = Field(description="when the task started, for the planning timeline")
    worker_pid: int
