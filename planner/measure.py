"""Measured latencies for the planner (issue #16): candidates timed on the planning task's own
device by the segment-reuse profiler (paper §7.2), estimates only where measuring cannot work.

A planning task that holds a device — a GPU Ray gave it, or this CPU for ``--hardware cpu`` —
builds the template's model once at its real config with random weights
(``ModelSpec.build_pipeline``: architecture, memory and latency are real, pictures are noise)
and answers ``seconds(config)`` with ``LatencyProfiler.profile``: the config's request is traced
on the meta device, its segments grouped by operator pattern, and only signatures the profile
store lacks for this execution shape are timed, in one short calibration request. The store is
keyed by the device's fingerprint (NVML on GPUs), so a segment measured for one candidate is
reused by every other candidate and template of the same shape, and by later planning runs when
the store is a file (``--profile-store``).

What is not measured, and why, is estimated by the roofline cost model (calibrated by this
device's measurements in the store when there are any) and labelled so:

- SP > 1: one task holds one device; the SP group's collectives cannot run alone;
- configurations the device cannot run (out of memory, an unrunnable batch): the planner still
  needs their latency to rank them, and the memory model, not the device, decides what fits
  the *budget*.

``source_of(config)`` says, per configuration, what a plan entry says of it
(``xema_ray.vocabulary.PlanLatencySource``): "measured" (profiled here: a plan counts a profiled
latency as measured), "estimated" or "measured+estimated" (a calibrated estimate);
``planner.latency.combine`` makes an entry's ``latency_source``.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

from xema_ray.plan import ExecutionConfig
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import LatencySource, PlanLatencySource


@dataclass
class DeviceLatency:
    """``seconds(config)`` measured on this process's device where it can be, else estimated.

    Args:
        template: the template being planned (its model is built once).
        fallback: the latency model for what is not measured (its hardware profile should
            carry this device's fingerprint so the store's measurements calibrate it).
        device: "cuda" or "cpu".
    """

    template: RequestTemplate
    fallback: Any  # planner.latency.LatencyModel
    device: str
    measured: set[str] = field(default_factory=set)
    estimated: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    _profiler: Any = None
    _sources: dict[str, PlanLatencySource] = field(default_factory=dict)
    _seconds: dict[str, float] = field(default_factory=dict)

    def _build(self) -> Any:
        if self._profiler is None:
            import torch

            from xema_ray.models import BuildOptions
            from xema_ray.platforms import get_platform
            from xema_ray.measure.profiler import LatencyProfiler
            from xema_ray.runtime.engine import ExecutionEngine

            spec = self.template.spec
            dtype = torch.bfloat16 if spec.size == "real" and self.device == "cuda" else torch.float32
            pipe = spec.build_pipeline(BuildOptions(device=self.device, dtype=dtype))
            platform = get_platform(self.device)
            engine = ExecutionEngine(pipe, spec, torch.device(self.device), dtype, platform=platform)
            self._profiler = LatencyProfiler(engine, self.fallback.store, platform)
        return self._profiler

    @property
    def fingerprint(self) -> str:
        return str(self._build().fingerprint)

    def seconds(self, config: ExecutionConfig) -> float:
        key = config.model_dump_json()
        if key in self._seconds:
            return self._seconds[key]
        value: float | None = None
        if config.sp == 1:
            try:
                value = float(self._build().profile(config).estimate_s)
                self._sources[key] = LatencySource.MEASURED  # profiled on the device: measured, for a plan
                self.measured.add(key)
            except (RuntimeError, ValueError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                self.errors.append(f"{config.describe()}: {str(e).splitlines()[0][:160]}")
                _free_device(self.device)
        if value is None:
            value = self.fallback.seconds(config)
            self._sources[key] = self.fallback.source_of(config)
            self.estimated.add(key)
        self._seconds[key] = value
        return value

    def source_of(self, config: ExecutionConfig) -> PlanLatencySource:
        key = config.model_dump_json()
        if key not in self._sources:
            self.seconds(config)
        return self._sources[key]

    def save(self) -> None:
        self.fallback.save_store()


def _free_device(device: str) -> None:
    gc.collect()
    from xema_ray.platforms import get_platform

    get_platform(device).release_cached_memory()  # type: ignore[arg-type]


def task_device(hardware: str, measure: str) -> str | None:
    """The device a planning task measures on: its GPU when Ray gave it one whose name matches
    ``hardware`` (or ``hardware`` is "local-gpu"), this CPU for ``hardware`` "cpu"; None (the
    cost model only) for what-if planning and with ``measure`` "never"."""
    if measure == "never":
        return None
    if hardware == "cpu":
        return "cpu"
    try:
        from xema_ray.platforms.cuda import cuda_available

        has_gpu = cuda_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        if measure == "always":
            raise RuntimeError("--measure always: this planning task has no GPU (does the Ray cluster have any?)")
        return None
    from xema_ray.platforms import get_platform

    name = get_platform("cuda").hardware_name().lower()
    if hardware == "local-gpu" or hardware.removesuffix("x8") in name or measure == "always":
        return "cuda"
    return None  # e.g. --hardware a6000 on an H200 cluster: what-if planning, estimated
