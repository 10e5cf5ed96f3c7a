"""Execution configurations: how one batch of one template runs (paper §2.3, §7.1).

An ``ExecutionConfig`` is what the planner chooses and the serving runtime executes: sequence
parallelism (Ulysses × ring), data parallelism, batch size, and the list of fine-grained
mitigations with their location and intensity. It crosses process and file boundaries (plan
tables, Ray task arguments), so it is pydantic and hashable by content.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StrictInt, field_validator,
                      model_serializer, model_validator)

from xema_ray.expert_plan import ExpertSwap as ExpertSwap  # re-exported: ExecutionConfig.experts
from xema_ray.host_budget import HostBytes, NodeHost
from xema_ray.lora_pool import LoraPoolConfig  # noqa: F401  (PlanTable.adapter_pools; read from here too)
from xema_ray.templates import RequestTemplate
from xema_ray.tier_plan import StepCacheSchedule, TierPlan, WeightFormat
from xema_ray.vocabulary import LatencySource, PlanLatencySource

MitigationKind = Literal[
    "block_offload",  # §5.1 selective weight offload of K DiT blocks (K = all: layerwise offload)
    "hsdp",  # §5.1 selective HSDP: shard chosen blocks' weights across the SP/DP group
    "activation_offload",  # long-lived activations (VAE conv caches, cross-step tensors) to host
    "dit_chunking",  # sequence-chunked attention pre-processing / feed-forward at chosen blocks
    "vae_chunking",  # exact spatially chunked VAE up-blocks (halo convs, global group norm, fused upsample)
    "temporary_serialization",  # §5.2 run chosen segments of a batch in sub-batches
]
MITIGATION_KINDS: tuple[str, ...] = MitigationKind.__args__  # type: ignore[attr-defined]


class Mitigation(BaseModel):
    """One mitigation action: a primitive, where it applies, and how strongly.

    Exactly one location is given. ``intensity`` means, per kind: blocks offloaded / sharded
    (block_offload, hsdp: also the length of ``blocks`` when given), chunks (dit_chunking,
    vae_chunking), sub-batches (temporary_serialization), tensors moved (activation_offload).

    Example:
        >>> Mitigation(kind="block_offload", blocks=[0, 4, 8, 12], intensity=4).location_kind
        'blocks'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: MitigationKind
    blocks: tuple[int, ...] | None = Field(default=None, description="DiT block indices (ModelSpec.dit_blocks order)")
    modules: tuple[str, ...] | None = Field(default=None, description="module paths, e.g. 'vae.decoder.up_blocks.3'")
    events: tuple[int, int] | None = Field(default=None, description="[start, stop) event range of the template's trace")
    intensity: int = Field(ge=1, description="blocks / chunks / sub-batches / tensors, per kind")

    @model_validator(mode="after")
    def _one_location(self) -> Mitigation:
        given = [n for n in ("blocks", "modules", "events") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"{self.kind}: give exactly one location (blocks, modules or events), got {given or 'none'}")
        if self.blocks is not None:
            if any(b < 0 for b in self.blocks) or len(set(self.blocks)) != len(self.blocks):
                raise ValueError(f"{self.kind}: block indices must be distinct and >= 0, got {list(self.blocks)}")
            if self.kind in ("block_offload", "hsdp") and self.intensity != len(self.blocks):
                raise ValueError(f"{self.kind}: intensity {self.intensity} must equal the number of blocks {len(self.blocks)}")
        if self.events is not None and not (0 <= self.events[0] < self.events[1]):
            raise ValueError(f"{self.kind}: event range must satisfy 0 <= start < stop, got {self.events}")
        return self

    @property
    def location_kind(self) -> str:
        return "blocks" if self.blocks is not None else "modules" if self.modules is not None else "events"


#: the GPU fractions a decode worker may take below one GPU: each divides a GPU exactly
DECODE_GPU_FRACTIONS: tuple[float, ...] = (0.5, 0.25, 0.125)


