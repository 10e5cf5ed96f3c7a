"""The two numbers every consumer of a static layout shares: the dynamic region's size and the
planner's allowance for a layout it has not solved yet. One definition, used by the runtime
allocator (``StaticAllocator.reserve``), the host-arena replay, the worker's layouts, the
planner's layout stage and its memory model.

Example:
    >>> dynamic_region_bytes(20 * 10**9)
    1000000000
"""

from __future__ import annotations

import math

#: Paper §6.2: the dynamic region (workspaces, NCCL buffers, allocations a plan does not know) is a
#: 5 % margin above the static region. The static region holds what a request allocates; the
#: weights are placed before any layout is armed, outside it, so the margin is 5 % of the static
#: region, not of the device.
DYNAMIC_FRACTION = 0.05

#: The planner's allowance, before a layout is solved, for static reserved / lower bound (the max
#: live bytes of the trace). Measured by ``bench/bench_layout.py`` (BENCHMARKS.md, "Static layout"):
#: on the analyzer's whole-request 50-step traces the solver reaches 1.000–1.006× (CogVideoX-5B
#: 720×480×49 1.004×, 1280×720×49 1.006×, Flux.2 1024² 1.000×, LTX-2 1280×704×49 1.000×); on the
#: planner's short 4-step CogVideoX traces 1.022× on average (1.043× at 81 frames). 1.02 is the
#: issue's target and the short traces' mean. Where a layout has been solved (``xema plan
#: --layouts``) the entry's prediction uses the solver's reserved bytes instead.
LAYOUT_OVERHEAD = 1.02


def dynamic_region_bytes(static_bytes: int, fraction: float = DYNAMIC_FRACTION) -> int:
    """The dynamic region that goes with a static region of ``static_bytes``.

    Args:
        static_bytes: the static region (a layout's ``reserved_bytes``).
        fraction: share of the static region; ``DYNAMIC_FRACTION`` unless a caller measured its own.
    """
    if static_bytes < 0:
        raise ValueError(f"static_bytes must be >= 0, got {static_bytes}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    return math.ceil(static_bytes * fraction)


def reserved_with_layout(loaded_bytes: int, static_bytes: int, fraction: float = DYNAMIC_FRACTION) -> int:
    """What a worker holds with a layout armed: the weights it placed at load (outside the arena),
    the static region and its dynamic region."""
    return loaded_bytes + static_bytes + dynamic_region_bytes(static_bytes, fraction)
