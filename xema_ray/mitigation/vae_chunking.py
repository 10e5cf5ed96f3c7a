"""Exact spatially chunked VAE decoding (paper §5.2): halo convolutions, group norm with
whole-tensor statistics, upsampling fused with the following convolution.

The high-resolution up-blocks of a VAE decoder make the decode peak: every resnet keeps a few
full-resolution maps alive, and an upsampler materialises a 4x map only to convolve it. Here
each *unit* of a chosen up-block (each resnet, each upsampler) runs over ``chunks`` horizontal
bands of its input instead of the whole map:

- **Halo convolutions.** A band is cut with ``halo`` extra rows on each side, at least the
  receptive radius of the convolutions in the unit, so the band's own rows see exactly the
  neighbours they see in the whole map; the halo rows (wrong near the cut, where the
  convolution padded) are cropped away. At the true image border the band *is* the border, so
  the model's own padding (zeros, reflect) applies as usual.
- **Upsample fused with the next convolution.** An upsampler unit runs the module's own
  forward (interpolate, then convolve) on a band, so the upsampled map exists one band at a
  time and the unit's output is written band by band.
- **Group norm with whole-tensor statistics.** A ``GroupNorm`` normalises with the mean and
  variance of the *whole* map, which a band cannot see. The unit therefore runs in passes:
  pass k runs every band up to the k-th group norm, accumulates that norm's statistics over
  the bands' own rows (Chan's parallel mean/variance in fp64) and stops the band there; the
  last pass runs every band to the end with all statistics known. Units without group norms
  (LTX-2's per-pixel RMS norms) need one pass.

Other spatial tensors the unit receives are cut to the same band: conv caches (same rows) and
CogVideoX's latent ``zq`` (fewer rows; bands are aligned to the ratio so nearest-neighbour
interpolation of a band equals the band of the interpolation). Everything the unit returns
that is spatial (the map, new conv caches) is cropped and written into whole outputs.

Lossless, no blending: the result equals the unchunked decode up to the reduction order of
the statistics (fp32 on CPU: max abs difference below 1e-4 on outputs in [-1, 1]).

Example:
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> spec = get_model_spec("tiny-flux2")
    >>> pipe = spec.build_pipeline(BuildOptions())
    >>> h = apply_vae_chunking(pipe, VaeChunkingConfig(modules=("vae.decoder.up_blocks.3",), chunks=2))
    >>> h.remove()
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from xema_ray.mitigation.hooks import HOOK_NAMES, MitigationHandle, OffloadedTensor, hook_module, resolve_module


class VaeChunkingConfig(BaseModel):
    """Which decoder modules run in bands, and how many."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    modules: tuple[str, ...] = Field(
        description="pipeline paths: an up-block (its resnets and upsamplers are chunked one by one) or any "
        "spatially local module (e.g. 'vae.decoder.conv_out')"
    )
    chunks: int = Field(ge=1, description="horizontal bands")
    halo: int | None = Field(default=None, ge=0, description="context rows per side; None = the receptive radius of the unit's convolutions")


class _StatsDone(Exception):
    """Raised inside a band once the statistics this pass collects are accumulated."""


@dataclass
class _Welford:
    count: int = 0
    mean: torch.Tensor | None = None
    m2: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        """Add samples ``x`` [B, G, n] (Chan et al.'s parallel update, fp64 accumulators)."""
        n = x.shape[-1]
        if n == 0:
            return
        var_b, mean_b = torch.var_mean(x.float(), dim=-1, unbiased=False)
        mean_b, m2_b = mean_b.double(), var_b.double() * n
        if self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2 = n, mean_b, m2_b
            return
        total = self.count + n
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2_b + delta * delta * (self.count * n / total)
        self.count = total


@dataclass
class _BandContext:
    """What the group-norm hooks inside a unit need to know about the running band."""

    stats: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (mean, rstd) per norm call
    acc: _Welford = field(default_factory=_Welford)
    calls: int = 0
    own_top: int = 0  # first row of the band's own rows inside the band (unit-input resolution)
    own_rows: int = 0
    band_rows: int = 0
    eps: float = 0.0  # of the norm whose statistics are being collected


class _Local(threading.local):
    ctx: _BandContext | None = None


_LOCAL = _Local()