def gpu_share(v: float) -> float:
    """``v`` GPUs as one worker may take them: a whole number, or a fraction that divides one GPU
    (0.5, 0.25, ...); anything else is refused with the fractions that would do.

    Example:
        >>> gpu_share(0.25)
        0.25
    """
    if v <= 0:
        raise ValueError(f"gpus_per_worker {v} must be above 0")
    if v >= 1:
        if v != int(v):
            raise ValueError(f"gpus_per_worker {v} must be a whole number of GPUs or a fraction that divides "
                             f"one GPU ({', '.join(map(str, DECODE_GPU_FRACTIONS))})")
        return float(v)
    per_gpu = 1 / v
    if abs(per_gpu - round(per_gpu)) > 1e-9:
        raise ValueError(f"gpus_per_worker {v} does not divide a GPU (1/{v} = {per_gpu:.3f} workers per GPU); "
                         f"use a whole number or one of {', '.join(map(str, DECODE_GPU_FRACTIONS))}")
    return v


class DecodeStage(BaseModel):
    """A decode stage of its own: the template's latents are handed to a pool of ``workers``
    decode workers (the VAE resident, nothing else of the model), each on ``gpus_per_worker``
    GPUs, instead of being decoded in place on the DiT workers, which are free for the next batch
    as soon as the last denoising step ends. ``mitigations``: what a decode worker applies for the
    decode alone (VAE primitives only; empty: none needed).

    Example:
        >>> DecodeStage(workers=2, gpus_per_worker=0.5).gpus
        1
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    workers: int = Field(ge=1, description="decode workers in the pool")
    gpus_per_worker: float = Field(gt=0, description="GPUs each decode worker takes: a whole number, or a fraction "
                                                     "that divides one GPU (0.5, 0.25, 0.125)")
    mitigations: tuple[Mitigation, ...] = Field(default=(), description="VAE mitigations a decode worker applies")

    @field_validator("gpus_per_worker")
    @classmethod
    def _divides_a_gpu(cls, v: float) -> float:
        return gpu_share(v)

    @field_validator("mitigations")
    @classmethod
    def _vae_only(cls, v: tuple[Mitigation, ...]) -> tuple[Mitigation, ...]:
        for m in v:
            if m.modules is None or not all(p.startswith("vae") for p in m.modules):
                raise ValueError(f"decode mitigations apply to the VAE only (modules under 'vae'); {m.kind} is "
                                 f"located at {m.location_kind} {m.modules or m.blocks or m.events}")
        return v

    @property
    def gpus(self) -> int:
        """Whole GPUs the pool occupies (fractional workers packed onto shared GPUs)."""
        return math.ceil(self.workers * self.gpus_per_worker - 1e-9)

    def describe(self) -> str:
        """E.g. 'decode pool 2x0.5 GPU'."""
        g = f"{self.gpus_per_worker:g}"
        extra = "".join(f" +{m.kind}×{m.intensity}" for m in self.mitigations)
        return f"decode pool {self.workers}x{g} GPU{extra}"


class ExecutionConfig(BaseModel):
    """How one batch of a template runs on a group of ``sp`` GPUs; ``dp`` such groups serve in parallel.

    Example:
        >>> t = RequestTemplate(model="cogvideox-5b", height=720, width=1280, frames=49)
        >>> cfg = ExecutionConfig(template=t, ulysses=2, dp=2, batch=1)
        >>> cfg.sp, cfg.gpus
        (2, 4)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    template: RequestTemplate = Field(description="the per-request template (its batch must be 1)")
    ulysses: int = Field(default=1, ge=1, description="Ulysses (all-to-all head split) degree")
    ring: int = Field(default=1, ge=1, description="ring-attention degree")
    dp: int = Field(default=1, ge=1, description="data-parallel groups running concurrently")
    batch: int = Field(default=1, ge=1, description="requests executed together in one group")
    mitigations: tuple[Mitigation, ...] = Field(default=(), description="applied for the batch, in order")
    layout_ref: str | None = Field(default=None, description="static layout id (hash of the solved trace), if any")
    text_encoder: Literal["device", "streamed", "cpu"] | None = Field(
        default=None,
        description="where the text encoder runs: resident on the device, streamed layer by layer through it "
                    "during set-up only, or on the host CPU; None = no encoder planned (stand-in embeddings, or "
                    "the deployment's default)")
    experts: ExpertSwap | None = Field(
        default=None, description="a two-expert model's expert switch as planned; None: both experts as the "
                                  "pipeline holds them (on the device)")
    step_cache: StepCacheSchedule | None = Field(
        default=None, description="the quality tier's fixed-budget step cache (None: lossless, every step computed)")
    decode: DecodeStage | None = Field(
        default=None, description="a decode stage of its own (the latents handed to a pool of decode workers); "
                                  "None: decoded in place on the DiT workers")
    weights: WeightFormat = Field(
        default="model", description="the transformer's weight format (a quality tier's: docs/quality.md): 'model', "
                                     "its own dtype; 'fp8' / 'int8': its quantizable layers stored weight-only")

    @model_validator(mode="after")
    def _check(self) -> ExecutionConfig:
        if self.template.batch != 1:
            raise ValueError(f"template batch must be 1 (batching is the config's `batch`), got {self.template.batch}")
        spec = self.template.spec
        if self.weights != "model" and spec.weight_quant is None:
            raise ValueError(f"weights: {spec.name}'s spec names no quantizable weights; it runs in its own dtype only")
        heads = spec.attention_heads
        if heads % self.ulysses:
            raise ValueError(f"ulysses={self.ulysses} must divide {spec.name}'s {heads} attention heads")
        if self.sp > 1 and not spec.sequence_parallel_for(self.template):
            raise ValueError(f"{self.template.shape_key} has no sequence-parallel split (sp={self.sp}); it runs one GPU "
                             "per request")
        tokens = sum(self.template.token_counts().values())
        if self.sp > tokens:
            raise ValueError(f"sp={self.sp} exceeds the {tokens} tokens of {self.template.key}")
        n_blocks = spec.num_dit_blocks
        if self.decode is not None and not spec.decode_components():
            raise ValueError(f"decode: {spec.name} has no decoder a decode stage could hold")
        if self.experts is not None:
            if "transformer_2" not in spec.component_names():
                raise ValueError(f"experts: {spec.name} does not have two experts")
            if max(self.experts.prefetch_blocks, self.experts.decode_blocks, self.experts.host_blocks) > n_blocks:
                raise ValueError(f"experts: more blocks than {spec.name}'s {n_blocks}")
        for m in self.mitigations:
            if m.blocks is not None and max(m.blocks) >= n_blocks:
                raise ValueError(f"{m.kind}: block {max(m.blocks)} out of range ({spec.name} has {n_blocks} DiT blocks)")
            if m.kind == "hsdp" and self.sp == 1:
                # DP groups run different batches; only the ranks of one SP group gather together
                raise ValueError("hsdp shards weights across the SP group running the batch; it needs sp >= 2")
            if m.kind == "temporary_serialization":
                # the transformer runs the CFG pair of every request as one batch: that is what it splits
                dit = m.blocks is not None or any(p.startswith("transformer") for p in m.modules or ())
                limit = self.batch * (spec.dit_batch_multiplier() if dit else 1)
                if m.intensity > limit:
                    raise ValueError(f"temporary_serialization: {m.intensity} sub-batches exceed the "
                                     f"{'transformer' if dit else 'module'}'s batch {limit}")
        return self

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def gpus(self) -> int:
        """The DiT workers' GPUs (SP x DP); a decode pool's are ``total_gpus - gpus``."""
        return self.sp * self.dp

    @property
    def total_gpus(self) -> int:
        """The GPUs the plan occupies: the DiT workers' and its decode pool's."""
        return self.gpus + (self.decode.gpus if self.decode is not None else 0)

    @property
    def batched_template(self) -> RequestTemplate:
        """The template at this config's batch size: what the analyzer traces."""
        return self.template.with_(batch=self.batch)

    def for_batch(self, n: int) -> ExecutionConfig:
        """This plan run with ``n`` requests (a partial batch when the dispatcher's wait window
        expired): sub-batch counts cannot exceed the batch, and one sub-batch is no serialization."""
        if n == self.batch:
            return self
        if not 1 <= n <= self.batch:
            raise ValueError(f"a partial batch must have 1..{self.batch} requests, got {n}")
        mitigations = []
        for m in self.mitigations:
            if m.kind == "temporary_serialization":
                if min(m.intensity, n) < 2:
                    continue
                m = m.model_copy(update={"intensity": min(m.intensity, n)})
            mitigations.append(m)
        return self.model_copy(update={"batch": n, "mitigations": tuple(mitigations)})

    def config_hash(self) -> str:
        """Hash over exactly the fields that change memory or latency (keys profile stores and layouts)."""
        # a config without an expert switch hashes as before the field existed (stored profiles, layouts)
        # likewise without a decode stage (decoded in place) and without a step cache (lossless)
        skip = (({"experts"} if self.experts is None else set()) | ({"decode"} if self.decode is None else set())
                | ({"step_cache"} if self.step_cache is None else set())
                | ({"weights"} if self.weights == "model" else set()))
        payload = self.model_dump_json(exclude={"layout_ref", "dp"} | skip)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """Short human form, e.g. 'SP2(u2) DP2 BS1 + block_offload×16'."""
        sp = f"SP{self.sp}" + (f"(u{self.ulysses}r{self.ring})" if self.ring > 1 else "")
        parts = [f"{sp} DP{self.dp} BS{self.batch}"]
        parts += [f"{m.kind}×{m.intensity}" for m in self.mitigations]
        if self.experts is not None:
            parts.append(self.experts.describe())
        if self.decode is not None:
            parts.append(self.decode.describe())
        if self.step_cache is not None:
            parts.append(self.step_cache.describe())
        if self.weights != "model":
            parts.append(f"weights {self.weights}")
        return " + ".join(parts)

    def dit_stage(self) -> ExecutionConfig:
        """What the DiT workers run: this config with the decode handed over (its VAE mitigations
        are the pool's business) and no decode stage."""
        if self.decode is None:
            return self
        kept = tuple(m for m in self.mitigations if not (m.modules and all(p.startswith("vae") for p in m.modules)))
        return self.model_copy(update={"decode": None, "mitigations": kept, "layout_ref": None})

    def decode_worker(self) -> ExecutionConfig:
        """One request's decode as a decode worker runs it: batch 1, one GPU's SP, the pool's
        mitigations (the DiT's config of the template otherwise; its layout not armed)."""
        pool = self.decode.mitigations if self.decode is not None else tuple(
            m for m in self.mitigations if m.modules and all(p.startswith("vae") for p in m.modules))
        return ExecutionConfig(template=self.template, mitigations=pool, text_encoder=self.text_encoder)



