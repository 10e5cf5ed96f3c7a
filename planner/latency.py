"""Latency for the planner: ``xema_ray.profiling.estimate_latency`` on a named hardware profile.

- "a6000" (the paper's 8× RTX A6000 48 GB box) and "h200": the roofline cost model, calibrated by
  measurements of that hardware in the profile store when there are any; labelled an estimate.
- "cpu": this machine's CPU (the tiny models of tests and the CPU demo). Before planning, one
  request per template is *measured* here at SP 1, batch 1 (``calibrate``); other configurations
  come from the cost model scaled by those measurements.
"""

from __future__ import annotations

from pathlib import Path

from xema_ray.plan import ExecutionConfig, PlanEntry
from xema_ray.profiling import A6000_8X, H200, HardwareProfile, LatencyEstimate, ProfileStore, RequestRecord, estimate_latency
from xema_ray.profiling.costmodel import reused_step_share as cost_reused_step_share
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import TIMED_SOURCES, LatencySource, PlanLatencySource

_PRESETS: dict[str, HardwareProfile] = {"a6000": A6000_8X, "a6000x8": A6000_8X, "h200": H200}


def hardware_names() -> list[str]:
    return [*_PRESETS, "cpu"]


def cpu_profile() -> HardwareProfile:
    """This CPU as a hardware profile. The roofline numbers are rough (a few cores, fp32,
    collectives over loopback gloo); what makes CPU estimates usable is the calibration by
    measured requests on this very machine, matched through the fingerprint."""
    from xema_ray.platforms import get_platform

    cpu = get_platform("cpu")
    return HardwareProfile(
        name=f"CPU {cpu.hardware_name()}", gpus=64,  # worker slots are logical on a CPU
        memory_gb=24, bf16_tflops=0.05, mem_gbps=10, h2d_gbps=10,
        nvlink_gbps=0, nvlink_domain=1, pcie_gbps=2, collective_latency_s=200e-6,
        fingerprint=cpu.hardware_fingerprint(), stored_formats=("int8",),  # torchao's fp8 path is for GPUs
    )


class LatencyModel:
    """``seconds(config)`` for one hardware profile, with an optional persistent profile store."""

    def __init__(self, hardware: str, store: ProfileStore | None = None, store_path: str | Path | None = None) -> None:
        if hardware == "cpu":
            self.hardware = cpu_profile()
            self.source: PlanLatencySource = LatencySource.MEASURED_ESTIMATED
        elif hardware in _PRESETS:
            self.hardware = _PRESETS[hardware]
            self.source = LatencySource.ESTIMATED
        elif hardware == "local-gpu":
            self.hardware = _local_gpu()
            self.source = LatencySource.ESTIMATED
        else:
            raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(hardware_names())}, local-gpu")
        self.name = hardware
        self.store = store if store is not None else ProfileStore(store_path) if store_path else ProfileStore()

    def estimate(self, config: ExecutionConfig) -> LatencyEstimate:
        return estimate_latency(config, self.hardware, self.store)

    def seconds(self, config: ExecutionConfig) -> float:
        return self.estimate(config).total_s

    def source_of(self, config: ExecutionConfig) -> PlanLatencySource:
        """Where ``seconds(config)`` comes from: a measurement of this hardware in the store, the
        cost model calibrated by such measurements, or the cost model alone."""
        return source_label(self.estimate(config))

    def reused_step_share(self, config: ExecutionConfig) -> float:
        """A step-cached (reused) denoising step's seconds as a share of a computed one's for
        ``config``'s template: measured here when the store holds ``calibrate``'s pair for it
        (at batch 1), else the cost model's (``xema_ray.profiling.costmodel.reused_step_share``)."""
        pair = _reuse_pair(config)
        records = [self._measured(c) for c in pair]
        if len(pair) == 2 and records[0] is not None and records[1] is not None:
            from xema_ray.measure.profiler import reused_step_share

            return reused_step_share(records[0], records[1], _computed(config))
        return cost_reused_step_share(config, self.hardware)

    def _measured(self, config: ExecutionConfig) -> RequestRecord | None:
        return self.store.get_request(self.hardware.fingerprint or "", config.template.model, config.config_hash(),
                                      LatencySource.MEASURED)

    def on_device(self, fingerprint: str) -> None:
        """Key this model's store look-ups by the device a planning task measures on (its NVML
        fingerprint), so measurements made there calibrate the estimates of what is not measured."""
        self.hardware = self.hardware.model_copy(update={"fingerprint": fingerprint})

    def save_store(self) -> None:
        """Write the store's measurements back to its file, merged with what other planning
        tasks wrote there meanwhile (no-op for an in-memory store)."""
        if self.store.path is None:
            return
        merged = ProfileStore(self.store.path)  # what is on disk now
        merged.merge(self.store)
        merged.save()

    def fingerprint(self, gpus: int) -> str:
        """What a plan table made with this model is keyed by."""
        return f"{gpus}x {self.hardware.name}"

    def calibrate(self, templates: list[RequestTemplate], repeats: int = 1) -> int:
        """Measure one request per template at SP 1, batch 1 on this machine (CPU profiles only),
        so the cost model's estimates are scaled to it, and beside it the same request step-cached
        (``LatencyProfiler.measure_reuse``: ``reused_step_share``). Returns how many were measured."""
        if self.name != "cpu":
            raise ValueError("calibration by local measurement is for the 'cpu' profile; GPUs use `make gpu-check` data")
        import torch

        from xema_ray.models import BuildOptions
        from xema_ray.measure.profiler import LatencyProfiler
        from xema_ray.runtime.engine import ExecutionEngine

        done = 0
        engines: dict[str, ExecutionEngine] = {}
        for t in templates:
            cfg = ExecutionConfig(template=t)
            if all(self._measured(c) for c in _reuse_pair(cfg)):
                continue
            if t.model not in engines:
                spec = t.spec
                pipe = spec.build_pipeline(BuildOptions(device="cpu", dtype=torch.float32))
                engines[t.model] = ExecutionEngine(pipe, spec, torch.device("cpu"), torch.float32)
            profiler = LatencyProfiler(engines[t.model], self.store)
            # the first call of a pipeline pays one-off costs (lazy imports, allocator growth, kernel
            # selection) that no later request pays: run it once unrecorded
            engines[t.model].run_pipeline(cfg, ["warm-up"], [0], output_type="np", steps=cfg.template.steps)
            if len(_reuse_pair(cfg)) == 2:  # with it, what a step-cached step costs here (planner.tiers)
                profiler.measure_reuse(cfg, repeats=max(repeats, REUSE_REPEATS))
            else:
                profiler.measure(cfg, repeats=repeats)
            done += 1
        if done:
            self.store.save()  # a restart reuses these measurements (no-op for an in-memory store)
        return done


