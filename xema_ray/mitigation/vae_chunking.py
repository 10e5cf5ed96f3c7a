"""Exact spatially chunked VAE decoding (paper §5.2): halo convolutions, group norm with
whole-tensor statistics, upsampling fused with the following convolution.

The high-resolution up-blocks of a VAE decoder make the decode peak: every resnet keeps a few
full-resolution maps alive, and an upsampler materialises a 4x map only to convolve it. Two
modes run parts of the decoder over horizontal bands of the map instead of the whole map.

**Per unit** (a path naming an up-block, or any spatially local module): each *unit* of the
block (each resnet, each upsampler) runs over ``chunks`` bands of its input. The unit's whole
input and output stay on the device; everything in between exists one band at a time.

**Chain** (a path ``PARENT[START:]``, e.g. ``vae.decoder[up_blocks.2:]``): ``START`` and
everything ``PARENT``'s forward runs after it — later up-blocks, the output norm, the output
convolution, any glue between them — run band by band as *one* chain, so no map inside the
chain ever exists whole: only the chain's input (the map ``START`` receives) and ``PARENT``'s
final output (for a decoder: the decoded frames) are whole. Conv caches stream per band: the
band's slice of each incoming cache is brought to the device (or cut from the device cache),
and each band's new caches are written straight into whole host buffers when activation
offload moved them there (device buffers otherwise). ``PARENT``'s forward is re-run once per
band (and per statistics pass); the calls it makes before ``START`` are replayed from their
first results, not recomputed, and results the first run had already freed before ``START``
are not kept (a stand-in that refuses any computation takes their place).

Common to both:

- **Halo convolutions.** A band is cut with ``halo`` extra rows on each side, at least the
  receptive radius of the convolutions it passes through (for a chain: summed along the
  chain, each divided by the resolution gained from upsamplers before it), so the band's own
  rows see exactly the neighbours they see in the whole map; the halo rows (wrong near the
  cut, where the convolution padded) are cropped away. At the true image border the band
  *is* the border, so the model's own padding (zeros, reflect) applies as usual. A chain
  measures the radius its convolutions actually need on the first band and fails loudly if
  the halo was too small.
- **Upsample fused with the next convolution.** An upsampler runs the module's own forward
  (interpolate, then convolve) on a band, so the upsampled map exists one band at a time.
- **Group norm with whole-tensor statistics.** A ``GroupNorm`` normalises with the mean and
  variance of the *whole* map, which a band cannot see. The unit (or chain) therefore runs in
  passes: pass k runs every band up to the k-th group norm, accumulates that norm's
  statistics over the bands' own rows (Chan's parallel mean/variance in fp64) and stops the
  band there; the last pass runs every band to the end with all statistics known. Pass k
  recomputes what lies before the k-th norm: a chain with N group norms costs about (N+1)/2
  times its plain compute (plus halos). Statistics are applied with ``batch_norm`` on the
  band (one output allocation, fp32 inside). Units without group norms (LTX-2's per-pixel RMS
  norms) need one pass.

Other spatial tensors are cut to the same band: conv caches (same rows) and CogVideoX's
latent ``zq`` (fewer rows; bands are aligned to the ratio so nearest-neighbour interpolation
of a band equals the band of the interpolation). 1x1 maps (broadcast conditioning) pass whole.

Lossless, no blending: the result equals the unchunked decode up to the reduction order of
the statistics (fp32 on CPU: max abs difference below 1e-4 on outputs in [-1, 1]).

Example:
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> spec = get_model_spec("tiny-flux2")
    >>> pipe = spec.build_pipeline(BuildOptions())
    >>> h = apply_vae_chunking(pipe, VaeChunkingConfig(modules=("vae.decoder.up_blocks.3",), chunks=2))
    >>> h.remove()
    >>> h = apply_vae_chunking(pipe, VaeChunkingConfig(modules=("vae.decoder[up_blocks.2:]",), chunks=2))
    >>> h.remove()
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from xema_ray.mitigation.hooks import (
    HOOK_NAMES,
    HostCopy,
    MitigationHandle,
    OffloadedTensor,
    hook_module,
    placeholder,
    resolve_module,
)

#: ``PARENT[START:]``: a chain from START to the end of PARENT's forward
CHAIN_RE = re.compile(r"^(?P<parent>[A-Za-z0-9_.]+)\[(?P<start>[A-Za-z0-9_.]+):\]$")


class VaeChunkingConfig(BaseModel):
    """Which decoder modules run in bands, and how many."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    modules: tuple[str, ...] = Field(
        description="pipeline paths: an up-block (its resnets and upsamplers are chunked one by one), any "
        "spatially local module (e.g. 'vae.decoder.conv_out'), or a chain 'PARENT[START:]' (e.g. "
        "'vae.decoder[up_blocks.2:]': START and everything PARENT runs after it, banded as one)"
    )
    chunks: int = Field(ge=1, description="horizontal bands")
    halo: int | None = Field(
        default=None, ge=0,
        description="context rows per side (input rows of the unit or chain); None = the receptive radius",
    )


