"""Group norm with whole-tensor statistics inside a banded unit or chain.

A ``GroupNorm`` normalises with the mean and variance of the whole map, which a band cannot see,
so a banded unit or chain runs in passes: pass k runs every band up to the k-th group norm,
which accumulates its statistics over the band's own rows (Chan's parallel update, fp64) and
stops the band (``StatsDone``); later passes apply the statistics collected. ``LOCAL`` holds,
per thread, the band running now (and the chain run driving it)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook
from torch import nn

if TYPE_CHECKING:
    from xema_ray.mitigation.vae_chunking.chain_run import ChainRun


class StatsDone(Exception):
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
class BandContext:
    """What the group-norm hooks inside a banded unit or chain need to know about the running band."""

    stats: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (mean, var) [B, G] per norm call
    acc: _Welford = field(default_factory=_Welford)
    calls: int = 0
    own_top: int = 0  # first row of the band's own rows inside the band (input resolution)
    own_rows: int = 0
    band_rows: int = 0

    def enter(self, c0: int, c1: int, s0: int, s1: int) -> None:
        self.calls, self.own_top, self.own_rows, self.band_rows = 0, c0 - s0, c1 - c0, s1 - s0
        LOCAL.ctx = self

    def close_pass(self) -> None:
        """The pass that collected a norm's statistics is over: keep them for the next passes."""
        acc = self.acc
        if acc.mean is None or acc.m2 is None:
            raise RuntimeError("vae_chunking: no rows were collected for a group norm")
        self.stats.append((acc.mean, acc.m2 / acc.count))
        self.acc = _Welford()


class BandState(threading.local):
    ctx: BandContext | None = None
    chain: ChainRun | None = None


LOCAL = BandState()


class GlobalGroupNormHook(ModelHook):
    """A ``GroupNorm`` inside a banded unit or chain: collect whole-map statistics, or apply them."""

    def new_forward(self, module: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        ctx = LOCAL.ctx
        if ctx is None:
            return self.fn_ref.original_forward(x)
        k = ctx.calls
        ctx.calls += 1
        b, c = x.shape[0], x.shape[1]
        g = module.num_groups
        if k < len(ctx.stats):
            mean, var = ctx.stats[k]
            # the group's statistics per channel, as batch-norm running statistics over B*C
            # channels: one output allocation (group_norm's own), fp32 arithmetic inside
            mean_c = mean.float().repeat_interleave(c // g, dim=1).reshape(-1)
            var_c = var.float().repeat_interleave(c // g, dim=1).reshape(-1)
            w = module.weight.float().repeat(b) if module.weight is not None else None
            bias = module.bias.float().repeat(b) if module.bias is not None else None
            try:
                y = F.batch_norm(x.reshape(1, b * c, *x.shape[2:]), mean_c, var_c, w, bias, False, 0.0, module.eps)
                return y.reshape(x.shape)
            except RuntimeError as e:  # a backend without mixed-dtype batch norm: same formula, fp32 temporaries
                if isinstance(e, torch.OutOfMemoryError):
                    raise  # out of memory is not a missing kernel (the fallback would only ask for more)
                view = (b, c) + (1,) * (x.ndim - 2)
                scale = torch.rsqrt(var_c + module.eps) * (w if w is not None else 1.0)
                shift = (bias if bias is not None else 0.0) - mean_c * scale
                return (x.float() * scale.view(view) + shift.view(view)).to(x.dtype)
        ratio = x.shape[-2] / ctx.band_rows
        top, rows = round(ctx.own_top * ratio), round(ctx.own_rows * ratio)
        ctx.acc.add(x.narrow(-2, top, rows).reshape(b, g, -1))
        raise StatsDone
