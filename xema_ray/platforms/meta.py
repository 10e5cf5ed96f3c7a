"""Meta platform: the worker's own load and execute code with no values and no memory.

``xema verify`` runs a serving worker on this platform under the allocation tracer: every
weight the worker places on the device and every tensor a batch allocates is a meta tensor the
tracer counts, so the device bytes it reports are the worker's own, from the first weight placed
to the end of the request. Nothing is computed; outputs are not encoded.
"""

from __future__ import annotations

import torch

from xema_ray.platforms.base import MemoryStats, Platform


class MetaPlatform(Platform):
    name = "meta"  # type: ignore[assignment]
    dist_backend = "gloo"

    def device(self, local_index: int = 0) -> torch.device:
        return torch.device("meta")

    def set_device(self, local_index: int) -> None:
        return None

    def synchronize(self) -> None:
        # copies' sources a stream-ordered allocator held until now are let go (platforms.streams)
        from xema_ray.platforms import streams

        streams.synchronize(torch.device("meta"))

    def reset_peak_memory(self) -> None:
        return None

    def memory_stats(self) -> MemoryStats:
        # the allocation tracer around the worker holds the real figures
        return MemoryStats(source="meta (see the allocation trace)", peak_bytes=0, current_bytes=0)

    def hardware_name(self) -> str:
        return "meta"

    def device_count(self) -> int:
        return 1
