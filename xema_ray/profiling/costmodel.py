"""Roofline cost model and ``estimate_latency``: latency for hardware that is not at hand.

Every number it returns is an *estimate* and says so (``LatencyEstimate.source``). Per DiT block
and denoising step it takes the larger of compute time (GEMM FLOPs at ``matmul_efficiency`` of
peak, attention FLOPs at ``attention_efficiency``) and weight-read time, then adds what does
not overlap with compute:

* SP: Ulysses all-to-alls (4 per attention: q, k, v out, output back) and the output gather,
  at the group's link bandwidth (NVLink inside a domain, else PCIe); ring hops overlap the
  per-hop attention and only their excess counts;
* offloaded blocks (``block_offload``): host->device weight copies on one copy stream with two
  staging buffers, simulated block by block — a copy starts when the previous copy is done and
  the block two offloads back has finished computing — with compute slowed by
  ``copy_interference`` while a copy runs (H200: offload hides only with >= 2 blocks between
  offloaded blocks, docs/measured-facts.md);
* HSDP: the all-gather of each sharded block's weights, overlapped with the previous block;
* chunking (per chunk launch overhead and efficiency loss) and temporary serialization
  (``s`` sub-batches each pay the weight reads and lose batching efficiency);
* batch size through the token count (compute grows linearly, weight reads do not);
* quantized weights (``config.weights``, the ``balanced`` tier): offloaded blocks copy the stored
  bytes; where the GPU does not compute the format (fp8 on the A6000) a dequantization pass per
  block and step (``_quantized_blocks``).

The VAE decode is a roofline over an analytic count of decoder convolution FLOPs; the VAE encode
of a template's reference images (Flux.2 edits, the first frame of image-to-video), before the
first step, one over the encoder's, mirrored from the decoder (``vae_encode_s``). Fitted
constants are the efficiencies in ``HardwareProfile`` (defaults chosen against the H200 points
in docs/measured-facts.md; ``bench/bench_profiler.py`` prints the comparison). When the profile store
holds measured requests for the hardware's fingerprint, per-phase correction factors (median of
measured / modelled) are applied.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.models.cost import BlockCost
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.profiling.hardware import HardwareProfile
from xema_ray.profiling.store import ProfileStore
from xema_ray.profiling.vae_cost import BYTES, chain_recompute_factor, conv_cache_traffic, vae_decode_s, vae_encode_s
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import TIMED_SOURCES, EstimateSource, LatencySource, Phase, PhaseKeyed

if TYPE_CHECKING:
    from xema_ray.models import ModelSpec

KERNEL_LAUNCH_S = 10e-6
KERNELS_PER_BLOCK = 40  # launches of one DiT block (GEMMs, norms, rope, attention, elementwise)
LOOP_KERNELS_PER_STEP = 6  # launches of a step outside the denoiser (the scheduler update, dtype casts)

class LatencyEstimate(BaseModel):
    """Latency of one batch under a config. ``source`` says how it was obtained
    (``xema_ray.vocabulary.LatencySource``: measured, a whole request timed; profiled, composed from
    timed segments; estimated, the roofline cost model); anything but "measured" is an estimate."""

    model_config = ConfigDict(frozen=True)

    total_s: float = Field(ge=0)
    per_phase: PhaseKeyed[float] = Field(description="seconds per phase: text, denoise, decode")
    source: EstimateSource
    per_step_s: float | None = Field(default=None, description="one denoising step (cost model / profiled)")
    calibrated: bool = Field(default=False, description="cost model corrected by measurements in the store")
    label: str = Field(default="", description="human-readable provenance, e.g. 'estimate (roofline, H200)'")


# ---------------------------------------------------------------------------- transformer work


def transformer_blocks(spec: ModelSpec, template: RequestTemplate, rows: int) -> list[BlockCost]:
    """Per-block FLOPs and weight bytes of one pass over ``rows`` batch rows (analytic, from the
    model config: the spec's ``block_work``)."""
    return spec.block_work(template, rows)


def block_compute_s(block: BlockCost, hw: HardwareProfile, sp: int = 1, chunks: int = 1) -> float:
    """Roofline time of one block on one GPU of an SP group of ``sp``."""
    peak = hw.bf16_tflops * 1e12
    compute = block.linear_flops / sp / (peak * hw.matmul_efficiency) + block.attention_flops / sp / (peak * hw.attention_efficiency)
    weights = block.weight_bytes / (hw.mem_gbps * 1e9)
    t = max(compute, weights) + KERNELS_PER_BLOCK * KERNEL_LAUNCH_S
    if chunks > 1:
        # each chunk relaunches the block's kernels and runs smaller, less efficient GEMMs
        t = t * (1 + 0.02 * (chunks - 1)) + (chunks - 1) * KERNELS_PER_BLOCK * KERNEL_LAUNCH_S
    return t


def sp_comm_s(block: BlockCost, hw: HardwareProfile, rows: int, ulysses: int, ring: int, attention_s: float) -> float:
    """Exposed communication of one block under USP (Ulysses all-to-alls + ring excess)."""
    sp = ulysses * ring
    if sp == 1:
        return 0.0
    t = 0.0
    for tokens, hidden in block.attention_tokens:
        local = rows * tokens / sp * hidden * BYTES  # one of q, k, v, out on this rank
        if ulysses > 1:
            bw = hw.link_gbps(ulysses) * 1e9
            t += 4 * (local * (ulysses - 1) / ulysses / bw + hw.collective_latency_s)
        if ring > 1:
            bw = hw.link_gbps(ring) * 1e9
            hop = 2 * local * ulysses / bw + hw.collective_latency_s  # k and v of a ulysses-gathered block
            t += (ring - 1) * max(0.0, hop - attention_s / ring)
    return t


# ---------------------------------------------------------------------------- offload simulation


def offload_step_s(compute: list[float], copy: list[float], offloaded: set[int], interference: float) -> float:
    """Time of one forward over blocks with ``compute[i]`` seconds each, where the blocks in
    ``offloaded`` first need a host->device copy of ``copy[i]`` seconds.

    One copy stream, two staging buffers: the copy of an offloaded block starts once the
    previous copy is done and the offloaded block two back has finished computing (its buffer
    is free); a block starts when the previous block is done and its weights have arrived.
    While a copy runs, compute proceeds ``1 + interference`` times slower.

    Example:
        >>> round(offload_step_s([1.0, 1.0, 1.0], [2.0, 0, 0], {0}, 0.0), 3)  # nothing to hide behind
        5.0
    """
    order = sorted(offloaded)
    copies: dict[int, tuple[float, float]] = {}
    block_end: dict[int, float] = {}
    copy_free = 0.0
    issued = 0

    def issue() -> None:
        # issue every copy whose staging buffer is free: its start is never before "now",
        # because the buffer frees when a block (the latest event) finishes
        nonlocal copy_free, issued
        while issued < len(order):
            ready = 0.0
            if issued >= 2:
                dep = order[issued - 2]
                if dep not in block_end:
                    return
                ready = block_end[dep]
            start = max(copy_free, ready)
            copies[order[issued]] = (start, start + copy[order[issued]])
            copy_free = start + copy[order[issued]]
            issued += 1

    issue()
    t = 0.0
    for i in range(len(compute)):
        if i in offloaded:
            t = max(t, copies[i][1])  # its weights must have arrived
        remaining = compute[i]
        now = t
        for s, e in sorted(copies.values()):
            if e <= now or remaining <= 0:
                continue
            if s > now:
                free = min(remaining, s - now)
                now += free
                remaining -= free
                if remaining <= 0:
                    break
            # compute runs 1 + interference times slower while this copy is in flight
            overlap = min(e - now, remaining * (1 + interference))
            now += overlap
            remaining -= overlap / (1 + interference)
        now += max(0.0, remaining)
        block_end[i] = now
        t = now
        issue()
    return t


# ---------------------------------------------------------------------------- the whole request


def _blocks_of(m: Mitigation, n_blocks: int) -> set[int]:
    if m.blocks is not None:
        return set(m.blocks)
    if m.modules is not None:
        return {i for i in range(n_blocks) if any(f".{i}" in mod and "vae" not in mod for mod in m.modules)}
    return set(range(n_blocks))  # an event range inside the DiT: conservatively all blocks


def _vae_targeted(m: Mitigation) -> bool:
    return m.modules is not None and any(mod.startswith("vae") for mod in m.modules)


def cost_model_estimate(config: ExecutionConfig, hw: HardwareProfile) -> LatencyEstimate:
    """Uncalibrated roofline latency of one batch under ``config`` on ``hw`` (milliseconds to compute)."""
    template = config.template
    spec = template.spec
    if config.gpus > hw.gpus:
        raise ValueError(f"{config.describe()} needs {config.gpus} GPUs; {hw.name} has {hw.gpus}")
    rows = config.batch * spec.transformer_rows_per_step()  # every call of a step: its guidance passes
    blocks = transformer_blocks(spec, template, rows)
    n = len(blocks)
    chunks = [1] * n
    serial = [1] * n
    offloaded: set[int] = set()
    sharded: set[int] = set()
    vae_chunks = vae_serial = 1
    chains = 1.0
    act_offload = 0
    for m in config.mitigations:
        if m.kind == "block_offload":
            offloaded |= _blocks_of(m, n)
        elif m.kind == "hsdp":
            sharded |= _blocks_of(m, n)
        elif m.kind == "dit_chunking" and not _vae_targeted(m):
            for i in _blocks_of(m, n):
                chunks[i] = max(chunks[i], m.intensity)
        elif m.kind == "vae_chunking" or (m.kind == "dit_chunking" and _vae_targeted(m)):
            vae_chunks = max(vae_chunks, m.intensity)
            if m.modules:
                chains = max(chains, chain_recompute_factor(spec, template, m.modules))
        elif m.kind == "temporary_serialization":
            if _vae_targeted(m):
                vae_serial = max(vae_serial, m.intensity)
            else:
                for i in _blocks_of(m, n):
                    serial[i] = max(serial[i], m.intensity)
        elif m.kind == "activation_offload":
            act_offload += m.intensity
    compute = []
    for i, b in enumerate(blocks):
        if serial[i] > 1:
            # s sub-batches: each runs rows/s and reads the weights again
            part = BlockCost(b.name, b.linear_flops / serial[i], b.attention_flops / serial[i], b.weight_bytes, b.attention_tokens)
            t = serial[i] * block_compute_s(part, hw, config.sp, chunks[i])
        else:
            t = block_compute_s(b, hw, config.sp, chunks[i])
        attn_s = b.attention_flops / config.sp / (hw.bf16_tflops * 1e12 * hw.attention_efficiency)
        t += sp_comm_s(b, hw, rows, config.ulysses, config.ring, attn_s)
        if i in sharded:
            # sharded across the SP group that runs the batch
            gather_s = b.weight_bytes * (config.sp - 1) / config.sp / (hw.link_gbps(config.sp) * 1e9)
            prev = compute[i - 1] if i else 0.0
            t += max(0.0, gather_s - prev)  # prefetched during the previous block
        compute.append(t)
    if config.weights != "model":
        compute, stored = _quantized_blocks(config, hw, blocks, compute)
    else:
        stored = [b.weight_bytes for b in blocks]
    copies = [w / (hw.h2d_gbps * 1e9) for w in stored]
    step = offload_step_s(compute, copies, offloaded, hw.copy_interference) if offloaded else sum(compute)
    # SP: the output gather once per step (latent tokens x channels, tiny next to the blocks)
    if config.sp > 1:
        step += 2 * hw.collective_latency_s
    step += scheduler_update_s(template, config.batch, hw)
    decode = vae_decode_s(spec, template, config.batch, hw, vae_chunks, vae_serial, chains)
    if act_offload and spec.kind == "video":
        # the conv caches (intensity = how many per frame batch; the plan's "all" is larger than
        # any decoder has) go to the host and come back once each, half hidden behind the convs
        moved, caches = conv_cache_traffic(spec, template, config.batch)
        decode += min(1.0, act_offload / caches) * 2 * moved / (hw.h2d_gbps * 1e9) * 0.5
    # text: the reference images' VAE encode (the prompt's encoding is not modelled: 0 without references)
    per_phase = {Phase.TEXT: vae_encode_s(spec, template, config.batch, hw), Phase.DENOISE: step * template.steps,
                 Phase.DECODE: decode}
    return LatencyEstimate(
        total_s=sum(per_phase.values()), per_phase=per_phase, source=LatencySource.ESTIMATED, per_step_s=step,
        label=f"estimate (roofline, {hw.name})",
    )


def scheduler_update_s(template: RequestTemplate, batch: int, hw: HardwareProfile) -> float:
    """The scheduler's update of one denoising step: a few passes over the fp32 latents."""
    return 4 * math.prod(template.latent_shape()) * batch * 4 / (hw.mem_gbps * 1e9)


def reused_step_share(config: ExecutionConfig, hw: HardwareProfile) -> float:
    """A step-cached (reused) denoising step's seconds as a share of a computed one's under
    ``config`` on ``hw``: what such a step still runs — the scheduler update, the copy of each
    pass's cached output (read and written once) and their kernel launches — over the computed
    step (``cost_model_estimate``'s ``per_step_s``). The loop's host-side Python is not modelled:
    on a GPU with real-size blocks it is noise; on the tiny CPU models it is most of a reused step,
    which is why a CPU table measures the share instead (``LatencyProfiler.measure_reuse``).

    Example:
        >>> from xema_ray.profiling.hardware import A6000_8X
        >>> t = RequestTemplate(model="flux2", height=1024, width=1024)
        >>> reused_step_share(ExecutionConfig(template=t), A6000_8X) < 0.001
        True
    """
    template, spec = config.template, config.template.spec
    step = cost_model_estimate(config, hw).per_step_s or 0.0
    rows = config.batch * spec.transformer_rows_per_step()
    copy = 2 * math.prod(template.latent_shape()) * rows * BYTES / (hw.mem_gbps * 1e9)
    launches = (LOOP_KERNELS_PER_STEP + len(spec.transformer_passes_per_step())) * KERNEL_LAUNCH_S
    reused = scheduler_update_s(template, config.batch, hw) + copy + launches
    return min(1.0, reused / step) if step > 0 else 1.0


def _quantized_blocks(config: ExecutionConfig, hw: HardwareProfile, blocks: list[BlockCost],
                      compute: list[float]) -> tuple[list[float], list[float]]:
    """Each block's time and stored weight bytes with its weights in ``config.weights``
    (weight-only: the arithmetic stays in the model's dtype). Where ``hw`` computes the format
    natively the block's time is kept (conservative: neither a faster fp8 GEMM nor the smaller
    weight read is credited); elsewhere (fp8 on the A6000) each quantized weight is first
    dequantized, a pass over device memory reading the stored bytes and writing the model-dtype
    ones, before the matmul reads them as before. Host copies of offloaded blocks move the stored bytes."""
    from xema_ray.models.weight_formats import block_bytes_ratio

    fmt = config.weights
    assert fmt != "model"
    ratio = block_bytes_ratio(config.template.spec, fmt)
    stored = [b.weight_bytes * ratio for b in blocks]
    if fmt in hw.computed_formats:
        return list(compute), stored
    bw = hw.mem_gbps * 1e9
    return [t + (s + b.weight_bytes) / bw for t, b, s in zip(compute, blocks, stored, strict=True)], stored


def _calibration_factors(store: ProfileStore, hw: HardwareProfile, spec: ModelSpec) -> dict[Phase, float]:
    """Per phase, the median ratio measured / modelled over the store's requests of this
    hardware and of the models whose measurements calibrate ``spec`` (its family:
    ``ModelSpec.shares_measurements_with``) that were measured whole or from measured segments
    (the segment-reuse profiler's "profiled" records); empty when there are none."""
    if hw.fingerprint is None:
        return {}
    ratios: dict[Phase, list[float]] = {}
    for rec in store.requests(hw.fingerprint):
        if rec.source not in TIMED_SOURCES or rec.config is None or not spec.shares_measurements_with(rec.config.template.spec):
            continue
        model = cost_model_estimate(rec.config, hw)
        for phase in (Phase.DENOISE, Phase.DECODE):
            if rec.per_phase.get(phase) and model.per_phase[phase] > 0:
                ratios.setdefault(phase, []).append(rec.per_phase[phase] / model.per_phase[phase])
    return {p: statistics.median(v) for p, v in ratios.items()}


def estimate_latency(config: ExecutionConfig, hardware: HardwareProfile, store: ProfileStore | None = None) -> LatencyEstimate:
    """Latency of one batch under ``config`` on ``hardware``: a measurement when the store has one
    for this hardware and config, else the profiler's segment estimate, else the roofline cost
    model (calibrated by the store's measurements of this hardware when there are any).

    Args:
        config: the execution configuration (template, SP, batch, mitigations).
        hardware: a profile (``H200``, ``A6000_8X``, or one whose ``fingerprint`` matches the
            machine the store's measurements came from).
        store: profile store to consult (None: cost model only).

    Example:
        >>> from xema_ray.profiling.hardware import H200
        >>> t = RequestTemplate(model="cogvideox-5b", height=720, width=1280, frames=49)
        >>> est = estimate_latency(ExecutionConfig(template=t), H200)
        >>> est.source, est.per_step_s > 1.0
        ('estimated', True)
    """
    model = config.template.model
    if store is not None and hardware.fingerprint is not None:
        for source in TIMED_SOURCES:
            rec = store.get_request(hardware.fingerprint, model, config.config_hash(), source)
            if rec is not None:
                return LatencyEstimate(
                    total_s=rec.total_s, per_phase=dict(rec.per_phase), source=rec.source,
                    per_step_s=rec.per_phase.get(Phase.DENOISE, 0.0) / rec.steps if rec.per_phase.get(Phase.DENOISE) else None,
                    label=("measurement" if source == LatencySource.MEASURED else "estimate (segment profile)") + f" on {hardware.name}",
                )
    est = cost_model_estimate(config, hardware)
    factors = _calibration_factors(store, hardware, config.template.spec) if store is not None else {}
    if not factors:
        return est
    per_phase = {p: v * factors.get(p, 1.0) for p, v in est.per_phase.items()}
    step = (est.per_step_s or 0.0) * factors.get(Phase.DENOISE, 1.0)
    return LatencyEstimate(
        total_s=sum(per_phase.values()), per_phase=per_phase, source=LatencySource.ESTIMATED, per_step_s=step, calibrated=True,
        label=f"estimate (roofline calibrated on {sum(1 for _ in factors)} phase(s) of measurements, {hardware.name})",
    )
