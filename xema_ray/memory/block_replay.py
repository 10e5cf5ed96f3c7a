"""Replayed DiT blocks: a transformer block called again with the same input signature makes the
same allocations and frees, so a shape-only trace needs to run each distinct block call once.

On the meta device a trace's time is the Python of the pipeline and one tracer dispatch per
operator. A DiT forward runs the same block class on the same shapes 28-60 times (LTX-2: 48 blocks
× 3 passes per step), so the first call of each *signature* is run and recorded as a relative
event pattern, and later calls append the same pattern to the trace without running the block:
allocations and frees in the recorded order, attributed to the same sub-modules of *this* block,
and outputs rebuilt as fresh meta tensors with the recorded sizes, strides and storage extents
(tracked like any allocation, so their later frees are seen as usual).

The signature is the block's class, its parameters' and buffers' shapes and dtypes, its
attention processors' types, the grad mode, and every input leaf: tensors by device, shape, stride, dtype and storage offset (plus
which inputs share a storage), other values by type and value (anything else: not replayed).

Exactness: a call is recorded only when it is self-contained. Replay is refused for a signature
whose recorded call freed a tensor made before it, left an allocation alive that is not one of
its outputs' storages, returned a tensor whose storage it did not allocate (other than returning
an input as it is), returned non-tensor values other than plain constants, or set a trace marker;
a block carrying a hook (a mitigation) is never replayed. Only for the meta device (elsewhere
values matter). The tests compare replayed and fully run traces event for event.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from xema_ray.memory.tracer import AllocationTracer

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


class _NoKey(Exception):
    """An input the signature cannot stand for."""


@dataclass(frozen=True)
class _Output:
    """One tensor output: the pattern's allocation owning its storage, and its view."""

    local: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Pattern:
    """The events one block call made, relative to the call."""

    # per event: (is_free, local allocation index)
    events: list[tuple[bool, int]]
    # per local allocation: (nbytes, category, module suffix, op index)
    allocs: list[tuple[int, int, str | None, int]]
    # per free event (in order): module suffix running then
    free_modules: list[str | None]
    # output leaves: ("in", input leaf index) | ("out", _Output) | ("const", value)
    leaves: list[tuple[str, Any]]
    spec: Any


