"""From a plan's ``Mitigation`` (xema_ray/plan.py) to an applied primitive.

``primitive_for`` turns the serialised form into the primitive's typed config; ``apply_mitigations``
installs a list of them on a pipeline and returns one handle that removes them all. What each
removes from each phase's peak, predicted without running anything, is the planner's business
(``planner.estimates.estimate_saving``); the analyzer measures it (``tracing``).

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
from typing import Any

import numpy as np

from xema_ray.memory.analysis import event_modules, unit_of
from xema_ray.memory.trace import MemoryTrace
from xema_ray.mitigation.activation_offload import ActivationOffloadConfig, apply_activation_offload
from xema_ray.mitigation.block_offload import BlockOffloadConfig, apply_block_offload
from xema_ray.mitigation.dit_chunking import DitChunkingConfig, apply_dit_chunking
from xema_ray.mitigation.hooks import MitigationHandle
from xema_ray.mitigation.hsdp import Collective, HSDPConfig, apply_hsdp
from xema_ray.mitigation.serialization import SerializationConfig, apply_serialization
from xema_ray.mitigation.vae_chunking import VaeChunkingConfig, apply_vae_chunking
from xema_ray.models import BuildOptions, ModelSpec
from xema_ray.plan import Mitigation

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


