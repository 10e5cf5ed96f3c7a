"""Chain VAE chunking ``PARENT[START:]``: the hook on the parent, the modules a chain runs and
its receptive radius (the interpreter itself is ``chain_run``)."""

from __future__ import annotations

from typing import Any

from diffusers.hooks import ModelHook
from torch import nn

from xema_ray.mitigation.hooks import resolve_module
from xema_ray.mitigation.vae_chunking.bands import receptive_radius
from xema_ray.mitigation.vae_chunking.chain_run import ChainRun, ModuleRole
from xema_ray.mitigation.vae_chunking.config import parse_chain
from xema_ray.mitigation.vae_chunking.per_unit import chunk_units
from xema_ray.mitigation.vae_chunking.statistics import LOCAL


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
        self.targets: list[tuple[nn.Module, ModuleRole]] = []

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        anc = {id(m) for m in self.ancestors}
        for m in module.modules():
            if m is module or isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                continue
            kind = (ModuleRole.START if m is self.start else ModuleRole.ANCESTOR if id(m) in anc
                    else ModuleRole.CONV if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) else ModuleRole.OTHER)
            self.targets.append((m, kind))
        return module

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if LOCAL.ctx is not None or LOCAL.chain is not None:
            return self.fn_ref.original_forward(*args, **kwargs)  # already inside a band
        run = ChainRun(self, args, kwargs)
        LOCAL.chain = run
        try:
            return run.execute()
        finally:
            LOCAL.chain = None


def is_upsampler(unit: nn.Module) -> bool:
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
            if is_upsampler(unit):
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