#: interleaved (lossless, step-cached) pairs a calibration times for the reused step's share
REUSE_REPEATS = 3


def _reuse_pair(config: ExecutionConfig) -> tuple[ExecutionConfig, ...]:
    """``config`` at SP 1, batch 1 and, where its steps leave one to reuse, the same step-cached
    with ``REUSE_ALL`` (what ``LatencyProfiler.measure_reuse`` times)."""
    from xema_ray.measure.profiler import REUSE_ALL

    base = ExecutionConfig(template=config.template)
    if _computed(base) >= base.template.steps:
        return (base,)
    return base, base.model_copy(update={"step_cache": REUSE_ALL})


def _computed(config: ExecutionConfig) -> int:
    """Steps ``REUSE_ALL`` computes for ``config``'s template (each expert stage's first)."""
    from xema_ray.measure.profiler import REUSE_ALL

    t = config.template
    return REUSE_ALL.computed_steps(t.steps, tuple(s.first_step for s in t.spec.expert_stages(t)[1:]))


def with_reused_step_share(entry: PlanEntry, latency: LatencyModel) -> PlanEntry:
    """``entry`` carrying what a step-cached step of its template costs (``PlanPrediction.reused_step_share``,
    ``LatencyModel.reused_step_share``), for the tiers pass to price its quality tiers."""
    share = latency.reused_step_share(entry.config)
    return entry.model_copy(update={"prediction": entry.prediction.model_copy(update={"reused_step_share": share})})


def source_label(est: LatencyEstimate) -> PlanLatencySource:
    """What a plan entry says of ``est``: a timed latency (whole or profiled) is measured; a
    calibrated cost model is measured+estimated."""
    if est.source in TIMED_SOURCES:
        return LatencySource.MEASURED
    return LatencySource.MEASURED_ESTIMATED if est.calibrated else LatencySource.ESTIMATED


def combine(sources: list[PlanLatencySource]) -> PlanLatencySource:
    """One label for several latencies (an entry's batch latency and its partial batches)."""
    kinds = set(sources)
    if kinds == {LatencySource.MEASURED}:
        return LatencySource.MEASURED
    if kinds <= {LatencySource.ESTIMATED}:
        return LatencySource.ESTIMATED
    return LatencySource.MEASURED_ESTIMATED


def _local_gpu() -> HardwareProfile:
    """The preset matching this machine's GPU (by its NVML name)."""
    from xema_ray.platforms import get_platform

    name = get_platform("cuda").hardware_name().lower()
    for key, preset in (("h200", H200), ("a6000", A6000_8X)):
        if key in name:
            return preset
    raise ValueError(f"no latency profile for GPU {name!r}; set hardware: a6000 or h200 in the serve config")
