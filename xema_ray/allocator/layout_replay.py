"""A request's allocation stream through the runtime allocator's host arena with a layout armed:
the CPU proof that a stream is the one a layout was solved for (``xema verify``).

Example:
    >>> import numpy as np
    >>> from xema_ray.allocator.synthetic import random_trace
    >>> from xema_ray.allocator.solver import solve_layout
    >>> trace = random_trace(50, seed=0)
    >>> replay(solve_layout(trace), trace).misses
    0
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from xema_ray.allocator.margins import dynamic_region_bytes
from xema_ray.allocator.solver import StaticLayout
from xema_ray.memory.trace import MemoryTrace


class ReplayReport(BaseModel):
    """One request's allocation stream through the host arena with a layout armed."""

    model_config = ConfigDict(frozen=True)

    allocations: int
    hits: int
    misses: int
    static_reserved_bytes: int
    lower_bound_bytes: int
    peak_reserved_bytes: int


def replay(layout: StaticLayout, trace: MemoryTrace) -> ReplayReport:
    """Run ``trace``'s allocations and frees, in event order, through the C++ allocator's host
    arena with ``layout`` armed; an allocation whose size differs from the layout's at its index
    (or that the layout does not have) falls back and counts as a miss.

    Args:
        layout: the solved layout (its whole replay plan is armed).
        trace: the stream to replay (``nbytes`` are requested, as torch asks the allocator).
    """
    from xema_ray.allocator.runtime import StaticAllocator

    alloc = StaticAllocator("host")
    device = 0
    alloc.reserve(layout.reserved_bytes, dynamic_region_bytes(layout.reserved_bytes), device=device)
    n = len(trace)
    sizes = trace.nbytes.astype(np.int64)
    order = np.argsort(np.concatenate([trace.begin, trace.end]), kind="stable")
    ptrs = np.zeros(n, dtype=np.uint64)
    live = np.zeros(n, dtype=bool)
    try:
        with alloc.armed(layout.replay_plan(), device=device) as report:
            for k in order:
                i = int(k % n)
                if k < n:
                    ptrs[i] = alloc.malloc(max(1, int(sizes[i])), device=device)
                    live[i] = True
                elif live[i] and trace.end[i] < trace.n_events:
                    alloc.free(int(ptrs[i]), device=device)
                    live[i] = False
        stats = alloc.stats(device=device)
        for i in np.flatnonzero(live):
            alloc.free(int(ptrs[i]), device=device)
    finally:
        alloc.release(device=device)
    return ReplayReport(allocations=n, hits=report.hits, misses=report.misses,
                        static_reserved_bytes=layout.reserved_bytes, lower_bound_bytes=layout.lower_bound_bytes,
                        peak_reserved_bytes=stats.peak_reserved_bytes)