# ---------------------------------------------------------------------------- plan tables
PLAN_TABLE_SCHEMA_VERSION = 1


class PlanPrediction(BaseModel):
    """What the planner predicts for a chosen configuration. Every figure is finite and
    non-negative (a NaN latency would order batches and hint Retry-After with garbage)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    peak_bytes: int = Field(ge=0, description="predicted reserved peak per GPU (static layout + dynamic margin)")
    latency_s: float = Field(ge=0, description="predicted end-to-end latency of one batch")
    goodput_rps: float = Field(ge=0, description="requests/s meeting the SLO: dp * batch / latency, 0 if over the SLO")
    slo_s: float = Field(gt=0, description="the template's SLO used in planning")
    latency_source: PlanLatencySource = Field(
        description="where the entry's latencies came from (xema_ray.vocabulary.LatencySource): measured: every "
        "latency behind the entry was measured on the device it plans for (the segment-reuse profiler or a whole "
        "request); estimated: the roofline cost model only; measured+estimated: some of each (e.g. the cost model "
        "calibrated by measurements)")
    latency_by_batch: dict[int, float] = Field(
        default_factory=dict, description="predicted latency of a partial batch of n requests (n < batch)")
    pause_bytes: int | None = Field(
        default=None, ge=0,
        description="device bytes a batch holds between denoising steps besides weights (latents, prompt "
                    "embeddings, scheduler state): what it keeps while paused; None: not known (never preempted)")
    host: HostBytes | None = Field(
        default=None, description="host memory one worker holds for this plan's weights (xema_ray.host_budget): "
                                  "resident, pinned, shared with the node's other workers, transient at load; "
                                  "None: not recorded (a table planned before these figures)")
    decode_peak_bytes: int | None = Field(
        default=None, ge=0, description="with a decode stage: a decode worker's predicted reserved peak (the VAE and "
                                        "one request's decode; ``peak_bytes`` is then the DiT workers' without the "
                                        "decode interval); None: decoded in place")
    decode_s: float | None = Field(
        default=None, ge=0, description="with a decode stage: seconds a decode worker takes for one request, the "
                                         "latents' hand-over included (``latency_s`` includes them)")
    reused_step_share: float | None = Field(
        default=None, ge=0, le=1,
        description="seconds of a denoising step that reuses the step cache's output (the loop's work outside "
                    "the denoiser: scheduler update, per-step pipeline code, the cache's hook and copy) as a share "
                    "of a computed step's: what a quality tier's skipped step still costs (planner.tiers). Measured "
                    "where the entry's latency is (a CPU table: a step-cached run at calibration), else the cost "
                    "model's; None: a table planned before it was recorded (the tiers pass then takes the cost "
                    "model's on the table's hardware, or 0 on hardware without a profile)")

    @field_validator("latency_source", mode="before")
    @classmethod
    def _plan_source(cls, v: object) -> object:
        if v == LatencySource.PROFILED:
            raise ValueError("a plan entry counts a profiled latency as measured: latency_source is one of "
                             "measured, estimated, measured+estimated")
        return v

    @field_validator("latency_by_batch")
    @classmethod
    def _partial_latencies(cls, v: dict[int, float]) -> dict[int, float]:
        bad = {n: s for n, s in v.items() if n < 1 or not math.isfinite(s) or s < 0}
        if bad:
            raise ValueError(f"latency_by_batch needs batch sizes >= 1 and finite latencies >= 0, got {bad}")
        return v


class PlanEntry(BaseModel):
    """The plan for one template on one hardware configuration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: ExecutionConfig
    prediction: PlanPrediction
    runner_up: str | None = Field(default=None, description="the next-best configuration and why it lost")
    candidates_profiled: int = Field(default=0, ge=0)
    tiers: dict[str, TierPlan] = Field(
        default_factory=dict, description="quality tier -> its plan (the planner's tier pass); empty: lossless only, "
                                          "the entry's own config and prediction")

    def tier_config(self, tier: str) -> ExecutionConfig:
        """The entry's config run at quality ``tier`` (lossless: the config itself)."""
        plan = self.tiers.get(tier)
        if plan is None or (plan.cache is None and plan.weights == self.config.weights):
            return self.config
        # a step-cached batch skips steps the static layout's order expects, and quantized weights
        # allocate what the layout was not solved for: it runs on the dynamic region
        return self.config.model_copy(update={"step_cache": plan.cache, "weights": plan.weights, "layout_ref": None})


