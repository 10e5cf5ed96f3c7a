"""The planner's analytic memory estimates of the mitigation primitives (moved here from
``xema_ray.mitigation``, which applies primitives and depends only on torch, diffusers and the
plan schema; issue #16).

``estimate_saving(m, template, baseline)`` predicts, without running anything, what a plan's
``Mitigation`` removes from each phase's peak; the per-primitive estimates
(``estimate_block_offload``, ``estimate_hsdp``, ``estimate_dit_chunking``,
``estimate_serialization``) work from sizes alone. The analyzer confirms by tracing
(``xema_ray.analyzer.mitigated.trace_with_mitigations``), and the planner's search uses the
event-by-event transform of ``planner.memory_model``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.mitigation.block_offload import BlockOffloadConfig
from xema_ray.mitigation.dit_chunking import DitChunkingConfig
from xema_ray.mitigation.hooks import check_blocks
from xema_ray.mitigation.hsdp import HSDPConfig
from xema_ray.mitigation.registry import events_to_modules
from xema_ray.mitigation.vae_chunking import chain_paths, parse_chain
from xema_ray.models import BuildOptions
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import Phase, PhaseKeyed, phase_of_trace


class MemorySaving(BaseModel):
    """What a mitigation is predicted to remove from each phase's peak, in bytes (analytic;
    the analyzer confirms by tracing), by ``Phase``: DENOISE, DECODE, TEXT (before the first step)."""

    model_config = ConfigDict(frozen=True)

    kind: str
    per_phase: PhaseKeyed[int] = Field(description="phase -> bytes removed from that phase's peak")
    note: str = Field(default="", description="how the number was derived")

    def at(self, phase: Phase) -> int:
        return self.per_phase.get(phase, 0)



def evenly_spread(k: int, n: int) -> tuple[int, ...]:
    """K of N block indices spread evenly (§5.1: the overlap window between two mitigated
    blocks is then ~N/K blocks). ``evenly_spread(4, 8) == (0, 2, 4, 6)``."""
    if not 0 <= k <= n:
        raise ValueError(f"cannot choose {k} of {n} blocks")
    return tuple(sorted({(i * n) // k for i in range(k)})) if k else ()



def block_bytes(blocks: list[tuple[str, nn.Module]]) -> list[int]:
    """Weight bytes per block (parameters + buffers)."""
    return [sum(t.numel() * t.element_size() for t in [*b.parameters(), *b.buffers()]) for _, b in blocks]


def estimate_block_offload(sizes: list[int], config: BlockOffloadConfig) -> MemorySaving:
    """Bytes removed from each phase's peak: outside the DiT all K blocks are on the host; in
    the DiT the running block and (with prefetch) the next offloaded one are on the device, so
    the saving there is the K blocks minus the largest such pair.

    Example:
        >>> estimate_block_offload([10, 10, 10, 10], BlockOffloadConfig(blocks=(0, 2))).per_phase
        {'denoise': 0, 'decode': 20, 'text': 20}
    """
    check_blocks("block_offload", config.blocks, len(sizes))
    order = sorted(config.blocks)
    total = sum(sizes[i] for i in order)
    if not order:
        return MemorySaving(kind="block_offload", per_phase={Phase.DENOISE: 0, Phase.DECODE: 0, Phase.TEXT: 0})
    if config.prefetch and len(order) > 1:
        in_flight = max(sizes[a] + sizes[b] for a, b in zip(order, order[1:], strict=False))
    else:
        in_flight = max(sizes[i] for i in order)
    return MemorySaving(
        kind="block_offload",
        per_phase={Phase.DENOISE: total - in_flight, Phase.DECODE: total, Phase.TEXT: total},
        note=f"{len(order)} blocks, {total} B on host; {in_flight} B in flight at most during the DiT",
    )

def estimate_hsdp(sizes: list[int], config: HSDPConfig, world_size: int) -> MemorySaving:
    """Each sharded block keeps 1/W resident; in the DiT up to two are gathered at once.

    Example:
        >>> estimate_hsdp([8, 8, 8, 8], HSDPConfig(blocks=(0, 2)), 2).per_phase
        {'denoise': -8, 'decode': 8, 'text': 8}
    """
    check_blocks("hsdp", config.blocks, len(sizes))
    if world_size < 2:
        raise ValueError(f"hsdp needs world_size >= 2, got {world_size}")
    order = sorted(config.blocks)
    saved = sum(sizes[i] - sizes[i] // world_size for i in order)
    if not order:
        return MemorySaving(kind="hsdp", per_phase={Phase.DENOISE: 0, Phase.DECODE: 0, Phase.TEXT: 0})
    if config.prefetch and len(order) > 1:
        in_flight = max(sizes[a] + sizes[b] for a, b in zip(order, order[1:], strict=False))
    else:
        in_flight = max(sizes[i] for i in order)
    return MemorySaving(
        kind="hsdp",
        per_phase={Phase.DENOISE: saved - in_flight, Phase.DECODE: saved, Phase.TEXT: saved},
        note=f"{len(order)} blocks sharded {world_size} ways; up to {in_flight} B gathered during the DiT",
    )

def estimate_dit_chunking(tokens: int, batch: int, hidden: int, ff_mult: float, elem: int, config: DitChunkingConfig) -> MemorySaving:
    """Saving at a chosen block's peak: the feed-forward's widest intermediate (``ff_mult``
    times the hidden width; the activation makes a second one) or, where the attention
    pre-processing peaks, the rotary fp32 temporaries (two fp32 copies of q or k), shrunk to
    one chunk. Reported as the larger of the two, since they are not live together.

    Example:
        >>> estimate_dit_chunking(1000, 1, 8, 4.0, 2, DitChunkingConfig(blocks=(0,), chunks=4)).per_phase
        {'denoise': 96000}
    """
    keep = 1.0 / config.chunks
    ff = 2 * tokens * batch * hidden * ff_mult * elem if "ff" in config.parts else 0.0
    rot = 2 * tokens * batch * hidden * 4 if "rotary" in config.parts else 0.0
    saved = int(max(ff, rot) * (1 - keep)) if config.blocks else 0
    return MemorySaving(kind="dit_chunking", per_phase={Phase.DENOISE: saved},
                        note=f"{config.chunks} chunks over {tokens * batch} tokens")

def estimate_serialization(batch_activation_bytes: int, batch: int, sub_batches: int, phase: Phase) -> MemorySaving:
    """Activations proportional to the batch shrink to one part's share.

    Args:
        batch_activation_bytes: activation bytes live at the segment's peak (from the baseline
            trace) that scale with the batch.
        batch: the module's batch (requests x CFG).
        sub_batches: parts.
        phase: the phase the segment is in (``Phase.DENOISE`` or ``Phase.DECODE``).

    Example:
        >>> estimate_serialization(100, 2, 2, Phase.DENOISE).per_phase
        {'denoise': 50}
    """
    n = min(sub_batches, batch)
    per_part = -(-batch // n)
    saved = batch_activation_bytes - batch_activation_bytes * per_part // batch
    return MemorySaving(kind="temporary_serialization", per_phase={phase: saved},
                        note=f"batch {batch} in {n} parts of <= {per_part}")

# ---------------------------------------------------------------------------- a plan Mitigation
@cache
def _meta_pipeline(model: str) -> Any:
    from xema_ray.models import get_model_spec
    from xema_ray.analyzer.run import default_dtype_for

    spec = get_model_spec(model)
    return spec.build_pipeline(BuildOptions(device="meta", dtype=default_dtype_for(spec)))


def dit_block_bytes(model: str) -> list[int]:
    """Weight bytes of each DiT block at the model's analysis dtype (built on meta, no weights)."""
    from xema_ray.models import get_model_spec

    pipe = _meta_pipeline(model)
    return block_bytes(get_model_spec(model).dit_blocks(pipe.transformer))