class BlockReplay:
    """Record the first call of each block signature, replay later ones (see module docstring)."""

    def __init__(self, tracer: AllocationTracer, blocks: list[tuple[str, nn.Module]]) -> None:
        self.tracer = tracer
        self.blocks = blocks
        self.patterns: dict[Any, _Pattern | None] = {}  # None: this signature is not replayable
        self._param_keys: dict[int, tuple[Any, ...]] = {}
        self.replayed = 0
        self.recorded = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved = []
        try:
            for path, block in self.blocks:
                if _hooked(block):
                    continue  # a mitigation's hook: its work depends on which block this is
                saved.append((block, block.__dict__.get("forward")))
                block.forward = self._wrap(path, block, block.forward)
            yield
        finally:
            for block, old in reversed(saved):
                if old is None:
                    del block.forward
                else:
                    block.forward = old

    def _wrap(self, path: str, block: nn.Module, orig: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.call(path, block, orig, args, kwargs)

        return forward

    # ------------------------------------------------------------------ signature
    def _key(self, block: nn.Module, leaves: list[Any], spec: Any) -> Any:
        pk = self._param_keys.get(id(block))
        if pk is None:
            pk = self._param_keys[id(block)] = (
                tuple((n, tuple(t.shape), t.dtype, t.device.type)
                      for n, t in [*block.named_parameters(), *block.named_buffers()]),
                # attention processors decide what attention allocates (a mitigation may swap them)
                tuple((n, type(getattr(m, "processor", None))) for n, m in block.named_modules()),
            )
        parts: list[Any] = []
        storages: dict[int, int] = {}
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if type(x) is not torch.Tensor and type(x) is not nn.Parameter:
                    raise _NoKey
                sid = id(x.untyped_storage())
                parts.append((x.device.type, tuple(x.shape), x.stride(), x.dtype, x.storage_offset(),
                              storages.setdefault(sid, i)))
            elif type(x) in _PLAIN:
                parts.append((type(x), x))
            else:
                raise _NoKey
        return (type(block), pk, torch.is_grad_enabled(), repr(spec), tuple(parts))

    # ------------------------------------------------------------------ call
    def call(self, path: str, block: nn.Module, orig: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tracer = self.tracer
        if tracer._paused:
            return orig(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        try:
            key = self._key(block, leaves, spec)
        except _NoKey:
            return orig(*args, **kwargs)
        if key in self.patterns:
            pattern = self.patterns[key]
            if pattern is None:
                return orig(*args, **kwargs)
            self.replayed += 1
            return self._replay(path, pattern, leaves)
        ev0, rec0, marks0 = len(tracer._event_kind), len(tracer._records), len(tracer._markers)
        out = orig(*args, **kwargs)
        self.patterns[key] = self._record(path, leaves, out, ev0, rec0, marks0)
        self.recorded += 1
        return out

    def _record(self, path: str, inputs: list[Any], out: Any, ev0: int, rec0: int, marks0: int) -> _Pattern | None:
        tracer = self.tracer
        if len(tracer._markers) != marks0:
            return None
        records = tracer._records
        events: list[tuple[bool, int]] = []
        free_modules: list[str | None] = []
        for kind, a in zip(tracer._event_kind[ev0:], tracer._event_alloc[ev0:], strict=True):
            if a < rec0:
                return None  # frees (or aliases) a tensor made before the call
            events.append((kind != 0, a - rec0))
            if kind != 0:
                free_modules.append(self._suffix(path, records[a].free_module))
        allocs = [(r.nbytes, r.category, self._suffix(path, r.module), r.op) for r in records[rec0:]]
        if any(r.holders != 1 and r.end < 0 for r in records[rec0:]):
            return None
        leaves_out, spec = tree_flatten(out)
        leaves: list[tuple[str, Any]] = []
        owned: set[int] = set()
        for t in leaves_out:
            if isinstance(t, torch.Tensor):
                same = next((i for i, x in enumerate(inputs) if x is t), None)
                if same is not None:
                    leaves.append(("in", same))
                    continue
                if type(t) is not torch.Tensor or t.device.type != "meta":
                    return None
                hit = tracer._live.get(id(t.untyped_storage()))
                if hit is None or hit[0]() is not t.untyped_storage() or hit[1] < rec0:
                    return None
                owned.add(hit[1] - rec0)
                leaves.append(("out", _Output(hit[1] - rec0, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())))
            elif type(t) in _PLAIN:
                leaves.append(("const", t))
            else:
                return None
        alive = {i for i, r in enumerate(records[rec0:]) if r.end < 0}
        if alive != owned:
            return None  # an allocation outlives the call without being an output
        for i in owned:  # an output storage is never freed inside the call
            if records[rec0 + i].nbytes != allocs[i][0]:
                return None
        return _Pattern(events=events, allocs=allocs, free_modules=free_modules, leaves=leaves, spec=spec)

    def _replay(self, path: str, p: _Pattern, inputs: list[Any]) -> Any:
        tracer = self.tracer
        from xema_ray.memory.tracer import ALLOC, FREE, _Record

        outputs: dict[int, list[_Output]] = {}
        for kind, body in p.leaves:
            if kind == "out":
                outputs.setdefault(body.local, []).append(body)
        made: dict[int, torch.Tensor] = {}  # local -> a tensor on the rebuilt storage
        rec_of: dict[int, int] = {}
        frees = iter(p.free_modules)
        for is_free, local in p.events:
            if is_free:
                rec = tracer._records[rec_of[local]]
                rec.holders = 0
                rec.end = len(tracer._event_kind)
                rec.free_module = self._module(path, next(frees))
                tracer._event_kind.append(FREE)
                tracer._event_alloc.append(rec_of[local])
                continue
            nbytes, category, module, op = p.allocs[local]
            if local in outputs:
                with tracer.paused():
                    base = torch.empty(nbytes, dtype=torch.uint8, device="meta")
                rec_of[local] = len(tracer._records)
                tracer._track(base, self._module(path, module), op, category)
                made[local] = base
            else:
                rec_of[local] = len(tracer._records)
                tracer._records.append(_Record(nbytes=nbytes, category=category, module=self._module(path, module),
                                               op=op, begin=len(tracer._event_kind)))
                tracer._event_kind.append(ALLOC)
                tracer._event_alloc.append(rec_of[local])
        leaves: list[Any] = []
        with tracer.paused():
            for kind, body in p.leaves:
                if kind == "in":
                    leaves.append(inputs[body])
                elif kind == "const":
                    leaves.append(body)
                else:
                    storage = made[body.local].untyped_storage()
                    t = torch.empty(0, dtype=body.dtype, device="meta")
                    leaves.append(t.set_(storage, body.offset, body.shape, body.stride))
        made.clear()
        return tree_unflatten(leaves, p.spec)

    # ------------------------------------------------------------------ module names
    def _suffix(self, path: str, module: int) -> str | None:
        """A module index as a name relative to the block ("" = the block itself), or the
        absolute name prefixed by "=" when it lies outside the block; None for no module."""
        if module < 0:
            return None
        name = self.tracer._modules[module]
        if name == path:
            return ""
        if name.startswith(path + "."):
            return name[len(path):]
        return "=" + name

    def _module(self, path: str, suffix: str | None) -> int:
        if suffix is None:
            return -1
        name = suffix[1:] if suffix.startswith("=") else path + suffix
        return self.tracer._intern(self.tracer._modules, self.tracer._module_index, name)


def _hooked(block: nn.Module) -> bool:
    return any(getattr(m, "_diffusers_hook", None) is not None for m in block.modules())


def transformer_blocks(pipe: Any, names: dict[int, str]) -> list[tuple[str, nn.Module]]:
    """The DiT's blocks: the modules of every ``nn.ModuleList`` directly under the transformer
    whose name says it holds blocks (``transformer_blocks``, ``single_transformer_blocks``)."""
    out = []
    transformer = getattr(pipe, "transformer", None)
    if not isinstance(transformer, nn.Module):
        return out
    for attr, child in transformer.named_children():
        if isinstance(child, nn.ModuleList) and attr.endswith("blocks"):
            out += [(names.get(id(b), f"transformer.{attr}.{i}"), b) for i, b in enumerate(child)]
    return out