class GroupResidency(BaseModel):
    """How a model group's workers hold weights across its templates (chosen by the planner).

    ``per_template``: each batch runs under its own plan's residency; moving to another
    template's residency moves only the blocks whose home differs, costing ``switch_s[from][to]``
    seconds. ``shared``: every template's offloaded blocks (``host_blocks``) stay on the host for
    all templates (no switches; the entries' plans stream them all, which their latencies include).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: Literal["per_template", "shared"]
    host_blocks: tuple[int, ...] = Field(default=(), description="shared: the blocks homed on the host")
    switch_s: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="per_template: seconds to switch from one template's residency to another's")
    goodput_rps: dict[str, float] = Field(default_factory=dict, description="the group's predicted goodput per policy")
    host_bytes_per_worker: int = Field(default=0, ge=0, description="pinned host memory a worker holds at most")


class ReplicaStart(BaseModel):
    """A replica's predicted start (``xema_ray.profiling.replica_start``): process start and imports,
    then the weight phase, cold (checkpoint -> host copy -> device) or warm (the node's host copy
    mapped -> device), from measured figures."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weight_bytes: int = Field(ge=0, description="every weight of the model: its host copy's size")
    cold_s: float = Field(ge=0, description="seconds to a loaded replica reading the checkpoint")
    warm_s: float = Field(ge=0, description="seconds to a loaded replica mapping the node's host copy")
    basis: str = Field(description="the measured figures behind it")


