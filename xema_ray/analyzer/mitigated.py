"""The analyzer's view of a mitigated pipeline: trace a template with mitigations applied.

Mitigations are installed on the freshly built pipeline *before* the tracer registers the
resident weights, so an offloaded or sharded block's full weights are never counted as
resident: on the meta device their host copy is only a shape (``HostCopy``), and the trace
shows each block's weights being allocated when its copy (or all-gather) is issued and freed
after the block, exactly where the GPU run allocates them. HSDP shards, which no module owns,
are registered as resident weights through ``trace_template``'s ``prepare`` hook; HSDP runs
against a ``ShapeOnlyGroup`` (same buffers, no communication).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from xema_ray.analyzer.run import TraceOptions, build_for_trace, default_dtype_for, trace_template
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.analyzer.tracer import AllocationTracer
from xema_ray.mitigation.hsdp import ShapeOnlyGroup
from xema_ray.mitigation.registry import apply_mitigations
from xema_ray.mitigation.step_cache import StepCacheConfig
from xema_ray.mitigation.step_cache import apply as apply_step_cache
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate


def trace_with_mitigations(
    template: RequestTemplate,
    mitigations: Sequence[Mitigation],
    options: TraceOptions | None = None,
    world_size: int = 2,
    baseline: MemoryTrace | None = None,
    pipeline: Any | None = None,
    step_cache: bool = False,
) -> MemoryTrace:
    """The memory trace of ``template`` with ``mitigations`` applied (meta device by default).

    Args:
        template: what to trace (its batch is the batch the mitigations see).
        mitigations: a plan's mitigation list.
        options: as for ``trace_template``.
        world_size: the HSDP group size the shards are cut for.
        baseline: the unmitigated trace, needed only for mitigations located by event ranges.
        pipeline: a pipeline built for ``options.device`` (default: built here); mitigations
            are removed from it afterwards.
        step_cache: trace a step-cached quality tier: the step cache is installed computing
            every traced step, so its cached outputs are allocated at the first step and held to
            the end of the call, as in a real run (the skipped steps allocate less than a
            computed one, never more: the computed steps' pattern bounds them).

    Example:
        >>> t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=3)
        >>> m = Mitigation(kind="block_offload", blocks=(0, 1, 2), intensity=3)
        >>> trace_with_mitigations(t, [m]).resident_bytes() < trace_template(t).resident_bytes()
        True
    """
    opts = options or TraceOptions()
    spec = template.spec
    dtype = opts.dtype or default_dtype_for(spec)
    pipe = pipeline if pipeline is not None else build_for_trace(spec, opts, dtype)
    comm = ShapeOnlyGroup(world_size=world_size) if any(m.kind == "hsdp" for m in mitigations) else None
    applied = apply_mitigations(pipe, spec, mitigations, comm=comm, trace=baseline)
    if step_cache:
        applied.handles.append(apply_step_cache(pipe, spec, StepCacheConfig(mask=(1,) * template.steps)))

    def prepare(_pipe: Any, tracer: AllocationTracer) -> contextlib.AbstractContextManager[None]:
        for h in applied.handles:
            tracer.register_resident(h.resident, Category.WEIGHT)
        return contextlib.nullcontext()

    try:
        trace = trace_template(template, opts, pipeline=pipe, prepare=prepare)
    finally:
        applied.remove()
    trace.mitigations = [m.model_dump_json() for m in mitigations]
    return trace
