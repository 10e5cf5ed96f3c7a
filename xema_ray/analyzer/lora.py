"""The memory trace of a template served with LoRA adapters: the pool's stacks resident beside the
weights and each target layer's per-sample gathers and intermediates, at the template's batch.

Worst case, as planning needs: every sample stacks ``max_per_request`` adapters at the pool's
``max_rank`` on every linear layer of the transformer (``xema_ray.lora.memory.fill_worst_case``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from xema_ray.analyzer.run import TraceOptions, default_dtype_for, trace_template
from xema_ray.analyzer.tracer import AllocationTracer, Category
from xema_ray.lora.layers import MultiLoraConfig, apply_multi_lora
from xema_ray.lora.memory import fill_worst_case, pool_config_key
from xema_ray.lora.pool import AdapterPool, adapted_components
from xema_ray.memory.trace import MemoryTrace
from xema_ray.models import BuildOptions
from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.templates import RequestTemplate


def trace_with_adapters(template: RequestTemplate, pool_config: LoraPoolConfig, options: TraceOptions | None = None,
                        pipeline: Any | None = None) -> MemoryTrace:
    """``trace_template`` with an adapter pool on the transformer and every sample using adapters.

    Args:
        template: what to trace (its batch is the samples' count).
        pool_config: the group's pool (slots, max_rank, max_per_request).
        options: as for ``trace_template`` (meta by default).
        pipeline: a pipeline built for ``options.device`` (default: built here); the hooks are
            removed from it afterwards.

    Example:
        >>> t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2)
        >>> with_pool = trace_with_adapters(t, LoraPoolConfig(slots=4, max_rank=16))
        >>> with_pool.peak() > trace_template(t).peak()
        True
    """
    import torch

    opts = options or TraceOptions()
    spec = template.spec
    dtype = opts.dtype or default_dtype_for(spec)
    pipe = pipeline if pipeline is not None else spec.build_pipeline(BuildOptions(device=opts.device, dtype=dtype))
    pool = AdapterPool(pool_config, adapted_components(pipe), torch.device(opts.device), dtype)
    uses = fill_worst_case(pool, template.batch)
    handle = apply_multi_lora(pool, MultiLoraConfig())

    def prepare(_pipe: Any, tracer: AllocationTracer) -> contextlib.AbstractContextManager[None]:
        tracer.register_resident({f"lora_pool.{p}.{ab}": t for p in pool.targets
                                  for ab, t in (("A", pool.a[p]), ("B", pool.b[p]))}, Category.WEIGHT)
        stack = contextlib.ExitStack()
        stack.enter_context(pool.activate(uses))
        return stack

    try:
        trace = trace_template(template, opts, pipeline=pipe, prepare=prepare)
    finally:
        handle.remove()
    trace.meta["lora_pool"] = pool_config_key(pool_config)
    return trace