class AdmissionPolicy(BaseModel):
    """How a model group's dispatcher admits and orders requests under load (SLO-aware dispatch,
    ``xema_ray.scheduling.admission``); the load-aware planner chooses it per group. The default is
    the dispatcher's plain behaviour (EDF, every request served)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    late: Literal["serve", "deprioritise", "shed"] = Field(
        default="serve",
        description="a queued request that can no longer meet its SLO (even started now, alone): serve it in "
                    "deadline order (serve), only when no request that still can waits (deprioritise), or drop "
                    "it with a 503 when others wait (shed; counted as missed)")
    partial_when_late: bool = Field(
        default=True, description="start a partial batch at once when waiting for it to fill would make its "
                                  "oldest request miss")
    refused: tuple[str, ...] = Field(
        default=(), description="templates not admitted at this load (503 with Retry-After at the door): serving "
                                "them would make more of the others miss than it meets")


class PlannedLoad(BaseModel):
    """The load a model group's plans were chosen for, and the SLO attainment the planner expects
    there (simulated with the serving dispatcher)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    rate_per_min: float = Field(gt=0, description="the group's expected arrival rate, requests/min")
    mix: dict[str, float] = Field(default_factory=dict,
                                  description="template shape key -> relative weight of its requests (empty: uniform)")
    slo_scale: float = Field(default=1.0, gt=0, description="SLO scale the attainment is measured at")
    expected_attainment: float = Field(ge=0, le=1, description="simulated share of requests meeting their SLO")
    goodput_attainment: float = Field(ge=0, le=1, description="the same with the no-load (best isolated goodput) "
                                                              "choice and the plain dispatcher, for comparison")
    changed: tuple[str, ...] = Field(default=(), description="templates whose plan differs from the goodput choice")


