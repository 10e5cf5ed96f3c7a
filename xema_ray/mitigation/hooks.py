"""Machinery shared by every mitigation primitive (shaped like ``diffusers.hooks``).

Each primitive lives in its own file with a pydantic ``XConfig``, one or more ``XHook``
(``diffusers.hooks.ModelHook``) and a public ``apply_x`` that returns a ``MitigationHandle``;
``handle.remove()`` detaches every hook and restores weights and state, so the pipeline is
exactly as before. Hooks are registered under names from ``HOOK_NAMES`` on diffusers'
per-module ``HookRegistry``, so they compose with diffusers' own hooks.

Where a tensor lives (host copies, placeholders, the compute device) is ``xema_ray.placement``:
models and mitigation both use it, and neither imports the other.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

HOOK_NAMES = {
    "block_offload": "xema_block_offload",
    "block_offload_first": "xema_block_offload_first",
    "hsdp": "xema_hsdp",
    "hsdp_first": "xema_hsdp_first",
    "conv_cache_offload": "xema_conv_cache_offload",
    "input_offload": "xema_input_offload",
    "dit_chunk_tokens": "xema_dit_chunk_tokens",
    "dit_chunk_block": "xema_dit_chunk_block",
    "vae_chunk": "xema_vae_chunk",
    "vae_chunk_norm": "xema_vae_chunk_norm",
    "vae_chain": "xema_vae_chain",
    "serialize": "xema_serialize",
    "expert_swap": "xema_expert_swap",
    "expert_swap_block": "xema_expert_swap_block",
    "step_cache": "xema_step_cache",
}


# ---------------------------------------------------------------------------- hook registry
def register_hook(module: nn.Module, hook: ModelHook, name: str) -> None:
    """Attach ``hook`` to ``module`` under ``name`` (ValueError if one is already there)."""
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)


def remove_hook(module: nn.Module, name: str) -> None:
    """Detach the hook ``name`` from ``module`` only (not from its children); restores forward."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None:
        registry.remove_hook(name, recurse=False)


@dataclass
class MitigationHandle:
    """An applied primitive: ``remove()`` undoes it (idempotent)."""

    kind: str
    _undo: list[Callable[[], None]] = field(default_factory=list)
    removed: bool = False
    #: device tensors the primitive keeps that no module owns (HSDP shards): the analyzer
    #: registers them as resident weights
    resident: dict[str, torch.Tensor] = field(default_factory=dict)

    def add_undo(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def remove(self) -> None:
        if self.removed:
            return
        # undo in reverse order: later steps (hooks) may depend on earlier ones (sharded weights)
        for fn in reversed(self._undo):
            fn()
        self._undo.clear()
        self.removed = True

    def __enter__(self) -> MitigationHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def hook_module(handle: MitigationHandle, module: nn.Module, hook: ModelHook, name: str) -> None:
    """Register ``hook`` and record its removal on ``handle``."""
    register_hook(module, hook, name)
    handle.add_undo(lambda: remove_hook(module, name))


def resolve_module(root: Any, path: str) -> nn.Module:
    """``root.<path>`` for a pipeline or module, e.g. ``vae.decoder.up_blocks.3``; ValueError
    naming the missing component otherwise."""
    obj = root
    for part in path.split("."):
        nxt = obj[int(part)] if part.isdigit() and isinstance(obj, (nn.ModuleList, nn.Sequential)) else getattr(obj, part, None)
        if nxt is None:
            raise ValueError(f"module path {path!r}: {type(obj).__name__} has no {part!r}")
        obj = nxt
    if not isinstance(obj, nn.Module):
        raise ValueError(f"module path {path!r} names a {type(obj).__name__}, not an nn.Module")
    return obj


def check_blocks(kind: str, blocks: tuple[int, ...], n_blocks: int) -> None:
    bad = [b for b in blocks if not 0 <= b < n_blocks]
    if bad:
        raise ValueError(f"{kind}: block indices {bad} out of range; the model has {n_blocks} DiT blocks")
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"{kind}: block indices must be distinct, got {list(blocks)}")


class ChunkedHook(ModelHook):
    """Base for hooks that replace a module's forward by a chunked one (``new_forward``)."""

    @abstractmethod
    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any: ...
