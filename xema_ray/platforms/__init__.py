"""Platforms: the one place where CUDA and CPU differ (vLLM's ``platforms/`` layering).

Everything that must ask "is this a GPU?" (device selection, the torch.distributed backend,
synchronisation before reading a clock, memory statistics, the hardware fingerprint that keys
profile stores) goes through a ``Platform``. Only ``cuda.py`` touches ``torch.cuda``; CI runs
``cpu.py``, which exercises the same callers with gloo and host memory.

Example:
    >>> from xema_ray.platforms import get_platform
    >>> get_platform("cpu").dist_backend
    'gloo'
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xema_ray.platforms.base import MemoryStats, Platform, PlatformName


def __getattr__(name: str) -> Any:
    """``MemoryStats``, ``Platform`` and ``PlatformName`` from ``base`` on first use: the package's
    light modules (``host_memory``, ``topology``) import without torch (the serving app's
    processes that run no model read them)."""
    if name in ("MemoryStats", "Platform", "PlatformName"):
        from xema_ray.platforms import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["MemoryStats", "Platform", "PlatformName", "current_platform", "get_platform"]


def get_platform(name: PlatformName) -> Platform:
    """The platform called ``name`` ("cpu" or "cuda"); ValueError for anything else."""
    if name == "cpu":
        from xema_ray.platforms.cpu import CpuPlatform

        return CpuPlatform()
    if name == "cuda":
        from xema_ray.platforms.cuda import CudaPlatform

        return CudaPlatform()
    if name == "meta":
        from xema_ray.platforms.meta import MetaPlatform

        return MetaPlatform()
    if name == "emulated":
        from xema_ray.platforms.emulated import EmulatedPlatform

        return EmulatedPlatform()
    raise ValueError(f"unknown platform {name!r}; known: 'cpu', 'cuda', 'meta', 'emulated'")


@cache
def current_platform() -> Platform:
    """CUDA when a GPU is visible to this process, else CPU (decided once per process)."""
    from xema_ray.platforms.cuda import cuda_available

    return get_platform("cuda" if cuda_available() else "cpu")
