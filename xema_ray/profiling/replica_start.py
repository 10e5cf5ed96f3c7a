"""A replica's predicted start, cold and warm, from measured figures (``ReplicaStart`` in the plan).

A replica is ready once its process has started and imported the project and its weights are on
the device. The weight phase is cold when the checkpoint is read into the node's host copy first,
warm when the host copy is there and only its copy to the device remains (docs/serving.md, "Warm
replicas"). Predicted as

    cold_s = process_s + weight_bytes / read_gbps + weight_bytes / copy_gbps
    warm_s = process_s + weight_bytes / copy_gbps

with ``process_s``, ``read_gbps`` and the CPU's ``copy_gbps`` as ``bench/bench_warm_start.py``
measured them (2.15 GB model, medians, 2-core CPU VM; BENCHMARKS.md "Replica start, cold vs
warm"), and a GPU's ``copy_gbps`` the hardware profile's pinned host-to-device bandwidth
(``HardwareProfile.h2d_gbps``; the GPU check measures it: tests/gpu/test_warm_load_gpu.py). The
first request's own time is the plan entry's latency, not part of the start.

Example:
    >>> s = predict_start(2_000_000_000, MEASURED_CPU)
    >>> s.warm_s < s.cold_s
    True
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.plan import ReplicaStart
from xema_ray.profiling.hardware import HardwareProfile


class StartFigures(BaseModel):
    """The measured figures a start is predicted from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    process_s: float = Field(ge=0, description="process start and imports, seconds")
    read_gbps: float = Field(gt=0, description="checkpoint -> host copy, GB/s (disk read and the copy into the segment)")
    copy_gbps: float = Field(gt=0, description="host copy -> device, GB/s")
    basis: str


#: bench/bench_warm_start.py, 2026-12-06, 2-core CPU VM, the run at load average ~7
#: (bench/results/warm_start_load7.json, medians of 2): warm process start + imports 12.3 s; 2.15 GB
#: checkpoint -> host copy 8.4 s (cold); host copy -> device (a memory copy) 3.3 s (warm). The run
#: at load ~20 (warm_start.json) measured the same steps 1-3x slower: the machine is shared
MEASURED_CPU = StartFigures(process_s=12.3, read_gbps=2.15 / 8.4, copy_gbps=2.15 / 3.3,
                            basis="bench/bench_warm_start.py on the 2-core CPU VM, 2026-12-06")


def start_figures(hardware: HardwareProfile | None) -> StartFigures:
    """The figures for ``hardware`` (None: the CPU): a GPU's device copy at its profile's pinned
    bandwidth, the rest as measured on the CPU."""
    if hardware is None:
        return MEASURED_CPU
    return MEASURED_CPU.model_copy(update={
        "copy_gbps": hardware.h2d_gbps,
        "basis": f"{MEASURED_CPU.basis}; device copy at {hardware.name}'s pinned h2d_gbps {hardware.h2d_gbps:g}"})


def predict_start(weight_bytes: int, figures: StartFigures) -> ReplicaStart:
    """``ReplicaStart`` of a model of ``weight_bytes`` (see the module docstring)."""
    gb = weight_bytes / 1e9
    copy = gb / figures.copy_gbps
    return ReplicaStart(weight_bytes=weight_bytes, cold_s=round(figures.process_s + gb / figures.read_gbps + copy, 2),
                        warm_s=round(figures.process_s + copy, 2), basis=figures.basis)
