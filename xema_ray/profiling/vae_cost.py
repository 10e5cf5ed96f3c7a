"""The cost model's VAE part (``costmodel``): roofline seconds of the decode of a template's output
and of the encode of its reference images, from an analytic count of the convolutions' FLOPs at
each level's resolution (the model config's channels and resnets, or the spec's own
``vae_decoder_levels``); the conv-cache traffic of a causal video VAE that activation offload moves;
the recomputation VAE chains cost."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from xema_ray.models.cost import BYTES  # bf16 weights and activations (the whole cost model)
from xema_ray.profiling.hardware import HardwareProfile
from xema_ray.templates import RequestTemplate

if TYPE_CHECKING:
    from xema_ray.models import ModelSpec


def _decoder_levels(spec: ModelSpec) -> tuple[list[int], list[int]]:
    """(channels, resnets) of each decoder up level, lowest resolution first."""
    cfg = spec.vae_config
    own = spec.vae_decoder_levels()
    if own is not None:  # a model that states its decoder (Wan's VAE has no block_out_channels)
        return own
    if "decoder_block_out_channels" in cfg:
        chans = list(reversed(cfg["decoder_block_out_channels"]))
        layers = list(reversed(cfg.get("decoder_layers_per_block", [3] * (len(chans) + 1))))
    else:
        chans = list(reversed(cfg["block_out_channels"]))
        layers = [cfg.get("layers_per_block", 2) + 1] * len(chans)
    return chans, [layers[i] if i < len(layers) else layers[-1] for i in range(len(chans))]


CAUSAL_FRAME_BATCH = 2  # latent frames a causal VAE decodes at once (CogVideoX's frame_batch_size)
CAUSAL_CACHE_FRAMES = 2  # a temporal-kernel-3 causal convolution keeps its input's last 2 frames


def conv_cache_traffic(spec: ModelSpec, template: RequestTemplate, batch: int) -> tuple[float, int]:
    """(bytes, caches per frame batch) of the conv caches a causal VAE decode writes: every
    resnet convolution keeps the last frames of its input for the next frame batch. Activation
    offload moves each of them to the host and back once."""
    chans, layers = _decoder_levels(spec)
    levels = len(chans)
    pixels = template.height * template.width
    per_batch = sum(2 * n * c * pixels / 4 ** (levels - 1 - i) for i, (c, n) in enumerate(zip(chans, layers, strict=True)))
    per_batch += 4 * chans[0] * pixels / 4 ** (levels - 1)  # mid block: 2 resnets
    latent_frames = (template.frames - 1) // spec.temporal_compression + 1
    frame_batches = -(-latent_frames // CAUSAL_FRAME_BATCH)
    caches = 2 * sum(layers) + 4
    return per_batch * CAUSAL_CACHE_FRAMES * BYTES * frame_batches * batch, caches


def vae_level_flops(spec: ModelSpec, template: RequestTemplate, batch: int) -> tuple[list[float], list[int], float]:
    """Approximate decoder FLOPs per up level (lowest resolution first: index i = ``up_blocks.i``
    and its resnets), each level's resnets, and the mid block's FLOPs, for ``batch`` videos/images:
    every resnet convolution (2 per resnet, 3x3 or 3x3x3) at that level's resolution."""
    video = spec.kind == "video"
    k = 27 if video else 9
    chans, layers = _decoder_levels(spec)
    levels = len(chans)
    pixels = template.height * template.width
    out_frames = template.frames
    latent_frames = (out_frames - 1) // spec.temporal_compression + 1 if video else 1
    per_level, resnets = [], []
    for i, c in enumerate(chans):
        spatial = pixels / 4 ** (levels - 1 - i)
        frames = min(out_frames, latent_frames * 2**i) if video else 1
        n_layers = layers[i] if i < len(layers) else layers[-1]
        per_level.append(2 * n_layers * 2 * k * c * c * spatial * frames * batch)
        resnets.append(n_layers)
    mid_spatial = pixels / 4 ** (levels - 1)
    mid = 4 * 2 * k * chans[0] ** 2 * mid_spatial * latent_frames * batch
    return per_level, resnets, mid


