"""Where each template's text encoder runs: a plan choice, searched like a mitigation.

The text phase of a request (before its first denoising step) encodes its prompts. Three placements
(``TextEncoderPlacement``):

- ``device``: the encoder's weights stay on the device for the whole request (they add to every
  phase's peak); it runs at device speed;
- ``streamed``: its parts (embedding, layers, norm, head) live on pinned host memory and stream
  through the device during the text phase only (block offload's machinery, the next part
  prefetched): the device holds two parts at a time; it takes the longer of the compute and the
  copy;
- ``cpu``: the encoder runs on the host CPU; nothing of it is on the device.

For each planned entry the placements that fit the budget (the plan's predicted peak, and the
text-phase peak: the plan's resident weights + the encoder's device part + its traced activations)
are costed and the fastest kept; the entry's latency and goodput include it. Encoder activations
come from a meta trace of the model's real encoder (``trace_encode``), not from a formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.models.weight_formats import block_bytes_ratio
from xema_ray.plan import ExecutionConfig, PlanEntry
from xema_ray.profiling.hardware import HardwareProfile
from xema_ray.tier_plan import WeightFormat
from xema_ray.runtime.residency import Residency, block_sizes

from planner.traces import meta_pipeline


@dataclass(frozen=True)
class EncoderCosts:
    """What one placement needs and takes for one entry."""

    placement: str
    peak_bytes: int
    text_peak_bytes: int
    seconds: float


class EncoderFacts(BaseModel):
    """What placing a model's text encoder needs, measured once where the model is built (the
    planning task, which has its meta pipeline already) and sent back to the driver as JSON: the
    driver then only does arithmetic, whatever residency the model group ends up with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    total_bytes: int = Field(description="all of the encoder's weights")
    streamed_bytes: int = Field(description="its parts streamed through the device (embedding, layers, norm, head)")
    largest_part_bytes: int
    text_params: int = Field(description="parameters of the text path (vision tower excluded)")
    weights_bytes: int = Field(description="the pipeline's other components' weights (transformer, VAE, ...)")
    activation_bytes: dict[int, int] = Field(
        default_factory=dict, description="prompts encoded at once -> peak activation bytes (meta trace)")

    def merged(self, other: EncoderFacts) -> EncoderFacts:
        """These facts with ``other``'s activation peaks too (same model)."""
        if other.model != self.model:
            raise ValueError(f"cannot merge encoder facts of {other.model} into {self.model}")
        return self.model_copy(update={"activation_bytes": {**self.activation_bytes, **other.activation_bytes}})


def encode_prompts_count(config: ExecutionConfig) -> int:
    """Prompts one batch encodes: the rows per request of the widest transformer call (the spec's
    guidance passes), so the empty negative prompt too where the CFG pair runs as one doubled
    batch (CogVideoX, LTX-2)."""
    return config.batch * config.template.spec.dit_batch_multiplier()


@cache
def _encoder_facts(model: str) -> tuple[int, int, int, int]:
    """(all weights, streamed part, largest layer, text parameters) of a model's encoder."""
    from xema_ray.models import get_model_spec
    from xema_ray.models.text_encoders import build_encoder_on_meta

    spec = get_model_spec(model)
    enc_spec = spec.text_encoder
    dtype = torch.bfloat16 if spec.size == "real" else torch.float32
    enc = build_encoder_on_meta(enc_spec, dtype, real_buffers=False)
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in m.parameters())  # noqa: E731
    total = nbytes(enc)
    units = enc_spec.units(enc)
    streamed = sum(nbytes(b) for _, b in units)
    largest = max(nbytes(b) for _, b in units)
    vision = sum(nbytes(enc.get_submodule(p)) for p in enc_spec.streamed_host_modules()[len(units):])
    text_params = sum(t.numel() for t in enc.parameters()) - vision // enc.dtype.itemsize
    return total, streamed, largest, text_params


@cache
def trace_encode(model: str, batch: int) -> int:
    """Peak activation bytes of the model's real encoder on ``batch`` prompts (meta trace, weights excluded)."""
    from xema_ray.analyzer.tracer import AllocationTracer, cuda_like_attention
    from xema_ray.models import get_model_spec
    from xema_ray.models.text_encoders import build_encoder_on_meta, build_tokenizer, meta_shims

    spec = get_model_spec(model)
    dtype = torch.bfloat16 if spec.size == "real" else torch.float32
    pipe = meta_pipeline(model)
    saved = (getattr(pipe, "text_encoder", None), getattr(pipe, "tokenizer", None))
    pipe.text_encoder = build_encoder_on_meta(spec.text_encoder, dtype, real_buffers=False)
    pipe.tokenizer = build_tokenizer(spec.text_encoder)
    tracer = AllocationTracer("meta", {})
    try:
        with torch.no_grad(), meta_shims(), cuda_like_attention(tracer), tracer:
            out = spec.encode_prompts(pipe, ["a photo of a cat"] * batch, torch.device("meta"), dtype)
            del out
    finally:
        pipe.text_encoder, pipe.tokenizer = saved  # the shared pipeline traces without it
    live, peak = 0, 0
    raw = tracer.raw()
    for kind, rec in zip(raw.event_kind, raw.event_alloc, strict=True):
        live += raw.records[rec].nbytes if kind == 0 else -raw.records[rec].nbytes
        peak = max(peak, live)
    return peak


