"""CPU platform: what CI and the CPU demo run. gloo for SP groups, RSS for memory."""

from __future__ import annotations

import os
import platform as _platform
import resource

import torch

from xema_ray.platforms.base import MemoryStats, Platform


def cpu_model_name() -> str:
    """The CPU model string from /proc/cpuinfo (Linux), else what the ``platform`` module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"

    def device(self, local_index: int = 0) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_index: int) -> None:
        # one CPU "slot" per worker: nothing to bind
        return None

    def synchronize(self) -> None:
        return None

    def reset_peak_memory(self) -> None:
        # ru_maxrss cannot be reset: on CPU the peak is the process's lifetime high-water mark
        return None

    def memory_stats(self) -> MemoryStats:
        current = _rss_bytes()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return MemoryStats(source="rss (peak = process lifetime)", peak_bytes=max(peak, current), current_bytes=current)

    def hardware_name(self) -> str:
        return cpu_model_name()

    def device_count(self) -> int:
        return os.cpu_count() or 1