def vae_decode_flops(spec: ModelSpec, template: RequestTemplate, batch: int) -> float:
    """Approximate decoder FLOPs: every up level's resnet convolutions (2 per resnet, 3x3 or
    3x3x3) at that level's resolution, plus the mid block, for ``batch`` videos/images."""
    per_level, _, mid = vae_level_flops(spec, template, batch)
    return sum(per_level) + mid


_CHAIN = re.compile(r"\[up_blocks\.(\d+)(\.upsamplers\.0)?:\]$")


def chain_recompute_factor(spec: ModelSpec, template: RequestTemplate, modules: tuple[str, ...]) -> float:
    """Decode time multiplier of VAE chains (``PARENT[up_blocks.I:]`` or
    ``PARENT[up_blocks.I.upsamplers.0:]``): a chain with N group norms runs in N + 1 passes,
    pass k recomputing the chain up to its k-th norm, so the chain's levels cost about
    (N + 2) / 2 times their plain compute (two norms per resnet and the output norm)."""
    per_level, resnets, mid = vae_level_flops(spec, template, 1)
    total = sum(per_level) + mid
    extra = 0.0
    for path in modules:
        m = _CHAIN.search(path)
        if m is None:
            continue
        first = int(m.group(1)) + (1 if m.group(2) else 0)  # an upsampler's output is the next level
        levels = range(first, len(per_level))
        norms = sum(2 * resnets[i] for i in levels) + 1
        extra += sum(per_level[i] for i in levels) / total * norms / 2
    return 1.0 + extra


def vae_encode_flops(spec: ModelSpec, width: int, height: int, frames: int, inputs: int) -> float:
    """Approximate encoder FLOPs for ``inputs`` inputs of ``width`` x ``height`` x ``frames``: the
    decoder's levels mirrored (same channels and resolutions, going down), one resnet fewer per
    level (diffusers' encoders have ``layers_per_block``, their decoders one more), plus the mid
    block."""
    video = spec.kind == "video"
    k = 27 if video else 9
    chans, layers = _decoder_levels(spec)
    levels = len(chans)
    pixels = width * height
    latent_frames = (frames - 1) // spec.temporal_compression + 1 if video else 1
    total = 0.0
    for i, c in enumerate(chans):  # lowest resolution first, as the decoder's
        spatial = pixels / 4 ** (levels - 1 - i)
        level_frames = min(frames, latent_frames * 2**i) if video else 1
        total += 2 * max(1, layers[i] - 1) * 2 * k * c * c * spatial * level_frames * inputs
    return total + 4 * 2 * k * chans[0] ** 2 * pixels / 4 ** (levels - 1) * latent_frames * inputs


def vae_encode_s(spec: ModelSpec, template: RequestTemplate, batch: int, hw: HardwareProfile) -> float:
    """Seconds of the VAE encode of the template's reference images, before the first step (the
    ``text`` phase, where the trace has it): each of ``batch`` requests' ``references``, at the
    reference size, as ``ReferenceInputs.encode_frames`` frames (1: an image; Wan2.2 A14B
    image-to-video encodes its first frame padded to the whole video). 0 without references."""
    if not template.references:
        return 0.0
    frames = spec.reference_inputs().encode_frames(template)
    flops = vae_encode_flops(spec, template.reference_width, template.reference_height, frames, batch * template.references)
    return flops / (hw.bf16_tflops * 1e12 * hw.conv_efficiency)


def vae_decode_s(spec: ModelSpec, template: RequestTemplate, batch: int, hw: HardwareProfile, chunks: int = 1, serial: int = 1,
                 chains: float = 1.0) -> float:
    """Decode seconds; ``chains`` is ``chain_recompute_factor`` of the plan's VAE chains."""
    flops = vae_decode_flops(spec, template, batch)
    t = flops / (hw.bf16_tflops * 1e12 * hw.conv_efficiency) * chains
    if chunks > 1:
        t *= 1 + 0.05 * (chunks - 1)  # halo recomputation and smaller convolutions
    if serial > 1:
        t *= 1 + 0.02 * (serial - 1)
    return t
