"""From a plan's ``Mitigation`` (xema_ray/plan.py) to an applied primitive, and to its estimate.

``primitive_for`` turns the serialised form into the primitive's typed config; ``apply_mitigations``
installs a list of them on a pipeline and returns one handle that removes them all;
``estimate_saving`` predicts, without running anything, what each removes from each phase's peak.

Location and intensity per kind (``Mitigation`` docs): blocks for block_offload / hsdp /
dit_chunking (and temporary_serialization of single blocks), module paths for
activation_offload / vae_chunking / temporary_serialization, or an event range of the
template's baseline trace, mapped here to the units (blocks, up-blocks) running inside it.
A vae_chunking path may be a chain ``PARENT[START:]`` (``vae.decoder[up_blocks.2:]``: START and
all PARENT runs after it banded as one, see ``vae_chunking``); per-unit paths and chains mix
in one list, all with the same bands.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from xema_ray.memory.analysis import event_modules, phase_group, unit_of
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.mitigation.activation_offload import ActivationOffloadConfig, apply_activation_offload
from xema_ray.mitigation.block_offload import (
    BlockOffloadConfig,
    apply_block_offload,
    block_bytes,
    estimate_block_offload,
)
from xema_ray.mitigation.dit_chunking import DitChunkingConfig, apply_dit_chunking, estimate_dit_chunking
from xema_ray.mitigation.hooks import MemorySaving, MitigationHandle
from xema_ray.mitigation.hsdp import Collective, HSDPConfig, apply_hsdp, estimate_hsdp
from xema_ray.mitigation.serialization import SerializationConfig, apply_serialization, estimate_serialization
from xema_ray.mitigation.vae_chunking import VaeChunkingConfig, apply_vae_chunking, chain_paths, parse_chain
from xema_ray.models import BuildOptions, ModelSpec
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate

PrimitiveConfig = (
    BlockOffloadConfig | HSDPConfig | ActivationOffloadConfig | DitChunkingConfig | VaeChunkingConfig | SerializationConfig
)


def events_to_modules(trace: MemoryTrace, events: tuple[int, int]) -> tuple[str, ...]:
    """The mitigation units (e.g. ``transformer.transformer_blocks.3``) running in ``[start, stop)``."""
    start, stop = events
    if not 0 <= start < stop <= trace.n_events:
        raise ValueError(f"event range {events} outside the trace's {trace.n_events} events")
    mods = event_modules(trace)[start:stop]
    units: list[str] = []
    for m in np.unique(mods[mods >= 0]):
        u = unit_of(trace.modules[m])
        if u not in units:
            units.append(u)
    return tuple(units)


def _block_index(spec: ModelSpec, transformer: Any, path: str) -> int | None:
    rel = path.removeprefix("transformer.")
    for i, (p, _) in enumerate(spec.dit_blocks(transformer)):
        if p == rel:
            return i
    return None


def primitive_for(m: Mitigation, spec: ModelSpec, pipe: Any, trace: MemoryTrace | None = None) -> PrimitiveConfig:
    """The typed config of ``m`` for ``spec``'s pipeline ``pipe``.

    Args:
        m: the serialised mitigation.
        spec: the model.
        pipe: its pipeline (block paths are resolved against ``pipe.transformer``).
        trace: the baseline trace, needed only when ``m`` is located by an event range.

    Example:
        >>> from xema_ray.models import get_model_spec
        >>> spec = get_model_spec("tiny-flux2")
        >>> pipe = spec.build_pipeline(BuildOptions(device="meta"))
        >>> primitive_for(Mitigation(kind="dit_chunking", blocks=(0, 1), intensity=4), spec, pipe)
        DitChunkingConfig(blocks=(0, 1), chunks=4, parts=('ff', 'qk_norm', 'rotary'))
    """
    modules = m.modules
    blocks = m.blocks
    if m.events is not None:
        if trace is None:
            raise ValueError(f"{m.kind}: located by events {m.events}; pass the baseline trace to map them to modules")
        modules = events_to_modules(trace, m.events)
        if m.kind in ("block_offload", "hsdp", "dit_chunking"):
            found = [_block_index(spec, pipe.transformer, u) for u in modules]
            blocks = tuple(i for i in found if i is not None)
            modules = None
            if not blocks:
                raise ValueError(f"{m.kind}: no DiT block runs in events {m.events}")
    if m.kind in ("block_offload", "hsdp", "dit_chunking") and blocks is None:
        raise ValueError(f"{m.kind} is located by DiT block indices, got modules {modules}")
    if m.kind == "block_offload":
        return BlockOffloadConfig(blocks=tuple(blocks or ()))
    if m.kind == "hsdp":
        return HSDPConfig(blocks=tuple(blocks or ()))
    if m.kind == "dit_chunking":
        return DitChunkingConfig(blocks=tuple(blocks or ()), chunks=m.intensity)
    paths = modules if modules is not None else tuple(
        f"transformer.{spec.dit_blocks(pipe.transformer)[b][0]}" for b in (blocks or ())
    )
    if m.kind == "activation_offload":
        return ActivationOffloadConfig(modules=paths, max_tensors=m.intensity)
    if m.kind == "vae_chunking":
        return VaeChunkingConfig(modules=paths, chunks=m.intensity)
    if m.kind == "temporary_serialization":
        return SerializationConfig(modules=paths, sub_batches=m.intensity)
    raise ValueError(f"unknown mitigation kind {m.kind!r}")


def apply_config(config: PrimitiveConfig, spec: ModelSpec, pipe: Any, comm: Collective | None = None) -> MitigationHandle:
    """Install one primitive. ``comm`` is the process group for HSDP (``ShapeOnlyGroup`` to analyse)."""
    if isinstance(config, BlockOffloadConfig):
        return apply_block_offload(pipe.transformer, spec.dit_blocks(pipe.transformer), config)
    if isinstance(config, HSDPConfig):
        if comm is None:
            raise ValueError("hsdp needs a process group (comm)")
        return apply_hsdp(pipe.transformer, spec.dit_blocks(pipe.transformer), config, comm)
    if isinstance(config, DitChunkingConfig):
        return apply_dit_chunking(spec.dit_blocks(pipe.transformer), config)
    if isinstance(config, ActivationOffloadConfig):
        return apply_activation_offload(pipe, config)
    if isinstance(config, VaeChunkingConfig):
        return apply_vae_chunking(pipe, config)
    return apply_serialization(pipe, config)


@dataclass
class AppliedMitigations:
    """Several applied primitives; ``remove()`` undoes them in reverse order."""

    handles: list[MitigationHandle] = field(default_factory=list)

    def remove(self) -> None:
        for h in reversed(self.handles):
            h.remove()
        self.handles.clear()

    def __enter__(self) -> AppliedMitigations:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_mitigations(
    pipe: Any, spec: ModelSpec, mitigations: Sequence[Mitigation], comm: Collective | None = None,
    trace: MemoryTrace | None = None,
) -> AppliedMitigations:
    """Install ``mitigations`` (a plan's list) on ``pipe``; the result removes them all.

    Example:
        >>> from xema_ray.models import get_model_spec
        >>> spec = get_model_spec("tiny-flux2")
        >>> pipe = spec.build_pipeline(BuildOptions())
        >>> with apply_mitigations(pipe, spec, [Mitigation(kind="block_offload", blocks=(1,), intensity=1)]):
        ...     pass
    """
    applied = AppliedMitigations()
    try:
        for m in mitigations:
            applied.handles.append(apply_config(primitive_for(m, spec, pipe, trace), spec, pipe, comm))
    except BaseException:
        applied.remove()
        raise
    return applied


# ---------------------------------------------------------------------------- estimates
@cache
def _meta_pipeline(model: str) -> Any:
    from xema_ray.models import get_model_spec
    from xema_ray.memory.analyzer import default_dtype_for

    spec = get_model_spec(model)
    return spec.build_pipeline(BuildOptions(device="meta", dtype=default_dtype_for(spec)))


def dit_block_bytes(model: str) -> list[int]:
    """Weight bytes of each DiT block at the model's analysis dtype (built on meta, no weights)."""
    from xema_ray.models import get_model_spec

    pipe = _meta_pipeline(model)
    return block_bytes(get_model_spec(model).dit_blocks(pipe.transformer))


def _live_at_phase_peak(trace: MemoryTrace, group: str) -> tuple[int, np.ndarray] | None:
    """(peak event, mask of activations live there) for the highest event of a phase group."""
    curve = trace.active_curve()
    from xema_ray.memory.analysis import event_phases

    ph = event_phases(trace)
    sel = np.flatnonzero(np.isin(ph, [i for i, n in enumerate(trace.phases) if phase_group(n) == group]))
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
        b = batch if batch is not None else template.batch * (2 if spec.default_guidance_scale > 1 and spec.family != "flux2" else 1)
        elem = 2 if spec.size == "real" else 4
        return estimate_dit_chunking(tokens, b, hidden, mult, elem, DitChunkingConfig(blocks=m.blocks or (0,), chunks=m.intensity))
    if baseline is None:
        raise ValueError(f"{m.kind}: the estimate reads the baseline trace; pass baseline=")
    paths = m.modules if m.modules is not None else events_to_modules(baseline, m.events) if m.events else ()
    group = "dit" if any(p.startswith("transformer") for p in paths) else "vae"
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
        chained = baseline.size[live & in_chain & ~clone]
        unit = np.sort(baseline.size[mine & ~in_chain & ~clone])[::-1]
        shrink = unit[2:].sum() if len(unit) > 2 else 0
        saved = int((chained.sum() + shrink) * fraction)
        return MemorySaving(kind=m.kind, per_phase={group: saved},
                            note=f"{len(chained)} activations of chains, {len(unit)} of chunked units")
    b = batch if batch is not None else 2 * template.batch
    return estimate_serialization(int(baseline.size[mine].sum()), b, m.intensity, group)
