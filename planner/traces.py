"""Trace cache for the planner: each (template, batch) is traced once on the meta device, kept in
memory and, optionally, on disk as JSON (so a Ray task or a later planning run reuses it).

The meta pipeline of each model is built once per process and reused by every trace of that model,
across caches too: a planning worker plans many templates in turn (building LTX-2's takes 1.5–3 s;
diffusers pipelines keep no state across calls that changes what a call allocates — the tests
check reused and fresh pipelines give identical traces)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from xema_ray.analyzer.run import TRACER_VERSION, TraceOptions, build_for_trace, default_dtype_for, trace_template
from xema_ray.lora.memory import pool_config_key
from xema_ray.memory.trace import MemoryTrace
from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.templates import RequestTemplate
from xema_ray.tier_plan import WeightFormat

#: how the planner traces: DiT blocks replayed (exact, ``xema_ray.analyzer.block_replay``; LTX-2's
#: 48 blocks x 3 passes per step run once per signature: ~4.5x faster traces)
PLANNER_TRACE = TraceOptions(replay_blocks=True)

# model name -> its meta-device pipeline, shared by every TraceCache in this process
_META_PIPELINES: dict[str, Any] = {}


@dataclass
class TraceCache:
    """``get(template)`` returns the template's meta-device trace, tracing it at most once.

    Args:
        directory: where traces persist as JSON (None: memory only).
        dtypes: per model, the dtype it computes in and the components it keeps in another one
            (``xema_ray.models.base.model_dtypes``); a model not named: its default dtype.
    """

    directory: Path | str | None = None
    dtypes: dict[str, tuple[torch.dtype, tuple[tuple[str, torch.dtype], ...]]] = field(default_factory=dict)
    #: per model, its group's LoRA adapter pool: traced with the pool's stacks and every sample's adapters
    adapters: dict[str, LoraPoolConfig] = field(default_factory=dict)
    #: per model, its transformer's weight format (a quantized tier's plan: ``xema plan --quality balanced``)
    weights: dict[str, WeightFormat] = field(default_factory=dict)
    _mem: dict[str, MemoryTrace] = field(default_factory=dict)
    traced: int = 0

    def __post_init__(self) -> None:
        if self.directory is not None:
            self.directory = Path(self.directory)

    def _path(self, template: RequestTemplate) -> Path | None:
        if self.directory is None:
            return None
        digest = hashlib.sha256(f"{template.key}|{TRACER_VERSION}{self._dtype_key(template.model)}"
                                f"{pool_config_key(self.adapters.get(template.model))}".encode()).hexdigest()[:16]
        return Path(self.directory) / f"{template.model}-{digest}.json"

    def _dtype_key(self, model: str) -> str:
        """'' at the model's default dtypes and weights (trace files keep their names), else what they are."""
        fmt = self.weights.get(model, "model")
        weights = "" if fmt == "model" else f"|weights={fmt}"
        if model not in self.dtypes:
            return weights
        base, kept = self.dtypes[model]
        return f"|{base}|" + ",".join(f"{c}={d}" for c, d in kept) + weights

    def pipeline(self, template: RequestTemplate) -> Any:
        """The model's meta-device pipeline, built on first use in this process."""
        return meta_pipeline(template.model, *self.dtypes.get(template.model, (None, ())),
                             weights=self.weights.get(template.model, "model"))

    def get(self, template: RequestTemplate) -> MemoryTrace:
        key = template.key + self._dtype_key(template.model) + pool_config_key(self.adapters.get(template.model))
        if key in self._mem:
            return self._mem[key]
        path = self._path(template)
        if path is not None and path.exists():
            trace = MemoryTrace.load(path)
        else:
            options = replace(PLANNER_TRACE, weights=self.weights.get(template.model, "model"))
            if template.model in self.dtypes:
                base, kept = self.dtypes[template.model]
                options = replace(options, dtype=base, component_dtypes=kept)
            pool = self.adapters.get(template.model)
            if pool is not None:  # the pool's stacks beside the weights, the deltas' intermediates in each layer
                from xema_ray.analyzer.lora import trace_with_adapters

                trace = trace_with_adapters(template, pool, options, pipeline=self.pipeline(template))
            else:
                trace = trace_template(template, options, pipeline=self.pipeline(template))
            self.traced += 1
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                trace.save(path)
        self._mem[key] = trace
        return trace


def meta_pipeline(model: str, dtype: torch.dtype | None = None,
                  component_dtypes: tuple[tuple[str, torch.dtype], ...] = (), weights: WeightFormat = "model") -> Any:
    """``model``'s meta-device pipeline at its analysis dtype (or ``dtype``, with components kept in
    their own), built on first use in this process and shared by every trace (and the text-encoder
    placement) of this process."""
    from xema_ray.models import get_model_spec

    spec = get_model_spec(model)
    dtype = dtype or default_dtype_for(spec)
    key = model if dtype == default_dtype_for(spec) and not component_dtypes else f"{model}|{dtype}|{component_dtypes}"
    key += "" if weights == "model" else f"|weights={weights}"
    pipe = _META_PIPELINES.get(key)
    if pipe is None:
        pipe = build_for_trace(spec, TraceOptions(dtype=dtype, component_dtypes=component_dtypes, weights=weights), dtype)
        _META_PIPELINES[key] = pipe
    return pipe
