"""Replayed DiT blocks: a transformer block called again with the same input signature makes the
same allocations and frees, so a shape-only trace needs to run each distinct block call once.

On the meta device a trace's time is the Python of the pipeline and one tracer dispatch per
operator. A DiT forward runs the same block class on the same shapes 28-60 times (LTX-2: 48 blocks
× 3 passes per step), so the first call of each *signature* is run and recorded as a relative
event pattern, and later calls append the same pattern to the trace without running the block:
allocations and frees in the recorded order, attributed to the same sub-modules of *this* block,
and outputs rebuilt as fresh meta tensors with the recorded sizes, strides and storage extents
(tracked like any allocation, so their later frees are seen as usual).

The signature is the block's class, its parameters' and buffers' shapes, strides and dtypes, its
attention processors (type and plain attributes, e.g. a query-chunked processor's chunk count),
the hooks on modules inside it (type and the attributes that fix what they allocate), the grad
mode, the state that hooks outside the block set for it (DiT chunking's chunk counts, which SDPA
is current), and every input leaf: tensors by device, shape, stride, dtype and storage offset
(plus which inputs share a storage), other values by type and value (anything else: not replayed).

Mitigation hooks: the replay wrapper is installed *beneath* the hooks on a block, so their
pre/post-forward (block offload's weight copies, HSDP's gathers, DiT chunking's state, a
serialized block's sub-batches) run for real on every call and only the block's own forward is
replayed. ``xema_ray.analyzer.replay_rules`` lists the hooks for which that is exact; a block
carrying any other hook (on itself or on a module inside it) always runs.

Exactness: a call is recorded only when it is self-contained. Replay is refused for a signature
whose recorded call freed a tensor made before it, left an allocation alive that is not one of
its outputs' storages, returned a tensor whose storage it did not allocate (other than returning
an input as it is), returned non-tensor values other than plain constants, or set a trace marker.
Only for the meta device (elsewhere values matter). The tests compare replayed and fully run
traces event for event, with and without mitigations.

The per-block part of the signature is computed once per trace, on the block's first call
(beneath its hooks, where offloaded or sharded weights are back, with the layout they come back
with on every call): mitigations are installed before a trace and never change during it.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from xema_ray.analyzer.tracer import _Record

if TYPE_CHECKING:
    from xema_ray.analyzer.tracer import AllocationTracer

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
class _Compiled:
    """A pattern's events for one block, ready to append: per local allocation a record row
    (nbytes, category, module, op, begin, end or -1 for an output, free module, holders) with event
    positions relative to the call; per event its kind and local allocation."""

    rows: list[tuple[int, int, int, int, int, int, int, int]]
    kinds: list[int]
    locals: list[int]


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
    # local allocations that own an output's storage, ascending
    outputs: list[int]
    # per block path: this pattern with module names interned (built on its first replay there)
    compiled: dict[str, _Compiled] = field(default_factory=dict)


_UNSEEN = object()  # a signature not recorded yet
_UNKEYED = object()  # a block whose per-block signature part cannot be described


class BlockReplay:
    """Record the first call of each block signature, replay later ones (see module docstring)."""

    def __init__(self, tracer: AllocationTracer, blocks: list[tuple[str, nn.Module]]) -> None:
        from xema_ray.analyzer import replay_rules as hooks  # which mitigation hooks replay is exact under

        self.tracer = tracer
        self.blocks = blocks
        self.patterns: dict[Any, _Pattern | None] = {}  # None: this signature is not replayable
        self._hooks = hooks
        self._ambient = hooks.ambient_signature
        self._inside: dict[int, tuple[Any, ...]] = {}  # id(block) -> its inner hooks' signature
        self._static: dict[int, Any] = {}  # id(block) -> its per-trace signature part
        self.replayed = 0
        self.replayed_hooked = 0  # of which: blocks carrying a mitigation's hook (on them or inside)
        self.recorded = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        undo: list[Callable[[], None]] = []
        try:
            for path, block in self.blocks:
                inside = self._hooks.inside_signature(block)
                if inside is None or not self._hooks.around_body_known(block):
                    continue  # a hook whose effect on the block is not known: the block runs
                self._inside[id(block)] = inside
                slot = self._hooks.body_slot(block)
                if slot is None:  # no hook on the block itself: its forward is the body
                    saved = block.__dict__.get("forward")
                    block.forward = self._wrap(path, block, block.forward, bool(inside))
                    undo.append(functools.partial(_restore_forward, block, saved))
                else:  # beneath the block's hooks, which keep running for real on every call
                    obj, attr = slot
                    body = getattr(obj, attr)
                    setattr(obj, attr, self._wrap(path, block, body, True))
                    undo.append(functools.partial(setattr, obj, attr, body))
            yield
        finally:
            for fn in reversed(undo):
                fn()

    def _wrap(self, path: str, block: nn.Module, orig: Any, hooked: bool) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.call(path, block, orig, args, kwargs, hooked)

        return forward

    # ------------------------------------------------------------------ signature
    def _static_key(self, block: nn.Module) -> Any:
        try:
            return (
                type(block),
                tuple((n, tuple(t.shape), t.stride(), t.dtype, t.device.type)
                      for n, t in [*block.named_parameters(), *block.named_buffers()]),
                # attention processors decide what attention allocates (a mitigation may swap them)
                tuple((n, _describe(p, 0)) for n, m in block.named_modules()
                      if (p := getattr(m, "processor", None)) is not None),
                self._inside[id(block)],
            )
        except _NoKey:
            return _UNKEYED

    def _key(self, block: nn.Module, leaves: list[Any], spec: Any) -> Any:
        static = self._static.get(id(block))
        if static is None:
            static = self._static[id(block)] = self._static_key(block)
        if static is _UNKEYED:
            raise _NoKey
        parts: list[Any] = []
        storages: dict[int, int] = {}
        for i, x in enumerate(leaves):
            cls = type(x)
            if cls is torch.Tensor or cls is nn.Parameter:
                parts.append((x.device.type, x.shape, x.stride(), x.dtype, x.storage_offset(),
                              storages.setdefault(id(x.untyped_storage()), i)))
            elif cls in _PLAIN:
                parts.append((cls, x))
            else:  # tensor subclasses and other objects
                raise _NoKey
        return (static, torch.is_grad_enabled(), self._ambient(), repr(spec), tuple(parts))

    # ------------------------------------------------------------------ call
    def call(self, path: str, block: nn.Module, orig: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             hooked: bool = False) -> Any:
        tracer = self.tracer
        if tracer._paused:
            return orig(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        try:
            key = self._key(block, leaves, spec)
        except _NoKey:
            return orig(*args, **kwargs)
        pattern = self.patterns.get(key, _UNSEEN)
        if pattern is None:
            return orig(*args, **kwargs)
        if pattern is not _UNSEEN:
            self.replayed += 1
            self.replayed_hooked += hooked
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
        return _Pattern(events=events, allocs=allocs, free_modules=free_modules, leaves=leaves, spec=spec,
                        outputs=sorted(owned))

    # ------------------------------------------------------------------ replay
    def _compile(self, path: str, p: _Pattern) -> _Compiled:
        """``p`` for the block at ``path``: module names interned in event order (the order a call
        running for real interns them in), one record row per allocation."""
        rows: list[list[int]] = []
        frees = iter(p.free_modules)
        ids: dict[str | None, int] = {}  # suffix -> interned index, interned on first use

        def module(suffix: str | None) -> int:
            i = ids.get(suffix)
            if i is None:
                i = ids[suffix] = self._module(path, suffix)
            return i

        for pos, (is_free, local) in enumerate(p.events):
            if is_free:
                row = rows[local]
                row[5], row[6], row[7] = pos, module(next(frees)), 0
            else:
                nbytes, category, suffix, op = p.allocs[local]
                rows.append([nbytes, category, module(suffix), op, pos, -1, -1, 1])
        return _Compiled(rows=[tuple(r) for r in rows], kinds=[int(f) for f, _ in p.events],  # type: ignore[misc]
                         locals=[a for _, a in p.events])

    def _replay(self, path: str, p: _Pattern, inputs: list[Any]) -> Any:
        tracer = self.tracer
        comp = p.compiled.get(path)
        if comp is None:
            comp = p.compiled[path] = self._compile(path, p)
        kinds = tracer._event_kind
        ev0, rec0 = len(kinds), len(tracer._records)
        # allocations are local 0..n-1 in event order; all but the outputs are freed inside the call
        tracer._records.extend([
            _Record(n, c, m, o, ev0 + b, ev0 + e if e >= 0 else -1, fm, h) for n, c, m, o, b, e, fm, h in comp.rows
        ])
        kinds.extend(comp.kinds)
        tracer._event_alloc.extend([rec0 + a for a in comp.locals])
        storages: dict[int, torch.UntypedStorage] = {}
        leaves: list[Any] = []
        with tracer.paused():
            for local in p.outputs:  # an output's storage is tracked like any allocation
                base = torch.empty(p.allocs[local][0], dtype=torch.uint8, device="meta")
                storages[local] = tracer.adopt(base, rec0 + local)
            for kind, body in p.leaves:
                if kind == "in":
                    leaves.append(inputs[body])
                elif kind == "const":
                    leaves.append(body)
                else:
                    t = torch.empty(0, dtype=body.dtype, device="meta")
                    leaves.append(t.set_(storages[body.local], body.offset, body.shape, body.stride))
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


_CALLABLES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


def _describe(obj: Any, depth: int) -> Any:
    """A hashable description of an attention processor: its type and, recursively, its plain
    attributes (a wrapped processor, a chunk count). Tensors, modules, functions: not describable."""
    cls = type(obj)
    if cls in _PLAIN:
        return (cls, obj)
    if depth > 3 or isinstance(obj, (torch.Tensor, nn.Module, *_CALLABLES)) or not hasattr(obj, "__dict__"):
        raise _NoKey
    return (cls, tuple((k, _describe(v, depth + 1)) for k, v in sorted(vars(obj).items())))


def _restore_forward(block: nn.Module, saved: Any) -> None:
    if saved is None:
        del block.forward
    else:
        block.forward = saved


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
