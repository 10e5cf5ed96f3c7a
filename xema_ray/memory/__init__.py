"""The Memory Analyzer: shape-only traces of the real pipelines and their analysis."""

from xema_ray.memory.trace import Category, MemoryTrace

__all__ = ["Category", "MemoryTrace"]
