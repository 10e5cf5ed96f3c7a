"""What DiT block replay (``xema_ray.analyzer.block_replay``) may assume about the mitigation hooks.

Block replay runs a block's own forward (its *body*) once per signature and replays the recorded
allocations on later calls. The replay wrapper is installed *beneath* the hooks on the block itself,
so their ``pre_forward`` / ``post_forward`` / ``new_forward`` (weight copies, all-gathers, chunking
state, sub-batches) still run for real on every call; only the body is replayed. That is exact only
for hooks whose effect on the body is known, listed here:

- ``AROUND_BODY``: hook types that may sit on a block. Each changes what the body allocates only
  through (a) the arguments it passes (part of the signature), (b) the block's parameters, which it
  brings back with the same shapes, dtypes and strides on every call (block offload: fresh copies;
  HSDP: views into the gathered buffer), and (c) the chunking state that ``ambient_signature``
  reads (``DitChunkBlockHook``).
- ``INSIDE_BODY``: hook types that may sit on a module inside a block, with the attributes that fix
  what they allocate: the same inputs and attributes give the same allocations (they keep no state
  across calls).

Any other hook (an unknown type, or a known one where it is not listed: e.g. block offload on a
sub-module, whose prefetch depends on the next block) makes the block run for real.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch.nn.functional as F
from diffusers.hooks import ModelHook
from torch import nn

from xema_ray.mitigation.activation_offload import ReusedInputOffloadHook
from xema_ray.mitigation.block_offload import BlockOffloadHook
from xema_ray.mitigation.dit_chunking import _STATE, DitChunkBlockHook, TokenChunkHook, _ChunkedSDPA
from xema_ray.mitigation.hsdp import HSDPHook
from xema_ray.mitigation.serialization import SerializationHook

AROUND_BODY: tuple[type[ModelHook], ...] = (
    BlockOffloadHook, HSDPHook, DitChunkBlockHook, SerializationHook, ReusedInputOffloadHook,
)
INSIDE_BODY: dict[type[ModelHook], tuple[str, ...]] = {
    TokenChunkHook: ("chunks",),
    SerializationHook: ("sub_batches",),
}


def module_hooks(module: nn.Module) -> list[tuple[str, ModelHook]] | None:
    """``(name, hook)`` of the diffusers hooks on ``module`` itself, in registration order (empty
    when none is, or all were removed); None when its registry is not shaped as expected."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None:
        return []
    order, hooks = getattr(registry, "_hook_order", None), getattr(registry, "hooks", None)
    refs = getattr(registry, "_fn_refs", None)
    if not isinstance(order, list) or not isinstance(hooks, dict) or not isinstance(refs, list) or len(refs) != len(order):
        return None
    return [(name, hooks[name]) for name in order]


def around_body_known(block: nn.Module) -> bool:
    """Every hook on ``block`` itself acts only around its body (``AROUND_BODY``)."""
    hooks = module_hooks(block)
    return hooks is not None and all(type(h) in AROUND_BODY for _, h in hooks)


def inside_signature(block: nn.Module) -> tuple[Hashable, ...] | None:
    """What the hooks on modules inside ``block`` change about its allocations: per hooked module
    (relative name, hook name, hook type, its ``INSIDE_BODY`` attributes); None when one of them is
    not known to be replay-safe."""
    parts: list[Hashable] = []
    for name, sub in block.named_modules():
        if not name:
            continue
        hooks = module_hooks(sub)
        if hooks is None:
            return None
        for hook_name, hook in hooks:
            attrs = INSIDE_BODY.get(type(hook))
            if attrs is None:
                return None
            values = tuple(getattr(hook, a) for a in attrs)
            if not all(type(v) in (int, float, bool, str, type(None)) for v in values):
                return None
            parts.append((name, hook_name, type(hook), values))
    return tuple(parts)


def body_slot(block: nn.Module) -> tuple[Any, str] | None:
    """Where the block's body is called from beneath its own hooks: ``(object, attribute)`` whose
    callable is the body (the first hook's ``forward``, or its ``original_forward`` when that hook
    replaces the forward); None when the block carries no hook (its ``forward`` is the body)."""
    registry = getattr(block, "_diffusers_hook", None)
    refs = getattr(registry, "_fn_refs", None) if registry is not None else None
    if not refs:
        return None
    first = refs[0]
    return (first, "original_forward") if first.original_forward is not None else (first, "forward")


def ambient_signature() -> tuple[Hashable, ...]:
    """The state a block's body reads that hooks outside it set: DiT chunking's rotary and attention
    chunk counts (``DitChunkBlockHook`` sets them while its block runs) and which SDPA is current
    (the chunked wrapper, described by what it wraps, or the function itself)."""
    sdpa = F.scaled_dot_product_attention
    current: Hashable = (_ChunkedSDPA, sdpa.sdpa) if isinstance(sdpa, _ChunkedSDPA) else sdpa
    return (_STATE.chunks, _STATE.attention, current)
