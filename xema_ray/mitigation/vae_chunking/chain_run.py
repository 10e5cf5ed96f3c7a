"""The chain interpreter: one call of a chain's parent run band by band.

The parent's forward is re-run once per band (and per statistics pass). Calls it makes before
the chain start are recorded on the first run and replayed afterwards (results the first run had
freed before the start get a stand-in that refuses computation); the chain start and every call
after it run on the band, with whole maps cut to the band; the band's own rows of each output
are written into whole outputs (``bands.WholeOutput``)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from xema_ray.placement import placeholder
from xema_ray.mitigation.vae_chunking.bands import (
    Bands,
    WholeOutput,
    cut_rows,
    map_shape,
    spatial_ratio,
)
from xema_ray.mitigation.vae_chunking.statistics import LOCAL, BandContext, StatsDone

if TYPE_CHECKING:
    from xema_ray.mitigation.vae_chunking.chain import ChainChunkHook


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




class ChainMode(Enum):
    """What a call under the chain's parent does in the current run of the parent."""

    RECORD = auto()  # first run, before the chain start: run calls and keep their results
    REPLAY = auto()  # later runs, before the chain start: hand back the kept results
    CHAIN = auto()  # from the chain start on: calls run on the band
    PASS = auto()  # the map is too small to band: everything runs as it is


class ModuleRole(Enum):
    """A module's place under the chain's parent."""

    START = auto()  # where the chain starts
    ANCESTOR = auto()  # between the parent and the start: runs for real in every re-run
    CONV = auto()  # a convolution: its radius is measured on the first band
    OTHER = auto()


class ChainRun:
    """One call of the chain's parent, run band by band (see ``ChainChunkHook``)."""

    def __init__(self, hook: ChainChunkHook, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.hook = hook
        self.args, self.kwargs = args, kwargs
        # tensors that are whole in every band: the parent's inputs, replayed results
        self.whole: dict[int, Any] = {id(t): t for t in tree_flatten((args, kwargs))[0] if map_shape(t) is not None}
        self.memo: list[_Memo] = []
        self.first = True
        self.mode = ChainMode.RECORD
        self.depth = 0
        self.replay_at = 0
        self.band_index = 0
        self.started = False
        self.bands: Bands | None = None
        self.ctx = BandContext()
        self.need = 0.0  # receptive radius the band's convolutions needed, in chain-input rows

    # ------------------------------------------------------------------ driving the parent
    def execute(self) -> Any:
        forward = self.hook.fn_ref.original_forward
        outs: list[Any] | None = None
        out_spec = None
        collecting = False
        with self.intercepted():
            while True:
                self.mode = ChainMode.RECORD if self.first else ChainMode.REPLAY
                self.replay_at, self.depth, self.started, self.need = 0, 0, False, 0.0
                try:
                    out = forward(*self.args, **self.kwargs)
                except StatsDone:
                    out, collecting = None, True
                finally:
                    LOCAL.ctx = None
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
                return tree_unflatten([o.result() if isinstance(o, WholeOutput) else o for o in outs], out_spec)

    def gather(self, outs: list[Any] | None, out: Any) -> tuple[list[Any], Any]:
        """Write the band's own rows of each banded output; whole outputs pass through."""
        assert self.bands is not None
        c0, c1, s0, s1 = self.bands.bands[self.band_index]
        leaves, spec = tree_flatten(out)
        if outs is None:
            outs = [None] * len(leaves)
        for i, t in enumerate(leaves):
            shape = map_shape(t)
            if shape is None or id(t) in self.whole:
                outs[i] = t
                continue
            if len(shape) < 2 or shape[-2] * self.bands.w != (s1 - s0) * shape[-1]:
                raise RuntimeError(
                    f"vae_chunking: the chain's parent returns a tensor of shape {tuple(shape)} computed in a band "
                    f"[{s0}, {s1}) of a {self.bands.h}x{self.bands.w} map that is not a band of a map"
                )
            if outs[i] is None:
                outs[i] = WholeOutput(t, s1 - s0, self.bands.h)
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

    def wrap(self, module: nn.Module, orig: Callable[..., Any], kind: ModuleRole) -> Callable[..., Any]:
        def forward(*a: Any, **k: Any) -> Any:
            return self.call(module, orig, kind, a, k)

        return forward

    def call(self, module: nn.Module, orig: Callable[..., Any], kind: ModuleRole, a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        if self.mode is ChainMode.PASS:
            return orig(*a, **k)
        if self.mode is ChainMode.CHAIN:
            if kind is ModuleRole.START:
                raise RuntimeError("vae_chunking: the chain's start runs twice in one call of its parent "
                                   "(e.g. serialization inside it); apply the other mitigation outside the chain")
            if self.depth == 0:
                a, k = self.cut(a, k)
            if kind is ModuleRole.CONV:
                self.measure(module, a)
            return self.nested(orig, a, k)
        if self.depth > 0:
            return orig(*a, **k)  # inside a call being recorded
        if kind is ModuleRole.START:
            return self.start(orig, a, k)
        if kind is ModuleRole.ANCESTOR:
            return orig(*a, **k)  # runs for real: its calls before the start are replayed
        return self.memoised(module, orig, a, k)

    def nested(self, orig: Callable[..., Any], a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        self.depth += 1
        try:
            return orig(*a, **k)
        finally:
            self.depth -= 1

    def memoised(self, module: nn.Module, orig: Callable[..., Any], a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        if self.mode is ChainMode.RECORD:
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
                if map_shape(t) is not None:
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
            ratios = [r for t in self.whole.values() if (r := spatial_ratio(t, h, w)) is not None]
            self.bands = Bands.plan(h, w, ratios, self.hook.chunks, self.hook.halo)
            if self.bands is None:
                self.mode = ChainMode.PASS
                return orig(*a, **k)
        assert self.bands is not None
        self.ctx.enter(*self.bands.bands[self.band_index])
        self.mode = ChainMode.CHAIN
        a, k = self.cut(a, k)
        return self.nested(orig, a, k)

    def cut(self, a: tuple[Any, ...], k: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The band of every whole map among a call's arguments (band products pass as they are)."""
        assert self.bands is not None
        _, _, s0, s1 = self.bands.bands[self.band_index]
        leaves, spec = tree_flatten((a, k))
        out = []
        for t in leaves:
            r = spatial_ratio(t, self.bands.h, self.bands.w) if id(t) in self.whole else None
            out.append(cut_rows(t, r, s0, s1) if r is not None else t)
        return tree_unflatten(out, spec)

    def measure(self, conv: nn.Module, a: tuple[Any, ...]) -> None:
        assert self.bands is not None
        x = next((t for t in a if isinstance(t, torch.Tensor)), None)
        _, _, s0, s1 = self.bands.bands[self.band_index]
        if x is None or x.ndim < 3:
            return
        scale = x.shape[-2] / (s1 - s0)
        self.need += conv.dilation[-2] * (conv.kernel_size[-2] // 2) / scale  # type: ignore[index,operator]
