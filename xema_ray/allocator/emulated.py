"""Installing libxema_alloc as the device memory of the emulated asynchronous device
(``xema_ray.platforms.async_host``), the CPU stand-in for ``install_cuda_allocator``.

Explicit, never at import: a worker started with ``static_allocator=True`` on a platform whose
``allocator_backend`` is "host" calls it. The arena's device index is 0, as a worker's arms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from xema_ray.allocator.artifact import LayoutArtifact, content_id
from xema_ray.allocator.runtime import StaticAllocator
from xema_ray.allocator.solver import solve_arrays
from xema_ray.platforms.async_host import COMPUTE_HANDLE

if TYPE_CHECKING:
    from xema_ray.plan import ExecutionConfig


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
    platform.install_allocator(str(alloc.library_path), device, lambda ptr: locate(alloc, ptr, device))
    return alloc


def locate(alloc: StaticAllocator, ptr: int, device: int = 0) -> str:
    """Where ``ptr`` lies in ``device``'s arena: "offset 0x... of the static region" (or dynamic),
    else a driver block's address (for messages naming a block)."""
    s = alloc.stats(device=device)
    for name, base, size in (("static", s.arena_base, s.static_region_bytes),
                             ("dynamic", s.dynamic_base, s.dynamic_region_bytes)):
        if base and base <= ptr < base + size:
            return f"offset {ptr - base:#x} of the {name} region"
    return f"driver block {ptr:#x}"


def recorded_layout(alloc: StaticAllocator, device: int, run: Callable[[], object], config: ExecutionConfig) -> LayoutArtifact:
    """The layout of ``config`` solved from the stream ``run`` makes on the emulated device's compute
    stream (recorded by the arena itself, frees where the arena made them: deferred frees included),
    as ``make gpu-check`` records a GPU's. A worker arming it on the emulated device hits its plan
    allocation for allocation, so the static region's offsets are really reused there.

    Args:
        alloc: the host allocator the emulated device allocates from.
        device: its device index.
        run: one batch of ``config`` on a worker of that device, disarmed.
        config: the entry (its hash and template go into the artifact).
    """
    with alloc.record(device=device) as rec:
        run()
    trace = rec.trace(stream=COMPUTE_HANDLE)
    layout = solve_arrays(trace.size, trace.begin, trace.end, n_events=trace.n_events)
    layout.verify()
    return LayoutArtifact(layout_id=content_id(layout), gpu="any", template=config.template.shape_key,
                          config_hash=config.config_hash(), steps=config.template.steps, layout=layout.to_file())
