"""Latency: the segment-reuse profiler (§7.2), its on-disk store, and the roofline cost model.

The planner calls ``estimate_latency(config, hardware, store)``; it returns a
``LatencyEstimate`` whose ``source`` is "measured", "profiled" or "estimated".
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
