"""The memory trace as data, and reading it: peaks, pressure intervals, segments (paper §3.3, §5).

Producing a trace (the shape-only run) is ``xema_ray.analyzer``; this package imports neither
the analyzer nor mitigation.
"""

from xema_ray.memory.trace import Category, MemoryTrace

__all__ = ["Category", "MemoryTrace"]
