"""Latency estimates: the roofline cost model, hardware profiles, the profile store, phase shares.

The segment-reuse profiler (§7.2) that measures on a worker is ``xema_ray.measure.profiler``.

The planner calls ``estimate_latency(config, hardware, store)``; it returns a
``LatencyEstimate`` whose ``source`` (``xema_ray.vocabulary.LatencySource``) is "measured", "profiled"
or "estimated".
"""

from xema_ray.profiling.costmodel import LatencyEstimate, cost_model_estimate, estimate_latency
from xema_ray.profiling.hardware import A6000_8X, H200, HardwareProfile, get_hardware
from xema_ray.profiling.store import ProfileStore, RequestRecord, SegmentRecord

__all__ = [
    "A6000_8X",
    "H200",
    "HardwareProfile",
    "LatencyEstimate",
    "ProfileStore",
    "RequestRecord",
    "SegmentRecord",
    "cost_model_estimate",
    "estimate_latency",
    "get_hardware",
]