def parse_chain(path: str) -> tuple[str, str] | None:
    """``(parent, start)`` for a chain path ``PARENT[START:]``, None for a plain module path."""
    m = CHAIN_RE.match(path)
    return (m.group("parent"), m.group("start")) if m else None


# ---------------------------------------------------------------------------- statistics
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
    """What the group-norm hooks inside a banded unit or chain need to know about the running band."""

    stats: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (mean, var) [B, G] per norm call
    acc: _Welford = field(default_factory=_Welford)
    calls: int = 0
    own_top: int = 0  # first row of the band's own rows inside the band (input resolution)
    own_rows: int = 0
    band_rows: int = 0

    def enter(self, c0: int, c1: int, s0: int, s1: int) -> None:
        self.calls, self.own_top, self.own_rows, self.band_rows = 0, c0 - s0, c1 - c0, s1 - s0
        _LOCAL.ctx = self

    def close_pass(self) -> None:
        """The pass that collected a norm's statistics is over: keep them for the next passes."""
        acc = self.acc
        if acc.mean is None or acc.m2 is None:
            raise RuntimeError("vae_chunking: no rows were collected for a group norm")
        self.stats.append((acc.mean, acc.m2 / acc.count))
        self.acc = _Welford()


class _Local(threading.local):
    ctx: _BandContext | None = None
    chain: _ChainRun | None = None


_LOCAL = _Local()


