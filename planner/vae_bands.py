"""What the planner knows about VAE chunking: the shapes it proposes and the bands they cut.

Stage 3 proposes the library's two VAE modes (``xema_ray.mitigation.vae_chunking``), mildest
shape first:

1. *per unit*: every unit (resnet, upsampler) of the up-blocks inside the pressure interval,
   plus the decoder's output norm and convolution, each over ``c`` bands of its own input;
2. *chain from the last upsampler* (``vae.decoder[up_blocks.I.upsamplers.0:]``): that
   upsampler and everything the decoder runs after it as one chain, so the upsampled map never
   exists whole; the lower up-blocks' units per unit;
3. *chain from the last upsampling up-block* (``vae.decoder[up_blocks.I:]``): the whole block
   and the rest of the decoder as one chain; the lower up-blocks per unit.

The memory model shrinks, inside each run of a unit's (or the chain's) events, what lies above
the run's entry level by the *effective* band count: a band is ``ceil(rows / c)`` rows plus a
halo of the receptive radius on both sides, so at high ``c`` a band is much more than a
``c``-th of the map (not optimistic: 2 x halo rows are counted even where a band touches the
border). ``rows`` is the map height at the unit's (chain's) input: the output height halved
once per upsampler from there on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from torch import nn

from xema_ray.mitigation.hooks import resolve_module
from xema_ray.mitigation.vae_chunking import (
    chain_modules,
    chain_radius,
    chunk_units,
    parse_chain,
    receptive_radius,
)
from xema_ray.templates import RequestTemplate

DECODER = "vae.decoder"


@dataclass(frozen=True)
class BandGroup:
    """Module paths whose events form one run per call, and the divisor of what lies above
    the run's entry level."""

    paths: tuple[str, ...]
    divisor: float
    #: for a chain: its parent and the start's ancestors below it, whose own events (glue,
    #: frees when they return) inside the chain's span belong to the chain's run
    glue: tuple[str, ...] | None = None


def _is_upsampler(m: nn.Module) -> bool:
    return "upsampl" in type(m).__name__.lower()


@dataclass
class VaeLayout:
    """The decoder of one template's meta pipeline, as the planner needs it."""

    template: RequestTemplate
    pipe: Any

    @cached_property
    def decoder(self) -> nn.Module | None:
        try:
            return resolve_module(self.pipe, DECODER)
        except (AttributeError, ValueError, KeyError):
            return None

    @cached_property
    def _names(self) -> dict[int, str]:
        return {id(m): f"{DECODER}.{n}" for n, m in self.decoder.named_modules() if n} if self.decoder is not None else {}

    @cached_property
    def up_blocks(self) -> list[nn.Module]:
        ups = getattr(self.decoder, "up_blocks", None)
        return list(ups) if isinstance(ups, nn.ModuleList) else []

    @cached_property
    def _units_in_order(self) -> list[nn.Module]:
        """Every chunk unit the decoder registers, in order (resnets, upsamplers, tail modules)."""
        if self.decoder is None:
            return []
        out: list[nn.Module] = []
        for b in self.up_blocks:
            out += chunk_units(b)
        return out

    def _upsamplers_from(self, unit: nn.Module) -> int:
        """Upsamplers the decoder runs from ``unit`` on (itself included)."""
        units = self._units_in_order
        at = next((i for i, u in enumerate(units) if u is unit), len(units))
        return sum(1 for u in units[at:] if _is_upsampler(u))

    def _rows(self, upsamplers_after: int) -> int:
        return max(1, self.template.height // (2 ** upsamplers_after))

    @staticmethod
    def _divisor(rows: int, chunks: int, halo: float) -> float:
        band = math.ceil(rows / max(1, chunks)) + 2 * math.ceil(halo)
        return max(1.0, rows / min(rows, band))

    def tail(self) -> list[str]:
        """The decoder's output norm and convolution, where it has them."""
        return [f"{DECODER}.{n}" for n in ("norm_out", "conv_out") if isinstance(getattr(self.decoder, n, None), nn.Module)]

    def groups(self, modules: tuple[str, ...], chunks: int) -> list[BandGroup]:
        """One ``BandGroup`` per chunk unit of the per-unit paths and one per chain."""
        out: list[BandGroup] = []
        in_chains: set[int] = set()
        for path in modules:
            chain = parse_chain(path)
            if chain is not None:
                parent = resolve_module(self.pipe, chain[0])
                in_chains.update(id(d) for m in chain_modules(parent, resolve_module(parent, chain[1])) for d in m.modules())
        for path in modules:
            chain = parse_chain(path)
            if chain is not None:
                parent = resolve_module(self.pipe, chain[0])
                start = resolve_module(parent, chain[1])
                mods = chain_modules(parent, start)
                names = {id(m): f"{chain[0]}.{n}" for n, m in parent.named_modules() if n}
                paths = tuple(names[id(m)] for m in mods)
                rows = self._rows(sum(1 for m in mods for u in chunk_units(m) if _is_upsampler(u)))
                parts = chain[1].split(".")
                glue = (chain[0], *(f"{chain[0]}.{'.'.join(parts[:i])}" for i in range(1, len(parts))))
                out.append(BandGroup(paths, self._divisor(rows, chunks, chain_radius(mods)), glue=glue))
                continue
            try:
                root = resolve_module(self.pipe, path)
            except (AttributeError, ValueError, KeyError):
                out.append(BandGroup((path,), float(chunks)))
                continue
            for unit in chunk_units(root):
                if id(unit) in in_chains:
                    continue  # the chain bands it already
                name = self._names.get(id(unit), path)
                rows = self._rows(self._upsamplers_from(unit))
                out.append(BandGroup((name,), self._divisor(rows, chunks, receptive_radius(unit))))
        return out

    def shapes(self, interval_ups: list[str]) -> list[tuple[str, tuple[str, ...]]]:
        """(label, modules) of the VAE chunking shapes for an interval, mildest first."""
        ups = interval_ups or [f"{DECODER}.up_blocks.{i}" for i in range(len(self.up_blocks))]
        out = [("units", (*ups, *self.tail()))]
        with_up = [i for i, b in enumerate(self.up_blocks) if isinstance(getattr(b, "upsamplers", None), nn.ModuleList)
                   and len(b.upsamplers) > 0]
        if not with_up or self.decoder is None:
            return out
        last = with_up[-1]
        lower = [u for u in ups if _index(u) is not None and _index(u) <= last]  # type: ignore[operator]
        below = [u for u in lower if _index(u) < last]  # type: ignore[operator]
        out.append(("chain_upsampler", (*lower, f"{DECODER}[up_blocks.{last}.upsamplers.0:]")))
        out.append(("chain_block", (*below, f"{DECODER}[up_blocks.{last}:]")))
        return out


def _index(path: str) -> int | None:
    tail = path.removeprefix(f"{DECODER}.up_blocks.")
    return int(tail) if tail.isdigit() else None