def _live_at_phase_peak(trace: MemoryTrace, group: Phase) -> tuple[int, np.ndarray] | None:
    """(peak event, mask of activations live there) for the highest event of a phase."""
    curve = trace.active_curve()
    from xema_ray.memory.analysis import event_phases

    ph = event_phases(trace)
    sel = np.flatnonzero(np.isin(ph, [i for i, n in enumerate(trace.phases) if phase_of_trace(n) == group]))
    if len(sel) == 0:
        return None
    e = int(sel[np.argmax(curve[sel])])
    live = (trace.begin <= e) & (trace.end > e) & (trace.category == Category.ACTIVATION)
    return e, live


def _under(trace: MemoryTrace, paths: Sequence[str]) -> np.ndarray:
    names = np.array([any(n == p or n.startswith(p + ".") for p in paths) for n in trace.modules] + [False])
    return names[trace.module]  # module == -1 indexes the trailing False


def _clones(trace: MemoryTrace) -> np.ndarray:
    return np.array([o == "clone" for o in trace.ops] + [False])[trace.op]


def conv_cache_allocations(trace: MemoryTrace, paths: Sequence[str]) -> np.ndarray:
    """Mask of the allocations that are conv caches of modules under ``paths``: the causal
    convolutions' caches are the clones they return (what activation offload moves)."""
    return _under(trace, paths) & _clones(trace)