class GlobalGroupNormHook(ModelHook):
    """A ``GroupNorm`` inside a banded unit or chain: collect whole-map statistics, or apply them."""

    def new_forward(self, module: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        ctx = _LOCAL.ctx
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
            except RuntimeError:  # a backend without mixed-dtype batch norm: same formula, fp32 temporaries
                view = (b, c) + (1,) * (x.ndim - 2)
                scale = torch.rsqrt(var_c + module.eps) * (w if w is not None else 1.0)
                shift = (bias if bias is not None else 0.0) - mean_c * scale
                return (x.float() * scale.view(view) + shift.view(view)).to(x.dtype)
        ratio = x.shape[-2] / ctx.band_rows
        top, rows = round(ctx.own_top * ratio), round(ctx.own_rows * ratio)
        ctx.acc.add(x.narrow(-2, top, rows).reshape(b, g, -1))
        raise _StatsDone


# ---------------------------------------------------------------------------- bands
def _shape(t: Any) -> torch.Size | None:
    """Shape of a tensor or of a tensor waiting on the host; None for anything else."""
    if isinstance(t, torch.Tensor):
        return t.shape
    if isinstance(t, OffloadedTensor):
        return t.shape
    return None


def _spatial_ratio(t: Any, h: int, w: int) -> float | None:
    """Rows of ``t`` per row of an ``h`` x ``w`` map if ``t`` is a map with the same aspect
    (e.g. a conv cache: 1, the latent: 1/8), else None. A 1x1 map is broadcast, not cut."""
    shape = _shape(t)
    if shape is None or len(shape) < 4 or shape[-2] == 0:
        return None
    if shape[-2] == 1 and shape[-1] == 1:
        return None
    if shape[-2] * w != shape[-1] * h:
        return None
    return shape[-2] / h


def _cut(t: Any, ratio: float, s0: int, s1: int) -> Any:
    """Rows ``[s0, s1)`` (in input rows) of a whole map ``t`` at ``ratio``: a view on the
    device, or the band's slice of a host copy (brought over by whoever reads it)."""
    top, rows = s0 * ratio, (s1 - s0) * ratio
    if abs(top - round(top)) > 1e-9 or abs(rows - round(rows)) > 1e-9:
        raise ValueError(f"vae_chunking: band rows [{s0}, {s1}) do not cut a map at ratio {ratio} on whole rows")
    if isinstance(t, OffloadedTensor):
        return OffloadedTensor.from_host(t.host.narrow(-2, round(top), round(rows)), t.stream)
    return t.narrow(-2, round(top), round(rows))


@dataclass(frozen=True)
class _Bands:
    """Horizontal bands of an ``h``-row map: own rows ``[c0, c1)``, computed rows ``[s0, s1)``."""

    h: int
    w: int
    halo: int
    bands: tuple[tuple[int, int, int, int], ...]

    @staticmethod
    def plan(h: int, w: int, ratios: list[float], chunks: int, halo: float) -> _Bands | None:
        """Bands starting on multiples of the coarsest map's row ratio (so every map cuts on
        whole rows); None when the map is too small for more than one band."""
        align = max([round(1 / r) for r in ratios if r < 1] + [1])
        if h % align:
            raise ValueError(f"vae_chunking: map height {h} is not a multiple of the latent ratio {align}")
        units = h // align
        chunks = min(chunks, units)
        if chunks <= 1:
            return None
        rows = math.ceil(halo - 1e-9) if halo > 0 else 0
        rows = -(-rows // align) * align
        step = -(-units // chunks) * align
        bands = tuple((a, min(a + step, h), max(0, a - rows), min(h, a + step + rows)) for a in range(0, h, step))
        return _Bands(h=h, w=w, halo=rows, bands=bands)


class _Whole:
    """One output assembled from its bands' own rows: on the device, or — for a tensor the
    bands left on the host (an offloaded conv cache) — in a host buffer, never whole on the device."""

    def __init__(self, part: Any, band_rows: int, h: int) -> None:
        shape = _shape(part)
        assert shape is not None
        ratio = shape[-2] / band_rows
        rows = round(h * ratio)
        if abs(rows - h * ratio) > 1e-9:
            raise ValueError(f"vae_chunking: output rows {shape[-2]} are not a whole multiple of band rows {band_rows}")
        whole = (*shape[:-2], rows, shape[-1])
        if isinstance(part, OffloadedTensor):
            self.host: HostCopy | None = HostCopy.empty(whole, part.host.dtype, part.host.device)
            self.stream = part.stream
            self.t: torch.Tensor | None = None
        else:
            self.host, self.stream = None, None
            self.t = torch.empty(whole, dtype=part.dtype, device=part.device)

    def write(self, part: Any, c0: int, c1: int, s0: int, s1: int) -> None:
        shape = _shape(part)
        assert shape is not None
        ratio = shape[-2] / (s1 - s0)
        top, rows, dst = round((c0 - s0) * ratio), round((c1 - c0) * ratio), round(c0 * ratio)
        if self.host is not None:
            if not isinstance(part, OffloadedTensor):
                raise RuntimeError("vae_chunking: bands disagree on whether an output is offloaded")
            self.host.copy_rows(-2, dst, part.host, top, rows)
        else:
            if isinstance(part, OffloadedTensor):
                part = part.load()
            assert self.t is not None
            self.t.narrow(-2, dst, rows).copy_(part.narrow(-2, top, rows))

    def result(self) -> Any:
        if self.host is not None:
            return OffloadedTensor.from_host(self.host, self.stream)
        return self.t


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


# ---------------------------------------------------------------------------- per unit
class SpatialChunkHook(ModelHook):
    """Run a unit over horizontal bands with halos, in passes for its group norms."""

    def __init__(self, chunks: int, halo: int) -> None:
        super().__init__()
        self.chunks = chunks
        self.halo = halo

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward = self.fn_ref.original_forward
        if _LOCAL.ctx is not None:
            return forward(*args, **kwargs)  # already inside a band (a chain, an outer unit)
        leaves, spec = tree_flatten((args, kwargs))
        x = next((t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 4), None)
        if x is None:
            return forward(*args, **kwargs)
        h, w = x.shape[-2], x.shape[-1]
        ratios = [_spatial_ratio(t, h, w) for t in leaves]
        bands = _Bands.plan(h, w, [r for r in ratios if r is not None], self.chunks, self.halo)
        if bands is None:
            return forward(*args, **kwargs)
        ctx = _BandContext()
        while True:
            outs: list[_Whole | None] | None = None
            out_spec = None
            collecting = False
            for c0, c1, s0, s1 in bands.bands:
                # conv caches waiting on the host come over one band at a time
                sub = [_cut(t, r, s0, s1) if r is not None else t for t, r in zip(leaves, ratios, strict=True)]
                sub_args, sub_kwargs = tree_unflatten(sub, spec)
                ctx.enter(c0, c1, s0, s1)
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
                if outs is None:
                    outs = [_Whole(t, s1 - s0, h) if _shape(t) is not None else None for t in part_leaves]
                for o, t in zip(outs, part_leaves, strict=True):
                    if o is not None:
                        o.write(t, c0, c1, s0, s1)
                del part_leaves
            if collecting:
                ctx.close_pass()
                continue
            if outs is None or out_spec is None:
                raise RuntimeError("vae_chunking: no band produced an output")
            return tree_unflatten([o.result() if o is not None else None for o in outs], out_spec)


# ---------------------------------------------------------------------------- chain
class _FreedTensor(torch.Tensor):
    """Stands in, in a re-run of the chain's parent, for a result computed before the chain
    that the first run had freed before the chain began: the parent can hand it on to calls
    that are replayed, but any computation on it fails loudly instead of computing garbage."""

    _QUERIES = frozenset({"shape", "dtype", "device", "ndim", "size", "dim", "is_cuda", "is_meta", "layout", "requires_grad"})

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", "")
        if name in cls._QUERIES:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            f"vae_chunking: the chain's parent computes {name or func} on a result of a call before the chain "
            "that had already been freed when the chain began; start the chain earlier or use per-unit chunking"
        )


@dataclass
class _Freed:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def stand_in(self) -> torch.Tensor:
        return placeholder(self.shape, self.dtype, self.device).as_subclass(_FreedTensor)


@dataclass
class _Memo:
    """A call the parent made before the chain, with its result (weakly held until the chain starts)."""

    module: nn.Module
    spec: Any
    leaves: list[Any]


_RECORD, _REPLAY, _CHAIN, _PASS = range(4)
_START, _ANCESTOR, _CONV, _OTHER = range(4)


class _ChainRun:
    """One call of the chain's parent, run band by band (see ``ChainChunkHook``)."""

    def __init__(self, hook: ChainChunkHook, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.hook = hook
        self.args, self.kwargs = args, kwargs
        # tensors that are whole in every band: the parent's inputs, replayed results
        self.whole: dict[int, Any] = {id(t): t for t in tree_flatten((args, kwargs))[0] if _shape(t) is not None}
        self.memo: list[_Memo] = []
        self.first = True
        self.mode = _RECORD
        self.depth = 0
        self.replay_at = 0
        self.band_index = 0
        self.started = False
        self.bands: _Bands | None = None
        self.ctx = _BandContext()
        self.need = 0.0  # receptive radius the band's convolutions needed, in chain-input rows

    # ------------------------------------------------------------------ driving the parent
    def execute(self) -> Any:
        forward = self.hook.fn_ref.original_forward
        outs: list[Any] | None = None
        out_spec = None
        collecting = False
        with self.intercepted():
            while True:
                self.mode = _RECORD if self.first else _REPLAY
                self.replay_at, self.depth, self.started, self.need = 0, 0, False, 0.0
                try:
                    out = forward(*self.args, **self.kwargs)
                except _StatsDone:
                    out, collecting = None, True
                finally:
                    _LOCAL.ctx = None
                self.first = False
                if self.bands is None:
                    return out  # the chain never started, or the map is too small to band
                if out is None and outs is not None:
                    raise RuntimeError("vae_chunking: bands of one chain disagree on their group norms")
                if out is not None:
                    if collecting:
                        raise RuntimeError("vae_chunking: bands of one chain disagree on their group norms")
                    if self.band_index == 0:
                        self.check_halo()
                    outs, out_spec = self.gather(outs, out)
                    del out
                self.band_index += 1
                if self.band_index < len(self.bands.bands):
                    continue
                self.band_index = 0
                if collecting:
                    self.ctx.close_pass()
                    collecting = False
                    continue
                if outs is None:
                    raise RuntimeError("vae_chunking: no band produced an output")
                return tree_unflatten([o.result() if isinstance(o, _Whole) else o for o in outs], out_spec)

    def gather(self, outs: list[Any] | None, out: Any) -> tuple[list[Any], Any]:
        """Write the band's own rows of each banded output; whole outputs pass through."""
        assert self.bands is not None
        c0, c1, s0, s1 = self.bands.bands[self.band_index]
        leaves, spec = tree_flatten(out)
        if outs is None:
            outs = [None] * len(leaves)
        for i, t in enumerate(leaves):
            shape = _shape(t)
            if shape is None or id(t) in self.whole:
                outs[i] = t
                continue
            if len(shape) < 2 or shape[-2] * self.bands.w != (s1 - s0) * shape[-1]:
                raise RuntimeError(
                    f"vae_chunking: the chain's parent returns a tensor of shape {tuple(shape)} computed in a band "
                    f"[{s0}, {s1}) of a {self.bands.h}x{self.bands.w} map that is not a band of a map"
                )
            if outs[i] is None:
                outs[i] = _Whole(t, s1 - s0, self.bands.h)
            outs[i].write(t, c0, c1, s0, s1)
        return outs, spec

    def check_halo(self) -> None:
        assert self.bands is not None
        if self.need > self.bands.halo + 1e-9 and len(self.bands.bands) > 1:
            raise RuntimeError(
                f"vae_chunking: the chain's convolutions need {self.need:.2f} rows of halo, {self.bands.halo} were "
                "given; pass halo= (rows of the chain's input) in VaeChunkingConfig"
            )

    # ------------------------------------------------------------------ intercepting calls
    @contextlib.contextmanager
    def intercepted(self) -> Iterator[None]:
        """Route every module call under the parent through ``call`` for the parent's call."""
        saved: list[tuple[nn.Module, Any]] = []
        try:
            for m, kind in self.hook.targets:
                saved.append((m, m.__dict__.get("forward")))
                m.forward = self.wrap(m, m.forward, kind)
            yield
        finally:
            for m, old in reversed(saved):
                if old is None:
                    del m.forward
                else:
                    m.forward = old

    def wrap(self, module: nn.Module, orig: Callable[..., Any], kind: int) -> Callable[..., Any]:
        def forward(*a: Any, **k: Any) -> Any:
            return self.call(module, orig, kind, a, k)

        return forward

    def call(self, module: nn.Module, orig: Callable[..., Any], kind: int, a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        if self.mode == _PASS:
            return orig(*a, **k)
        if self.mode == _CHAIN:
            if kind == _START:
                raise RuntimeError("vae_chunking: the chain's start runs twice in one call of its parent "
                                   "(e.g. serialization inside it); apply the other mitigation outside the chain")
            if self.depth == 0:
                a, k = self.cut(a, k)
            if kind == _CONV:
                self.measure(module, a)
            return self.nested(orig, a, k)
        if self.depth > 0:
            return orig(*a, **k)  # inside a call being recorded
        if kind == _START:
            return self.start(orig, a, k)
        if kind == _ANCESTOR:
            return orig(*a, **k)  # runs for real: its calls before the start are replayed
        return self.memoised(module, orig, a, k)

    def nested(self, orig: Callable[..., Any], a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        self.depth += 1
        try:
            return orig(*a, **k)
        finally:
            self.depth -= 1

    def memoised(self, module: nn.Module, orig: Callable[..., Any], a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        if self.mode == _RECORD:
            out = self.nested(orig, a, k)
            leaves, spec = tree_flatten(out)
            held = [(weakref.ref(t), _Freed(t.shape, t.dtype, t.device)) if isinstance(t, torch.Tensor) else t for t in leaves]
            self.memo.append(_Memo(module, spec, held))
            return out
        if self.replay_at >= len(self.memo) or self.memo[self.replay_at].module is not module:
            raise RuntimeError("vae_chunking: the chain's parent calls different modules before the chain in a re-run")
        entry = self.memo[self.replay_at]
        self.replay_at += 1
        return tree_unflatten([t.stand_in() if isinstance(t, _Freed) else t for t in entry.leaves], entry.spec)

    def freeze(self) -> None:
        """The chain starts for the first time: keep the recorded results still alive, let the
        freed ones go (a re-run gets a stand-in for them)."""
        for entry in self.memo:
            kept = []
            for t in entry.leaves:
                if isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], weakref.ref):
                    alive = t[0]()
                    t = alive if alive is not None else t[1]
                kept.append(t)
                if _shape(t) is not None:
                    self.whole[id(t)] = t
            entry.leaves = kept

    def start(self, orig: Callable[..., Any], a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        if self.started:
            raise RuntimeError("vae_chunking: the chain's start runs twice in one call of its parent")
        self.started = True
        if self.first:
            self.freeze()
            leaves = tree_flatten((a, k))[0]
            x = next((t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 4), None)
            if x is None:
                raise ValueError(f"vae_chunking: the chain start {type(self.hook.start).__name__} received no map")
            h, w = x.shape[-2], x.shape[-1]
            ratios = [r for t in self.whole.values() if (r := _spatial_ratio(t, h, w)) is not None]
            self.bands = _Bands.plan(h, w, ratios, self.hook.chunks, self.hook.halo)
            if self.bands is None:
                self.mode = _PASS
                return orig(*a, **k)
        assert self.bands is not None
        self.ctx.enter(*self.bands.bands[self.band_index])
        self.mode = _CHAIN
        a, k = self.cut(a, k)
        return self.nested(orig, a, k)

    def cut(self, a: tuple[Any, ...], k: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The band of every whole map among a call's arguments (band products pass as they are)."""
        assert self.bands is not None
        _, _, s0, s1 = self.bands.bands[self.band_index]
        leaves, spec = tree_flatten((a, k))
        out = []
        for t in leaves:
            r = _spatial_ratio(t, self.bands.h, self.bands.w) if id(t) in self.whole else None
            out.append(_cut(t, r, s0, s1) if r is not None else t)
        return tree_unflatten(out, spec)

    def measure(self, conv: nn.Module, a: tuple[Any, ...]) -> None:
        assert self.bands is not None
        x = next((t for t in a if isinstance(t, torch.Tensor)), None)
        _, _, s0, s1 = self.bands.bands[self.band_index]
        if x is None or x.ndim < 3:
            return
        scale = x.shape[-2] / (s1 - s0)
        self.need += conv.dilation[-2] * (conv.kernel_size[-2] // 2) / scale  # type: ignore[index,operator]


class ChainChunkHook(ModelHook):
    """On a chain's parent: run its forward once per band (and statistics pass), with its
    calls before the chain start replayed, the chain start and everything after it on the band.

    Args:
        start: the module where the chain starts (a descendant of the hooked parent).
        ancestors: modules between the parent and ``start`` (they run for real in each re-run).
        chunks: bands.
        halo: rows of context per side, in rows of the chain start's input.
    """

    def __init__(self, start: nn.Module, ancestors: list[nn.Module], chunks: int, halo: float) -> None:
        super().__init__()
        self.start = start
        self.ancestors = ancestors
        self.chunks = chunks
        self.halo = halo
        self.targets: list[tuple[nn.Module, int]] = []

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        anc = {id(m) for m in self.ancestors}
        for m in module.modules():
            if m is module or isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                continue
            kind = (_START if m is self.start else _ANCESTOR if id(m) in anc
                    else _CONV if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) else _OTHER)
            self.targets.append((m, kind))
        return module

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _LOCAL.ctx is not None or _LOCAL.chain is not None:
            return self.fn_ref.original_forward(*args, **kwargs)  # already inside a band
        run = _ChainRun(self, args, kwargs)
        _LOCAL.chain = run
        try:
            return run.execute()
        finally:
            _LOCAL.chain = None


def _is_upsampler(unit: nn.Module) -> bool:
    return "upsampl" in type(unit).__name__.lower()


def chain_modules(parent: nn.Module, start: nn.Module) -> list[nn.Module]:
    """``start`` and the outermost modules ``parent`` registers after it: what a chain
    ``PARENT[START:]`` runs, taking registration order for call order (a module registered
    after the start but called before it only makes the halo larger)."""
    out: list[nn.Module] = []
    taken: set[int] = set()
    seen = False
    for m in parent.modules():
        if m is start:
            seen = True
        if not seen or m is parent or isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            continue
        if id(m) in taken:
            continue
        out.append(m)
        taken.update(id(d) for d in m.modules())
    return out


def chain_radius(modules: list[nn.Module]) -> float:
    """Receptive radius of a chain in rows of its input: each unit's convolutions divided by
    the resolution gained from the upsamplers before it (an upsampler's own convolution is
    counted at its input resolution: exact for conv-then-shuffle, an over-count for
    interpolate-then-conv)."""
    scale, total = 1.0, 0.0
    for m in modules:
        for unit in chunk_units(m):
            total += receptive_radius(unit) / scale
            if _is_upsampler(unit):
                scale *= 2
    return total


def chain_paths(pipe: Any, path: str) -> list[str]:
    """Pipeline paths of the modules a chain ``PARENT[START:]`` runs (for estimates)."""
    parsed = parse_chain(path)
    if parsed is None:
        return [path]
    parent_path, start_path = parsed
    parent = resolve_module(pipe, parent_path)
    names = {id(m): n for n, m in parent.named_modules()}
    return [f"{parent_path}.{names[id(m)]}" for m in chain_modules(parent, resolve_module(parent, start_path))]


# ---------------------------------------------------------------------------- apply
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


def _hook_norms(handle: MitigationHandle, root: nn.Module) -> None:
    name = HOOK_NAMES["vae_chunk_norm"]
    for m in root.modules():
        if isinstance(m, nn.GroupNorm):
            registry = getattr(m, "_diffusers_hook", None)
            if registry is not None and registry.get_hook(name) is not None:
                continue
            hook_module(handle, m, GlobalGroupNormHook(), name)


def _apply_chain(pipe: Any, handle: MitigationHandle, parent_path: str, start_path: str, config: VaeChunkingConfig) -> nn.Module:
    parent = resolve_module(pipe, parent_path)
    start = resolve_module(parent, start_path)
    if isinstance(start, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(f"vae_chunking: chain start {start_path!r} is a container; "
                         f"name a module that runs (e.g. '{start_path}.0')")
    parts = start_path.split(".")
    ancestors = [resolve_module(parent, ".".join(parts[:i])) for i in range(1, len(parts))]
    halo = float(config.halo) if config.halo is not None else chain_radius(chain_modules(parent, start))
    hook_module(handle, parent, ChainChunkHook(start, ancestors, config.chunks, halo), HOOK_NAMES["vae_chain"])
    _hook_norms(handle, parent)
    return parent


def apply_vae_chunking(pipe: Any, config: VaeChunkingConfig) -> MitigationHandle:
    """Chunk every unit under ``config.modules`` (or each chain) into ``config.chunks`` bands.

    Args:
        pipe: the diffusers pipeline.
        config: where and how much.
    """
    if not config.modules:
        raise ValueError("vae_chunking: give at least one module path")
    handle = MitigationHandle("vae_chunking")
    if config.chunks == 1:
        return handle
    parents: list[tuple[str, nn.Module]] = []
    try:
        for path in config.modules:
            chain = parse_chain(path)
            if chain is not None:
                parent = _apply_chain(pipe, handle, chain[0], chain[1], config)
                for other_path, other in parents:
                    if any(m is parent for m in other.modules()) or any(m is other for m in parent.modules()):
                        raise ValueError(f"vae_chunking: chains {other_path!r} and {path!r} overlap; give one chain per parent")
                parents.append((path, parent))
                continue
            if "[" in path or "]" in path:
                raise ValueError(f"vae_chunking: {path!r} is neither a module path nor a chain 'PARENT[START:]'")
            for unit in chunk_units(resolve_module(pipe, path)):
                halo = config.halo if config.halo is not None else receptive_radius(unit)
                hook_module(handle, unit, SpatialChunkHook(config.chunks, halo), HOOK_NAMES["vae_chunk"])
                _hook_norms(handle, unit)
    except BaseException:
        handle.remove()
        raise
    return handle


def band_rows(height: int, chunks: int) -> int:
    """Rows per band for a map of ``height`` rows (for estimates)."""
    return math.ceil(height / max(1, chunks))
