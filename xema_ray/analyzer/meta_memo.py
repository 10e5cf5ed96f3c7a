"""Memoised meta kernels: the same operator on the same input metadata gives the same output
metadata, so a shape-only trace needs to run each distinct (operator, input signature) once.

On the meta device most of a trace's time goes into PyTorch's Python meta functions and
reference decompositions (``torch._refs``/``torch._prims``: broadcasting, type promotion,
stride propagation) — ~150 µs per operator call on LTX-2. A diffusion request calls the same
few hundred signatures over and over (every block of every pass of every step), so the tracer
runs the real meta kernel on a signature's first call and afterwards only allocates outputs
with the recorded sizes and strides.

Exactness: only operators that cannot alias or mutate (no alias annotation on any argument or
return) and plain in-place operators (write their first argument, return it; on meta they only
check shapes) are memoised, only when every tensor argument is a plain meta tensor and every other
argument is a plain value, and only when each output is a fresh storage of exactly its own
extent (offset 0, no output sharing a storage with another output or an input). Everything else — views, in-place and ``out=``
ops, tensor subclasses, CPU tensors, ops with odd outputs — runs the real kernel every time.
The tests check that memoised and unmemoised traces are identical event for event.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

_PLAIN_VALUE_TYPES = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))


class _Unmemoisable(Exception):
    """An argument or output that the memo cannot stand for exactly."""


def _arg_key(x: Any) -> Any:
    """A hashable stand-in for an argument that fixes everything a meta kernel can read from it
    (called ~10 times per operator: type dispatch first, the cheap checks only where needed)."""
    cls = type(x)
    if cls is torch.Tensor or cls is nn.Parameter:
        if not x.is_meta or (x.dtype.is_complex and (x.is_conj() or x.is_neg())):
            raise _Unmemoisable
        return (x.shape, x.stride(), x.dtype)
    if cls in _PLAIN_VALUE_TYPES:
        # the type is part of the key: 1, 1.0 and True hash equal but promote differently
        return (cls, x)
    if cls is tuple or cls is list:
        if all(type(v) is int for v in x):  # a size or dim list: (cls, int, values) never equals the general form
            return (cls, int, tuple(x))
        return (cls, tuple(map(_arg_key, x)))
    if cls is dict:
        return (dict, tuple(sorted((k, _arg_key(v)) for k, v in x.items())))
    raise _Unmemoisable


def _args_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``_arg_key`` of a positional-argument tuple, element by element (the common tensor and
    plain cases inline: this runs for every operator)."""
    parts = []
    for x in args:
        cls = type(x)
        if cls is torch.Tensor or cls is nn.Parameter:
            dtype = x.dtype
            if not x.is_meta or (dtype.is_complex and (x.is_conj() or x.is_neg())):
                raise _Unmemoisable
            parts.append((x.shape, x.stride(), dtype))
        elif cls in _PLAIN_VALUE_TYPES:
            parts.append((cls, x))
        else:
            parts.append(_arg_key(x))
    return tuple(parts)


FUNCTIONAL, IN_PLACE, OTHER = 0, 1, 2


def _kind(func: torch._ops.OpOverload) -> int:
    """FUNCTIONAL: aliases nothing; IN_PLACE: writes its first argument only and returns it
    (``add_``, ``addcmul_``); OTHER: views, ``out=`` variants, anything else."""
    schema = func._schema
    args, rets = schema.arguments, schema.returns
    if not any(a.alias_info is not None for a in args) and not any(r.alias_info is not None for r in rets):
        return FUNCTIONAL
    if (
        args
        and args[0].alias_info is not None
        and args[0].alias_info.is_write
        and not any(a.alias_info is not None for a in args[1:])
        and len(rets) == 1
        and rets[0].alias_info is not None
        and rets[0].alias_info.before_set == args[0].alias_info.before_set
    ):
        return IN_PLACE
    return OTHER


def _fresh_spec(t: Any, seen: set[int]) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]:
    """The metadata that recreates output ``t`` exactly, if it owns its whole storage."""
    if type(t) is not torch.Tensor or t.device.type != "meta" or t.storage_offset() != 0:
        raise _Unmemoisable
    storage = t.untyped_storage()
    if id(storage) in seen:
        raise _Unmemoisable
    seen.add(id(storage))
    shape, stride = tuple(t.shape), t.stride()
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) if all(shape) else 0
    if storage.nbytes() != extent * t.element_size():
        raise _Unmemoisable
    return shape, stride, t.dtype


class MetaKernelMemo:
    """``call(func, args, kwargs)`` = ``func(*args, **kwargs)``, memoised where that is exact."""

    def __init__(self) -> None:
        self._kinds: dict[torch._ops.OpOverload, int] = {}
        self._outputs: dict[tuple[Any, ...], Any] = {}
        self.hits = 0
        self.misses = 0

    def call(self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind(func)
        if kind == OTHER:
            return func(*args, **kwargs)
        try:
            key = (func, _args_key(args), _arg_key(kwargs) if kwargs else None)
        except _Unmemoisable:
            return func(*args, **kwargs)
        spec = self._outputs.get(key)
        if spec is not None:
            self.hits += 1
            # an in-place op on meta only checks its arguments, which it did for this signature
            return args[0] if spec is _SELF else _rebuild(spec)
        self.misses += 1
        if kind == IN_PLACE:
            before = (tuple(args[0].shape), args[0].stride())
            out = func(*args, **kwargs)
            # ``resize_``-like ops change their argument's metadata: those run every time
            if out is args[0] and (tuple(out.shape), out.stride()) == before:
                self._outputs[key] = _SELF
            return out
        out = func(*args, **kwargs)
        try:
            # an output sharing an input's storage (``_unsafe_view`` declares no alias) is not fresh
            seen = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if isinstance(out, torch.Tensor):
                self._outputs[key] = ("T", _fresh_spec(out, seen))
            elif type(out) in (tuple, list) and out and all(isinstance(o, torch.Tensor) for o in out):
                self._outputs[key] = (type(out), tuple(_fresh_spec(o, seen) for o in out))
        except _Unmemoisable:
            pass
        return out


_SELF = ("self", None)


def _empty(spec: tuple[tuple[int, ...], tuple[int, ...], torch.dtype]) -> torch.Tensor:
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _rebuild(spec: tuple[Any, Any]) -> Any:
    kind, body = spec
    if kind == "T":
        return _empty(body)
    return kind(_empty(s) for s in body)