class TextEncoderChoice(BaseModel):
    """Where the planner placed a template's text encoder, and what it adds to a batch."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    placement: Literal["device", "streamed", "cpu"]
    seconds_per_batch: float = Field(ge=0, description="the encoder's seconds in one batch (its latency includes them)")

    def describe(self) -> str:
        """E.g. 'streamed (+0.42 s per batch)'."""
        return f"{self.placement} (+{self.seconds_per_batch:.2f} s per batch)"


class DecodeChoice(BaseModel):
    """Where a template's decode runs, as the planner's ``decode_stage`` pass chose it, with the
    figures it compared (``xema plan --stages``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    asked: Literal["split", "auto"] = Field(description="split: a pool wherever one fits; auto: the better of the two")
    stage: Literal["in_place", "pool"] = Field(description="the choice: decoded in place, or by a decode pool")
    load_rps: float | None = Field(default=None, ge=0, description="the template's expected load the goodputs are "
                                                                   "capped at (None: no load given, capacity)")
    in_place_latency_s: float = Field(ge=0)
    in_place_goodput_rps: float = Field(ge=0)
    in_place_peak_bytes: int = Field(ge=0, description="the DiT workers' peak with the decode in place")
    pool: DecodeStage | None = Field(default=None, description="the best pool that fits (None: none fits)")
    pool_dp: int | None = Field(default=None, ge=1, description="DiT data-parallel groups left beside that pool")
    pool_latency_s: float | None = Field(default=None, ge=0)
    pool_goodput_rps: float | None = Field(default=None, ge=0)
    dit_peak_bytes: int | None = Field(default=None, ge=0, description="the DiT workers' peak without the decode")
    decode_peak_bytes: int | None = Field(default=None, ge=0, description="a decode worker's peak")
    reason: str = Field(description="why this choice, in words")


_LEGACY_ENCODER = re.compile(r"^(device|streamed|cpu) \(\+([0-9.]+) s per batch\)$")


class PlanProvenance(BaseModel):
    """How a plan table was made (``xema plan`` fills it; for display and benchmarks). The serving
    runtime reads only ``emulated_time_scale``, and ``xema layouts`` only ``layouts_gpu``.

    Tables written before these fields were typed hold a ``{key: string}`` dict (numbers as text,
    lists joined by "," or "; ", dicts as JSON strings): it is read into these fields (``_legacy``),
    its keys without a field kept in ``notes``; a table is always written in this form.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    command: str | None = Field(default=None, description="the command line that planned the table")
    planned: str | None = Field(default=None, description="how it was planned where no command did, e.g. 'at start-up'")
    planned_at: str | None = Field(default=None, description="when, UTC, ISO 8601")
    wall_s: float | None = Field(default=None, ge=0, description="seconds until the last template was planned")
    total_s: float | None = Field(default=None, ge=0, description="seconds with residencies, encoders and layouts")
    tasks_cpu_s: float | None = Field(default=None, ge=0, description="CPU seconds of the planning tasks together")
    profiled: int | None = Field(default=None, ge=0, description="candidates profiled, all templates")
    measured: int | None = Field(default=None, ge=0, description="of the candidates' latencies: measured")
    estimated: int | None = Field(default=None, ge=0, description="of the candidates' latencies: estimated")
    infeasible: tuple[str, ...] = Field(
        default=(), description="templates no configuration serves within the budget and the SLO")
    text_encoders: dict[str, TextEncoderChoice] = Field(
        default_factory=dict, description="shape key -> its text encoder's placement")
    layouts_wall_s: float | None = Field(
        default=None, ge=0, description="seconds the layouts add after the last template is planned")
    layouts_cpu_s: float | None = Field(default=None, ge=0, description="CPU seconds of the layout solves together")
    layouts_gpu: str | None = Field(default=None, description="the GPU model the layouts were solved for")
    layouts_dynamic_bytes: dict[str, int] = Field(
        default_factory=dict, description="model -> its workers' one dynamic region (allocator.margins.group_dynamic_bytes)")
    layouts_not_armed: dict[str, str] = Field(
        default_factory=dict, description="shape key -> why its entry keeps no layout")
    decode_stages: dict[str, DecodeChoice] = Field(
        default_factory=dict, description="shape key -> where its decode runs and why (xema plan --stages split|auto; "
                                          "empty: --stages joint, every decode in place)")
    emulated_time_scale: dict[str, float] = Field(
        default_factory=dict, description="model -> what ``runtime.emulation.scale_table`` divided its latencies "
                                          "by (empty: the hardware's own seconds)")
    notes: dict[str, str] = Field(
        default_factory=dict, description="keys of an earlier free-form provenance that have no field here")

    @model_serializer(mode="wrap")
    def _without_empty_decode_stages(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A table planned with every decode in place (``--stages joint``) is written as before the
        field existed: ``make plan``'s reference table does not change."""
        out: dict[str, Any] = handler(self)
        if not self.decode_stages:
            out.pop("decode_stages", None)
        return out

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        """The ``{key: string}`` form of tables written before these fields were typed."""
        if not isinstance(data, dict):
            return data
        out: dict[str, Any] = {}
        for k, v in data.items():
            if k in _LEGACY_PARSERS and isinstance(v, str):
                out[k] = _LEGACY_PARSERS[k](v)
            elif k not in cls.model_fields and isinstance(v, str):
                out.setdefault("notes", {})[k] = v
            else:
                out[k] = v
        return out


def _pairs(text: str) -> dict[str, str]:
    """'a: x; b: y' -> {'a': 'x', 'b': 'y'} (how earlier tables joined text encoders and reasons)."""
    return dict(item.split(": ", 1) for item in text.split("; ") if item)


def _legacy_encoder(text: str) -> dict[str, Any]:
    m = _LEGACY_ENCODER.match(text)
    if m is None:
        raise ValueError(f"cannot read text-encoder provenance {text!r}")
    return {"placement": m[1], "seconds_per_batch": float(m[2])}


def _number(text: str) -> float | None:
    return float(text) if text else None


#: legacy provenance key -> how its string reads (keys not named here were plain strings already)
_LEGACY_PARSERS: dict[str, Any] = {
    **{k: _number for k in ("wall_s", "total_s", "tasks_cpu_s", "layouts_wall_s", "layouts_cpu_s")},
    **{k: lambda s: int(s) if s else None for k in ("profiled", "measured", "estimated")},
    "infeasible": lambda s: tuple(x for x in s.split(",") if x),
    "text_encoders": lambda s: {k: _legacy_encoder(v) for k, v in _pairs(s).items()},
    "layouts_not_armed": _pairs,
    "layouts_dynamic_bytes": lambda s: json.loads(s) if s else {},
    "emulated_time_scale": lambda s: json.loads(s) if s else {},
}


class PlanTable(BaseModel):
    """Plans for every supported template on one hardware configuration (JSON on disk).

    The serving runtime refuses a table whose ``hardware`` differs from the machine it runs on
    unless forced (``check_hardware``).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: StrictInt = Field(
        default=PLAN_TABLE_SCHEMA_VERSION, description="required in a file (``load`` refuses a table without one)")
    hardware: str = Field(description="hardware fingerprint, e.g. '8xNVIDIA RTX A6000 48GB' or 'cpu:4'")
    gpus: int = Field(ge=1, description="GPUs of the machine the table was planned for")
    group_gpus: dict[str, int] = Field(
        default_factory=dict,
        description="model -> GPUs of its model group when planned for a deployment (xema plan --deployment); "
                    "empty: every template could use all `gpus`")
    budget_bytes: int = Field(ge=1)
    slo_scale: float = Field(default=1.0, gt=0)
    planner: str = Field(default="xema", description="which planner or baseline produced it")
    residency: dict[str, GroupResidency] = Field(
        default_factory=dict, description="model -> how its group holds weights across templates (absent: per_template)")
    entries: dict[str, PlanEntry] = Field(default_factory=dict, description="keyed by RequestTemplate.shape_key")
    admission: dict[str, AdmissionPolicy] = Field(
        default_factory=dict, description="model -> its dispatcher's admission policy (absent: plain EDF, all served)")
    planned_load: dict[str, PlannedLoad] = Field(
        default_factory=dict, description="model -> the load its plans were chosen for (absent: planned for "
                                          "isolated goodput, no load)")
    adapter_pools: dict[str, LoraPoolConfig] = Field(
        default_factory=dict, description="model -> its group's LoRA adapter pool, counted in its plans' memory "
                                          "(absent: the group serves no adapters)")
    replica_start: dict[str, ReplicaStart] = Field(
        default_factory=dict, description="model -> a replica's predicted start, cold and warm (the wake of a group "
                                          "scaled to zero); absent: not predicted (a table planned before it)")
    host: NodeHost | None = Field(
        default=None, description="the node's host memory for the groups' weights (one replica of each group on one "
                                  "node) against --host-budget or the deployment's stated host_memory; None: not "
                                  "recorded")
    provenance: PlanProvenance = Field(default_factory=PlanProvenance,
                                       description="command line, time, what was measured (PlanProvenance)")

    def dit_workers(self, model: str) -> int:
        """``model``'s DiT workers: its group's GPUs (``group_gpus``, else ``gpus``) less the decode
        pool its entries plan (the largest; a group holds one pool), whose workers hold the VAE alone."""
        pool = max((e.config.decode.gpus for e in self.entries.values()
                    if e.config.template.model == model and e.config.decode is not None), default=0)
        return self.group_gpus.get(model, self.gpus) - pool

    @model_validator(mode="after")
    def _entries_match(self) -> PlanTable:
        for key, e in self.entries.items():
            if key != e.config.template.shape_key:
                raise ValueError(f"plan table key {key!r} holds the plan of {e.config.template.shape_key!r}; "
                                 "each entry must be keyed by its own template's shape key")
            model = e.config.template.model
            available = self.group_gpus.get(model, self.gpus)
            if e.config.total_gpus > available:
                where = f"{model}'s group of {available}" if model in self.group_gpus else str(available)
                pool = f" + a decode pool of {e.config.decode.gpus}" if e.config.decode is not None else ""
                raise ValueError(f"{key}: plan {e.config.describe()} needs {e.config.total_gpus} GPUs "
                                 f"(SP {e.config.sp} x DP {e.config.dp}{pool}) but the table is for {where}")
        return self

    def lookup(self, template: RequestTemplate) -> PlanEntry:
        """The plan for a template (any batch/steps given by the request map to its shape)."""
        try:
            return self.entries[template.shape_key]
        except KeyError:
            raise KeyError(
                f"no plan for {template.shape_key}; planned templates: {', '.join(sorted(self.entries))}"
            ) from None

    def check_hardware(self, fingerprint: str, force: bool = False) -> None:
        """Raise ValueError if this table was planned for other hardware (unless ``force``)."""
        if fingerprint != self.hardware and not force:
            raise ValueError(
                f"plan table was made for {self.hardware!r} but this machine is {fingerprint!r}; "
                "re-plan for this hardware or pass force=True to use it anyway"
            )

    def save(self, path: str) -> None:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: str) -> PlanTable:
        from pathlib import Path

        data = Path(path).read_text()
        try:
            raw = json.loads(data)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON plan table ({e})") from None
        version = raw.get("schema_version") if isinstance(raw, dict) else None
        # a file must say which schema it follows: a missing or non-integer version is refused,
        # never taken as the current one (bool is an int subclass in Python, so exclude it)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"{path}: plan table needs an integer schema_version "
                             f"(this build reads {PLAN_TABLE_SCHEMA_VERSION}), got {version!r}")
        table = cls.model_validate_json(data)
        if table.schema_version != PLAN_TABLE_SCHEMA_VERSION:
            raise ValueError(
                f"{path}: plan table schema {table.schema_version} is not supported (this build reads "
                f"{PLAN_TABLE_SCHEMA_VERSION}); re-plan with this version"
            )
        return table
