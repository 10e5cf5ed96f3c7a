"""From a plan's ``Mitigation`` (xema_ray/plan.py) to an applied primitive.

``primitive_for`` turns the serialised form into the primitive's typed config; ``apply_config`` installs
one through its module's ``apply(pipe, spec, config, comm)`` (``PRIMITIVES``: config type -> entry
point, the one signature every primitive has); ``apply_mitigations`` installs a list of them on a
pipeline and returns one handle that removes them all. What each
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xema_ray.memory.analysis import event_modules, unit_of
from xema_ray.memory.trace import MemoryTrace
from xema_ray.mitigation import activation_offload, block_offload, dit_chunking, hsdp, serialization, step_cache, vae_chunking
from xema_ray.mitigation.activation_offload import ActivationOffloadConfig
from xema_ray.mitigation.block_offload import BlockOffloadConfig
from xema_ray.mitigation.dit_chunking import DitChunkingConfig
from xema_ray.mitigation.hooks import MitigationHandle
from xema_ray.mitigation.hsdp import Collective, HSDPConfig
from xema_ray.mitigation.serialization import SerializationConfig
from xema_ray.mitigation.step_cache import StepCacheConfig
from xema_ray.mitigation.vae_chunking import VaeChunkingConfig
from xema_ray.models import BuildOptions, ModelSpec
from xema_ray.plan import Mitigation

PrimitiveConfig = (
    BlockOffloadConfig | HSDPConfig | ActivationOffloadConfig | DitChunkingConfig | VaeChunkingConfig | SerializationConfig
    | StepCacheConfig
)
#: a primitive's entry point: ``apply(pipe, spec, config, comm)`` -> the handle that removes it
Apply = Callable[[Any, ModelSpec, Any, Collective | None], MitigationHandle]

#: config type -> its primitive's entry point (one row per module; a new primitive adds its row)
PRIMITIVES: dict[type, Apply] = {
    BlockOffloadConfig: block_offload.apply,
    HSDPConfig: hsdp.apply,
    DitChunkingConfig: dit_chunking.apply,
    ActivationOffloadConfig: activation_offload.apply,
    VaeChunkingConfig: vae_chunking.apply,
    SerializationConfig: serialization.apply,
    StepCacheConfig: step_cache.apply,
}


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


def apply_config(pipe: Any, spec: ModelSpec, config: PrimitiveConfig, comm: Collective | None = None) -> MitigationHandle:
    """Install one primitive through ``PRIMITIVES``. ``comm`` is the process group for HSDP
    (``ShapeOnlyGroup`` to analyse)."""
    for cls in type(config).__mro__:
        if cls in PRIMITIVES:
            return PRIMITIVES[cls](pipe, spec, config, comm)
    raise TypeError(f"no primitive applies a {type(config).__name__}; known: {', '.join(c.__name__ for c in PRIMITIVES)}")


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
            applied.handles.append(apply_config(pipe, spec, primitive_for(m, spec, pipe, trace), comm))
    except BaseException:
        applied.remove()
        raise
    return applied


