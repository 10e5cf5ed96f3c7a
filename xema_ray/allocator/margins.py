"""The numbers every consumer of a static layout shares: the dynamic region's size (of one
layout, and of a model group's worker, whose templates share one dynamic region) and the
planner's allowance for a layout it has not solved yet. One definition, used by the runtime
allocator (``StaticAllocator.reserve``), the host-arena replay, the worker's layouts, the
planner's layout stage and its memory model.

Example:
    >>> dynamic_region_bytes(20 * 10**9)
    1000000000
    >>> GB = 10**9  # Flux.2's group on one 48 GB A6000: the largest entry leaves 0.25 GB, less than 5 %
    >>> group_dynamic_bytes([(21_430_000_000, 26_320_000_000), (15_540_000_000, 31_030_000_000)], 48 * GB)
    249999872
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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


#: The smallest dynamic region a worker reserves: what ``StaticAllocator.warm_up`` leaves there for
#: good (cuBLAS's workspace, 32 MiB per handle and stream on Hopper, ~8 MiB on Ampere; cuBLASLt's
#: and the attention kernels' scratch) with room for the few allocations a plan does not know.
MIN_DYNAMIC_BYTES = 128 * 2**20

#: The runtime allocator rounds every region and request up to this (c10's kMinBlockSize).
ALLOCATION_BLOCK = 512


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


def group_dynamic_bytes(entries: Iterable[tuple[int, int]], budget_bytes: int | None = None,
                        fraction: float = DYNAMIC_FRACTION, floor: int = MIN_DYNAMIC_BYTES) -> int:
    """The one dynamic region of a worker that serves several templates with static layouts.

    The static region follows the template being run (``StaticAllocator.resize_static``) but the
    dynamic region cannot: the long-lived blocks of ``warm_up`` live in it. So it is sized once,
    for every entry of the group: ``fraction`` of the largest static region, but never more than
    the budget leaves next to the largest entry (its weights and its static region), and never
    less than ``floor``. An entry that does not fit even with ``floor`` (``fits_with_layout`` is
    false for it) does not shrink the others' region: its batches run without their layout.

    Args:
        entries: per entry of the group, (weight bytes its load places on the device
            (``LayoutArtifact.loaded_bytes``), its static region (the layout's ``reserved_bytes``)).
        budget_bytes: device memory per worker; None: not known, ``fraction`` alone decides.
        fraction: share of the largest static region (``DYNAMIC_FRACTION``, paper §6.2).
        floor: the smallest region (``MIN_DYNAMIC_BYTES``).

    Returns:
        The dynamic region's bytes, a multiple of ``ALLOCATION_BLOCK`` (rounded down, so the
        allocator's rounding never takes it over the budget); each entry's predicted peak is then
        ``loaded + static + group_dynamic_bytes(...)`` (``entry_peak_bytes``).
    """
    pairs = [(int(loaded), int(static)) for loaded, static in entries]
    if not pairs:
        raise ValueError("group_dynamic_bytes needs at least one (loaded_bytes, static_bytes) entry")
    if any(loaded < 0 or static < 0 for loaded, static in pairs):
        raise ValueError(f"loaded and static bytes must be >= 0, got {pairs}")
    if floor < 0:
        raise ValueError(f"floor must be >= 0, got {floor}")
    fitting = [p for p in pairs if fits_with_layout(*p, floor, budget_bytes)]
    if not fitting:
        return floor
    wanted = dynamic_region_bytes(max(static for _, static in fitting), fraction)
    if budget_bytes is not None:
        wanted = min(wanted, budget_bytes - max(loaded + static for loaded, static in fitting))
    return max(floor, wanted // ALLOCATION_BLOCK * ALLOCATION_BLOCK)


def entry_peak_bytes(loaded_bytes: int, static_bytes: int, dynamic_bytes: int) -> int:
    """What a worker holds while it runs an entry with its layout armed: the entry's weights
    (placed outside the arena), its static region and the group's dynamic region."""
    return loaded_bytes + static_bytes + dynamic_bytes


def fits_with_layout(loaded_bytes: int, static_bytes: int, dynamic_bytes: int, budget_bytes: int | None) -> bool:
    """Whether an entry can run with its layout armed next to a dynamic region of ``dynamic_bytes``
    (always, where the budget is not known)."""
    return budget_bytes is None or entry_peak_bytes(loaded_bytes, static_bytes, dynamic_bytes) <= budget_bytes
