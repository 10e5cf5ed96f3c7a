"""Where each template's text encoder runs: a plan choice, searched like a mitigation.

The set-up interval of a request encodes its prompts. Three placements (``TextEncoderPlacement``):

- ``device``: the encoder's weights stay on the device for the whole request (they add to every
  phase's peak); it runs at device speed;
- ``streamed``: its parts (embedding, layers, norm, head) live on pinned host memory and stream
  through the device during the set-up interval only (block offload's machinery, the next part
  prefetched): the device holds two parts at a time; it takes the longer of the compute and the
  copy;
- ``cpu``: the encoder runs on the host CPU; nothing of it is on the device.

For each planned entry the placements that fit the budget (the plan's predicted peak, and the
set-up peak: the plan's resident weights + the encoder's device part + its traced activations)
are costed and the fastest kept; the entry's latency and goodput include it. Encoder activations
come from a meta trace of the model's real encoder (``trace_encode``), not from a formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from xema_ray.plan import ExecutionConfig, PlanEntry
from xema_ray.profiling.hardware import HardwareProfile
from xema_ray.runtime.residency import Residency, block_sizes


@dataclass(frozen=True)
class EncoderCosts:
    """What one placement needs and takes for one entry."""

    placement: str
    peak_bytes: int
    setup_peak_bytes: int
    seconds: float


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
    from xema_ray.memory.tracer import AllocationTracer, cuda_like_attention
    from xema_ray.models import BuildOptions, get_model_spec
    from xema_ray.models.text_encoders import build_encoder_on_meta, build_tokenizer, meta_shims

    spec = get_model_spec(model)
    dtype = torch.bfloat16 if spec.size == "real" else torch.float32
    pipe = spec.build_pipeline(BuildOptions(device="meta", dtype=dtype))
    pipe.text_encoder = build_encoder_on_meta(spec.text_encoder, dtype, real_buffers=False)
    pipe.tokenizer = build_tokenizer(spec.text_encoder)
    tracer = AllocationTracer("meta", {})
    with torch.no_grad(), meta_shims(), cuda_like_attention(tracer), tracer:
        out = spec.encode_prompts(pipe, ["a photo of a cat"] * batch, torch.device("meta"), dtype)
        del out
    live, peak = 0, 0
    raw = tracer.raw()
    for kind, rec in zip(raw.event_kind, raw.event_alloc, strict=True):
        live += raw.records[rec].nbytes if kind == 0 else -raw.records[rec].nbytes
        peak = max(peak, live)
    return peak


def _resident_bytes(config: ExecutionConfig) -> int:
    """Device weights of the plan outside the DiT's streamed blocks (transformer + VAE + the rest)."""
    from planner.estimates import _meta_pipeline

    pipe = _meta_pipeline(config.template.model)
    total = sum(t.numel() * t.element_size() for name, c in pipe.components.items()
                if isinstance(c, torch.nn.Module) and name != "text_encoder" for t in c.parameters())
    sizes = block_sizes(config.template.spec)
    return total - sum(sizes[i] for i in Residency.of_config(config).host_blocks)


def placement_costs(entry: PlanEntry, hw: HardwareProfile) -> list[EncoderCosts]:
    """Each placement's device peaks and set-up seconds for ``entry``'s batch."""
    c = entry.config
    spec = c.template.spec
    total, streamed, largest, params = _encoder_facts(spec.name)
    # the empty negative prompt is encoded too where the model runs CFG on it (CogVideoX, LTX-2)
    prompts = c.batch * (2 if spec.family in ("cogvideox", "ltx2") else 1)
    flops = 2.0 * params * spec.text_tokens * prompts
    device_s = flops / (hw.bf16_tflops * 1e12 * hw.matmul_efficiency)
    act = trace_encode(spec.name, prompts)
    resident = _resident_bytes(c)
    peak = entry.prediction.peak_bytes
    return [
        EncoderCosts("device", peak + total, resident + total + act, device_s),
        EncoderCosts("streamed", peak, resident + 2 * largest + act, max(device_s, streamed / (hw.h2d_gbps * 1e9))),
        EncoderCosts("cpu", peak, peak, flops / (hw.host_tflops * 1e12)),
    ]


def place_text_encoder(entry: PlanEntry, hw: HardwareProfile, budget: int) -> tuple[PlanEntry, list[EncoderCosts]]:
    """``entry`` with the fastest placement that fits ``budget`` (the CPU always fits)."""
    costs = placement_costs(entry, hw)
    fits = [k for k in costs if max(k.peak_bytes, k.setup_peak_bytes) <= budget] or [costs[-1]]
    best = min(fits, key=lambda k: k.seconds)
    cfg = entry.config.model_copy(update={"text_encoder": best.placement})
    p = entry.prediction
    latency = p.latency_s + best.seconds
    goodput = cfg.dp * cfg.batch / latency if latency <= p.slo_s else 0.0
    by_batch = {n: v + best.seconds * n / cfg.batch for n, v in p.latency_by_batch.items()}
    pred = p.model_copy(update={"latency_s": latency, "goodput_rps": goodput, "latency_by_batch": by_batch,
                                "peak_bytes": max(p.peak_bytes, best.peak_bytes, best.setup_peak_bytes)})
    return entry.model_copy(update={"config": cfg, "prediction": pred}), costs