class GlobalGroupNormHook(ModelHook):
    """A ``GroupNorm`` inside a chunked unit: collect whole-map statistics, or apply them."""

    def new_forward(self, module: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        ctx = _LOCAL.ctx
        if ctx is None:
            return self.fn_ref.original_forward(x)
        k = ctx.calls
        ctx.calls += 1
        b, c = x.shape[0], x.shape[1]
        g = module.num_groups
        if k < len(ctx.stats):
            mean, rstd = ctx.stats[k]
            # same formula as ATen's group_norm kernel: y = x * scale + bias per (batch, channel)
            w = module.weight.float() if module.weight is not None else torch.ones(c, device=x.device)
            bias = module.bias.float() if module.bias is not None else torch.zeros(c, device=x.device)
            rstd_c = rstd.float().repeat_interleave(c // g, dim=1)
            mean_c = mean.float().repeat_interleave(c // g, dim=1)
            scale = rstd_c * w
            shift = bias - mean_c * scale
            view = (b, c) + (1,) * (x.ndim - 2)
            return (x.float() * scale.view(view) + shift.view(view)).to(x.dtype)
        ratio = x.shape[-2] / ctx.band_rows
        top, rows = round(ctx.own_top * ratio), round(ctx.own_rows * ratio)
        own = x.narrow(-2, top, rows)
        ctx.eps = float(module.eps)
        ctx.acc.add(own.reshape(b, g, -1))
        raise _StatsDone


def _spatial_ratio(t: Any, h: int, w: int) -> float | None:
    """Rows of ``t`` per row of the unit input if ``t`` is a map with the same aspect, else None."""
    if not isinstance(t, torch.Tensor) or t.ndim < 4 or t.shape[-2] == 0:
        return None
    if t.shape[-2] * w != t.shape[-1] * h:
        return None
    return t.shape[-2] / h


def receptive_radius(unit: nn.Module) -> int:
    """Sum of the vertical radii of the unit's convolutions, counted in input rows (an
    upsampler's convolution runs at twice the resolution, so this over-counts there: safe)."""
    r = 0
    for m in unit.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            if m.stride[-2] != 1:
                raise ValueError(f"vae_chunking: strided convolution {m} inside a chunked unit is not supported")
            r += m.dilation[-2] * (m.kernel_size[-2] // 2)
    return r


class SpatialChunkHook(ModelHook):
    """Run a unit over horizontal bands with halos, in passes for its group norms."""

    def __init__(self, chunks: int, halo: int) -> None:
        super().__init__()
        self.chunks = chunks
        self.halo = halo

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward = self.fn_ref.original_forward
        leaves, spec = tree_flatten((args, kwargs))
        # conv caches waiting on the host (activation offload) come back for this unit's bands
        leaves = [t.load() if isinstance(t, OffloadedTensor) else t for t in leaves]
        args, kwargs = tree_unflatten(leaves, spec)
        x = next((t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 4), None)
        if x is None or _LOCAL.ctx is not None:
            return forward(*args, **kwargs)
        h, w = x.shape[-2], x.shape[-1]
        ratios = [_spatial_ratio(t, h, w) for t in leaves]
        # bands start on multiples of `align` rows so maps with fewer rows (zq) cut exactly
        align = max([round(1 / r) for r in ratios if r is not None and r < 1] + [1])
        if h % align:
            raise ValueError(f"vae_chunking: map height {h} is not a multiple of the latent ratio {align}")
        units = h // align
        chunks = min(self.chunks, units)
        if chunks <= 1:
            return forward(*args, **kwargs)
        halo = -(-self.halo // align) * align
        step = -(-units // chunks) * align
        bands = [(a, min(a + step, h)) for a in range(0, h, step)]
        ctx = _BandContext()
        while True:
            outs: list[torch.Tensor | None] | None = None
            out_spec = None
            offloaded: list[OffloadedTensor | None] | None = None
            collecting = False
            for c0, c1 in bands:
                s0, s1 = max(0, c0 - halo), min(h, c1 + halo)
                sub = [
                    t.narrow(-2, round(s0 * r), round((s1 - s0) * r)) if r is not None else t
                    for t, r in zip(leaves, ratios, strict=True)
                ]
                sub_args, sub_kwargs = tree_unflatten(sub, spec)
                ctx.calls, ctx.own_top, ctx.own_rows, ctx.band_rows = 0, c0 - s0, c1 - c0, s1 - s0
                _LOCAL.ctx = ctx
                try:
                    part = forward(*sub_args, **sub_kwargs)
                except _StatsDone:
                    collecting = True
                    continue
                finally:
                    _LOCAL.ctx = None
                del sub, sub_args, sub_kwargs
                if collecting:
                    raise RuntimeError("vae_chunking: bands of one unit disagree on their group norms")
                part_leaves, out_spec = tree_flatten(part)
                del part
                if offloaded is None:
                    offloaded = [t if isinstance(t, OffloadedTensor) else None for t in part_leaves]
                part_leaves = [t.load() if isinstance(t, OffloadedTensor) else t for t in part_leaves]
                if outs is None:
                    outs = [self._allocate(t, s1 - s0, h) for t in part_leaves]
                for i, t in enumerate(part_leaves):
                    self._write(outs[i], t, c0, c1, s0, s1)
                del part_leaves
            if collecting:
                acc = ctx.acc
                if acc.mean is None or acc.m2 is None:
                    raise RuntimeError("vae_chunking: no rows were collected for a group norm")
                var = acc.m2 / acc.count
                ctx.stats.append((acc.mean, torch.rsqrt(var + ctx.eps)))
                ctx.acc = _Welford()
                continue
            if outs is None or out_spec is None or offloaded is None:
                raise RuntimeError("vae_chunking: no band produced an output")
            # what the unit's hooks offloaded per band goes back to the host whole
            outs = [t if off is None else OffloadedTensor(t, off.stream) for t, off in zip(outs, offloaded, strict=True)]
            return tree_unflatten(outs, out_spec)

    @staticmethod
    def _allocate(t: Any, band_rows: int, h: int) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        ratio = t.shape[-2] / band_rows
        rows = round(h * ratio)
        if abs(rows - h * ratio) > 1e-9:
            raise ValueError(f"vae_chunking: output rows {t.shape[-2]} are not a whole multiple of band rows {band_rows}")
        shape = (*t.shape[:-2], rows, t.shape[-1])
        return torch.empty(shape, dtype=t.dtype, device=t.device)

    @staticmethod
    def _write(out: Any, t: Any, c0: int, c1: int, s0: int, s1: int) -> None:
        if not isinstance(t, torch.Tensor):
            return
        ratio = t.shape[-2] / (s1 - s0)
        top, rows, dst = round((c0 - s0) * ratio), round((c1 - c0) * ratio), round(c0 * ratio)
        out.narrow(-2, dst, rows).copy_(t.narrow(-2, top, rows))


def chunk_units(root: nn.Module) -> list[nn.Module]:
    """An up-block's units (its resnets, then its upsamplers); any other module is one unit."""
    resnets = getattr(root, "resnets", None)
    if isinstance(resnets, nn.ModuleList):
        units = list(resnets)
        ups = getattr(root, "upsamplers", None)
        if isinstance(ups, nn.ModuleList):
            units += list(ups)
        elif isinstance(ups, nn.Module):
            units.append(ups)
        return units
    return [root]


def apply_vae_chunking(pipe: Any, config: VaeChunkingConfig) -> MitigationHandle:
    """Chunk every unit under ``config.modules`` into ``config.chunks`` bands.

    Args:
        pipe: the diffusers pipeline.
        config: where and how much.
    """
    if not config.modules:
        raise ValueError("vae_chunking: give at least one module path")
    handle = MitigationHandle("vae_chunking")
    if config.chunks == 1:
        return handle
    for path in config.modules:
        for unit in chunk_units(resolve_module(pipe, path)):
            halo = config.halo if config.halo is not None else receptive_radius(unit)
            hook_module(handle, unit, SpatialChunkHook(config.chunks, halo), HOOK_NAMES["vae_chunk"])
            for m in unit.modules():
                if isinstance(m, nn.GroupNorm):
                    hook_module(handle, m, GlobalGroupNormHook(), HOOK_NAMES["vae_chunk_norm"])
    return handle


def band_rows(height: int, chunks: int) -> int:
    """Rows per band for a map of ``height`` rows (for estimates)."""
    return math.ceil(height / max(1, chunks))