@cache
def _weights_bytes(model: str, weights: WeightFormat = "model") -> int:
    """The pipeline's weights but the encoder's, the transformer's in ``weights`` (as stored)."""
    from xema_ray.mitigation.weight_quant import stored_bytes

    pipe = meta_pipeline(model, weights=weights)
    return sum(stored_bytes(c) for name, c in pipe.components.items()
               if isinstance(c, torch.nn.Module) and name != "text_encoder")


def encoder_facts(config: ExecutionConfig) -> EncoderFacts:
    """The facts ``placement_costs`` needs for ``config``'s model and batch (meta builds and a
    meta trace of the encoder, each done once per process)."""
    model = config.template.spec.name
    total, streamed, largest, params = _encoder_facts(model)
    prompts = encode_prompts_count(config)
    return EncoderFacts(model=model, total_bytes=total, streamed_bytes=streamed, largest_part_bytes=largest,
                        text_params=params, weights_bytes=_weights_bytes(model, config.weights),
                        activation_bytes={prompts: trace_encode(model, prompts)})


def _resident_bytes(config: ExecutionConfig, facts: EncoderFacts) -> int:
    """Device weights of the plan outside the DiT's streamed blocks (transformer + VAE + the rest)."""
    spec = config.template.spec
    ratio = 1.0 if config.weights == "model" else block_bytes_ratio(spec, config.weights)
    sizes = block_sizes(spec)
    return facts.weights_bytes - int(ratio * sum(sizes[i] for i in Residency.of_config(config).host_blocks))


def placement_costs(entry: PlanEntry, hw: HardwareProfile, facts: EncoderFacts | None = None) -> list[EncoderCosts]:
    """Each placement's device peaks and text-phase seconds for ``entry``'s batch (``facts``: from
    ``encoder_facts``, computed here when not given)."""
    c = entry.config
    spec = c.template.spec
    prompts = encode_prompts_count(c)
    if facts is None or prompts not in facts.activation_bytes:
        facts = encoder_facts(c) if facts is None else facts.merged(encoder_facts(c))
    flops = 2.0 * facts.text_params * spec.text_tokens * prompts
    device_s = flops / (hw.bf16_tflops * 1e12 * hw.matmul_efficiency)
    act = facts.activation_bytes[prompts]
    resident = _resident_bytes(c, facts)
    peak = entry.prediction.peak_bytes
    total, largest = facts.total_bytes, facts.largest_part_bytes
    return [
        EncoderCosts("device", peak + total, resident + total + act, device_s),
        EncoderCosts("streamed", peak, resident + 2 * largest + act, max(device_s, facts.streamed_bytes / (hw.h2d_gbps * 1e9))),
        EncoderCosts("cpu", peak, peak, flops / (hw.host_tflops * 1e12)),
    ]


def place_text_encoder(entry: PlanEntry, hw: HardwareProfile, budget: int, facts: EncoderFacts | None = None,
                       allowed: tuple[str, ...] | None = None) -> tuple[PlanEntry, list[EncoderCosts]]:
    """``entry`` with the fastest placement that fits ``budget`` (the CPU always fits), among
    ``allowed`` where given (the host budget asks for "device"; where it does not fit, as without)."""
    costs = placement_costs(entry, hw, facts)
    fits = [k for k in costs if max(k.peak_bytes, k.text_peak_bytes) <= budget]
    fits = [k for k in fits if allowed is None or k.placement in allowed] or fits or [costs[-1]]
    best = min(fits, key=lambda k: k.seconds)
    cfg = entry.config.model_copy(update={"text_encoder": best.placement})
    p = entry.prediction
    latency = p.latency_s + best.seconds
    goodput = cfg.dp * cfg.batch / latency if latency <= p.slo_s else 0.0
    by_batch = {n: v + best.seconds * n / cfg.batch for n, v in p.latency_by_batch.items()}
    pred = p.model_copy(update={"latency_s": latency, "goodput_rps": goodput, "latency_by_batch": by_batch,
                                "peak_bytes": max(p.peak_bytes, best.peak_bytes, best.text_peak_bytes)})
    return entry.model_copy(update={"config": cfg, "prediction": pred}), costs
