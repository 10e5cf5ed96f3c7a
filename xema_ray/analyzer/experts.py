"""A two-expert model's trace (Wan2.2-A14B): every step labelled with the expert that runs it.

Both experts share one architecture, so a denoising step allocates the same pattern whichever
runs; only the module names differ. The analyzer therefore traces its three steps with one
expert (``ModelSpec.one_expert_call``: step replication needs identical steps) and this module
renames what the steps of the other stages allocate and free (``transformer.blocks.3`` ->
``transformer_2.blocks.3``), by the stages the spec derives from the scheduler
(``ModelSpec.expert_stages``). The weights of both experts are in the trace from the start, as
the pipeline holds them; when each is needed and where the switch falls are then read off the
trace itself (``xema_ray.memory.analysis.expert_uses``).

Example:
    >>> from xema_ray.templates import RequestTemplate
    >>> from xema_ray.analyzer.run import trace_template
    >>> from xema_ray.memory.analysis import expert_uses
    >>> t = RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=9, steps=6)
    >>> [(u.component, u.first_step, u.last_step) for u in expert_uses(trace_template(t))]
    [('transformer', 0, 3), ('transformer_2', 4, 5)]
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from xema_ray.memory.trace import MemoryTrace
from xema_ray.models.base import ExpertStage


def label_experts(trace: MemoryTrace, stages: tuple[ExpertStage, ...], traced_as: str = "transformer") -> MemoryTrace:
    """``trace`` (every step run by ``traced_as``) with each step's allocations and frees named
    after the expert of its stage.

    A step's transformer work lies between the previous step's scheduler entry and its own
    (``MemoryTrace.step_bounds``), so an event belongs to step ``searchsorted(bounds, e, 'right')``.

    Args:
        trace: the expanded trace of a call that ran ``traced_as`` for every step.
        stages: the spec's expert stages for the template (steps must match the trace's).
        traced_as: the component that ran.
    """
    bounds = np.asarray(trace.step_bounds, dtype=np.int64)
    if stages and stages[-1].last_step + 1 != len(bounds):
        raise ValueError(f"expert stages cover {stages[-1].last_step + 1} steps, the trace has {len(bounds)}")
    modules = list(trace.modules)
    index = {m: i for i, m in enumerate(modules)}
    module, free_module = trace.module.copy(), trace.free_module.copy()

    def renamed(i: int, component: str) -> int:
        name = modules[i]
        new = component + name[len(traced_as):]
        if new not in index:
            index[new] = len(modules)
            modules.append(new)
        return index[new]

    traced = np.array([m == traced_as or m.startswith(traced_as + ".") for m in modules], dtype=bool)
    for stage in stages:
        if stage.component == traced_as:
            continue
        lo = bounds[stage.first_step - 1] if stage.first_step > 0 else 0
        hi = bounds[stage.last_step]
        for arr, events in ((module, trace.begin), (free_module, trace.end)):
            sel = np.flatnonzero((events >= lo) & (events < hi) & (arr >= 0))
            sel = sel[traced[arr[sel]]]
            cache: dict[int, int] = {}
            for k in sel:
                old = int(arr[k])
                if old not in cache:
                    cache[old] = renamed(old, stage.component)
                arr[k] = cache[old]
    meta = dict(trace.meta)
    meta["experts"] = "; ".join(f"{s.component}: steps {s.first_step}-{s.last_step}" for s in stages)
    return replace(trace, module=module, free_module=free_module, modules=modules, meta=meta)
