"""``apply`` (the primitive's entry point) and ``apply_vae_chunking``: hooks per-unit and chain chunking
(and their group norms) on a pipeline."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torch import nn

from xema_ray.mitigation.hooks import (
    HOOK_NAMES,
    MitigationHandle,
    hook_module,
    resolve_module,
)
from xema_ray.mitigation.vae_chunking.bands import receptive_radius
from xema_ray.mitigation.vae_chunking.chain import (
    ChainChunkHook,
    chain_modules,
    chain_radius,
)
from xema_ray.mitigation.vae_chunking.config import VaeChunkingConfig, parse_chain
from xema_ray.mitigation.vae_chunking.per_unit import SpatialChunkHook, chunk_units
from xema_ray.mitigation.vae_chunking.statistics import GlobalGroupNormHook

if TYPE_CHECKING:
    from xema_ray.mitigation.hsdp import Collective
    from xema_ray.models import ModelSpec


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


def apply(pipe: Any, spec: ModelSpec, config: VaeChunkingConfig, comm: Collective | None = None) -> MitigationHandle:
    """The primitive's entry point: ``apply_vae_chunking`` on ``pipe`` (``spec`` and ``comm`` unused)."""
    return apply_vae_chunking(pipe, config)


def band_rows(height: int, chunks: int) -> int:
    """Rows per band for a map of ``height`` rows (for estimates)."""
    return math.ceil(height / max(1, chunks))
