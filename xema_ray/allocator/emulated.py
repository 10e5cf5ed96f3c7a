"""Installing libxema_alloc as the device memory of the emulated asynchronous device
(``xema_ray.platforms.async_host``), the CPU stand-in for ``install_cuda_allocator``.

Explicit, never at import: a worker started with ``static_allocator=True`` on a platform whose
``allocator_backend`` is "host" calls it. The arena's device index is 0, as a worker's arms.
"""

from __future__ import annotations

from typing import Any

from xema_ray.allocator.runtime import StaticAllocator


def install_host_allocator(platform: Any, device: int = 0) -> StaticAllocator:
    """Make the host arena of ``device`` the emulated device's memory; returns its control handle.

    Args:
        platform: a platform with ``allocator_backend == "host"``
            (``xema_ray.platforms.async_host.make_async_host_platform``).
        device: the allocator's device index.
    """
    if getattr(platform, "allocator_backend", None) != "host":
        raise ValueError(f"the {getattr(platform, 'name', platform)} platform has no host-arena device")
    alloc = StaticAllocator("host")
    platform.install_allocator(str(alloc.library_path), device, lambda ptr: alloc.locate(ptr, device=device))
    return alloc