def estimate_saving(
    m: Mitigation, template: RequestTemplate, baseline: MemoryTrace | None = None, world_size: int = 2,
    batch: int | None = None,
) -> MemorySaving:
    """What ``m`` removes from each phase's peak, without running it.

    Weight primitives are exact from the parameter sizes. Activation primitives are estimated
    from the *baseline* trace (the planner's stage-2 trace): the activations of the targeted
    modules live at the phase peak, shrunk by the primitive's factor. The analyzer confirms
    with ``trace_with_mitigations``.

    Args:
        m: the mitigation.
        template: the request template (its batch, or ``batch``, sizes the activations).
        baseline: the unmitigated trace (required for activation primitives).
        world_size: HSDP group size.
        batch: the batch the DiT runs (requests x CFG); default: read from the template.
    """
    spec = template.spec
    if m.kind in ("block_offload", "hsdp"):
        if m.blocks is None:
            raise ValueError(f"{m.kind}: the estimate needs block indices")
        sizes = dit_block_bytes(spec.name)
        if m.kind == "block_offload":
            return estimate_block_offload(sizes, BlockOffloadConfig(blocks=m.blocks))
        return estimate_hsdp(sizes, HSDPConfig(blocks=m.blocks), world_size)
    if m.kind == "dit_chunking":
        cfg = spec.transformer_config
        hidden = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
        tokens = sum(template.token_counts().values())
        mult = float(cfg.get("mlp_ratio", 4.0))
        b = batch if batch is not None else template.batch * (2 if spec.runs_guidance() else 1)
        elem = 2 if spec.size == "real" else 4
        return estimate_dit_chunking(tokens, b, hidden, mult, elem, DitChunkingConfig(blocks=m.blocks or (0,), chunks=m.intensity))
    if baseline is None:
        raise ValueError(f"{m.kind}: the estimate reads the baseline trace; pass baseline=")
    paths = m.modules if m.modules is not None else events_to_modules(baseline, m.events) if m.events else ()
    group = Phase.DENOISE if any(p.startswith("transformer") for p in paths) else Phase.DECODE
    found = _live_at_phase_peak(baseline, group)
    if found is None:
        return MemorySaving(kind=m.kind, per_phase={}, note=f"no {group} phase in the trace")
    _, live = found
    mine = live & _under(baseline, paths)
    clone = _clones(baseline)
    if m.kind == "activation_offload":
        sel = live & conv_cache_allocations(baseline, paths)
        sizes = np.sort(baseline.size[sel])[::-1][: m.intensity]
        # the cache of the convolution running at the peak is back on the device
        saved = int(sizes.sum() - (sizes.max() if len(sizes) else 0))
        return MemorySaving(kind=m.kind, per_phase={group: saved}, note=f"{len(sizes)} conv caches live at the {group} peak")
    if m.kind == "vae_chunking":
        # a chain: every map its modules allocate exists one band at a time (its input was
        # allocated before it, its final output is small); per unit: the unit's input and
        # output stay whole, the temporaries between shrink to one band. Halos count as one
        # more band. Conv caches (clones) are activation offload's to estimate.
        chains = [p for p in paths if parse_chain(p) is not None]
        pipe = _meta_pipeline(spec.name) if chains else None
        in_chain = _under(baseline, [q for p in chains for q in chain_paths(pipe, p)]) if chains else np.zeros_like(mine)
        fraction = 1 - min(1.0, 2.0 / m.intensity)
        # a chain's bands are widened by its halo (summed receptive radii: at 32+ bands a band is
        # far more than a 32nd of the map), and its last module's output (the decoded frames)
        # stays whole: without both the estimate was optimistic (30.5 vs 43.4 GB traced at 4K)
        chain_fraction = fraction
        if chains:
            from planner.vae_bands import VaeLayout

            groups = [g for g in VaeLayout(template, pipe).groups(tuple(chains), m.intensity) if g.glue is not None]
            chain_fraction = 1 - 1 / min((g.divisor for g in groups), default=float(m.intensity))
            last = [g.paths[-1] for g in groups]
            in_chain &= ~_under(baseline, last)
        chained = baseline.size[live & in_chain & ~clone]
        unit = np.sort(baseline.size[mine & ~in_chain & ~clone])[::-1]
        shrink = unit[2:].sum() if len(unit) > 2 else 0
        saved = int(chained.sum() * chain_fraction + shrink * fraction)
        return MemorySaving(kind=m.kind, per_phase={group: saved},
                            note=f"{len(chained)} activations of chains, {len(unit)} of chunked units")
    b = batch if batch is not None else 2 * template.batch
    return estimate_serialization(int(baseline.size[mine].sum()), b, m.intensity, group)
