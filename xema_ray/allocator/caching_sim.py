"""A simulation of PyTorch's CUDA caching allocator on a memory trace: what it would reserve.

The baseline the static layout is compared with (paper §6.1, Figure 7). It follows
``c10/cuda/CUDACachingAllocator.cpp`` with default settings on a single stream:

* requests are rounded up to 512 bytes (``round_size``);
* requests of at most 1 MiB (``kSmallSize``) use the small pool, whose segments are 2 MiB
  (``kSmallBuffer``); larger ones use the large pool, with 20 MiB segments (``kLargeBuffer``) for
  requests under 10 MiB (``kMinLargeAlloc``) and segments of the request rounded up to 2 MiB
  (``kRoundLarge``) above;
* a request takes the best-fitting free block of its pool (smallest size, then lowest address),
  else a new segment (``cudaMalloc``);
* the block is split when the remainder is at least 512 bytes (small pool) or more than 1 MiB
  (large pool); a freed block merges with free neighbours of its segment;
* segments are never returned (no ``empty_cache``, no OOM-triggered release, no
  ``max_split_size_mb``, no expandable segments).

Segments get consecutive virtual addresses in creation order, so ``address`` can be plotted on the
same axis as the static layout's offsets.

Example:
    >>> import numpy as np
    >>> r = simulate_arrays(np.array([3 << 20, 3 << 20]), np.array([0, 1]), np.array([2, 3]))
    >>> r.reserved_peak_bytes == 20 << 20, r.active_peak_bytes == 6 << 20
    (True, True)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from xema_ray.memory.trace import MemoryTrace

MIN_BLOCK_SIZE = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment size
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment for 1-10 MiB requests
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def round_size(size: int) -> int:
    """``round_size``: at least 512, then a multiple of 512."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return (size + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE * MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc``'d for a request that found no block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


@dataclass(frozen=True)
class Segment:
    """One ``cudaMalloc`` the caching allocator made."""

    address: int
    size: int
    small: bool
    created: int  # event time of the request that made it


@dataclass
class CachingAllocatorResult:
    """Outcome of ``simulate_caching_allocator``.

    Attributes:
        address: virtual address of each allocation (int64, -1 for zero-byte ones).
        segments: every segment, in creation order (never freed).
        reserved_peak_bytes: total segment bytes at the end (= the peak: nothing is released).
        active_peak_bytes: max live rounded bytes.
    """

    address: np.ndarray
    segments: list[Segment] = field(default_factory=list)
    reserved_peak_bytes: int = 0
    active_peak_bytes: int = 0

    @property
    def overhead(self) -> float:
        """``reserved / active peak``."""
        return self.reserved_peak_bytes / self.active_peak_bytes if self.active_peak_bytes else 1.0


class _Block:
    __slots__ = ("addr", "size", "free", "prev", "next", "small")

    def __init__(self, addr: int, size: int, small: bool) -> None:
        self.addr = addr
        self.size = size
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.small = small


class _Simulator:
    def __init__(self) -> None:
        # Per pool: free blocks as (size, addr), sorted: best fit = first entry >= (size, -1).
        self.pools: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self.blocks: dict[int, _Block] = {}
        self.segments: list[Segment] = []
        self.top = 0

    def malloc(self, size: int, t: int) -> int:
        size = round_size(size)
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            _, addr = pool.pop(i)
            block = self.blocks[addr]
        else:
            seg_size = allocation_size(size)
            block = _Block(self.top, seg_size, small)
            self.blocks[block.addr] = block
            self.segments.append(Segment(self.top, seg_size, small, t))
            self.top += seg_size
        remaining = block.size - size
        if (remaining >= MIN_BLOCK_SIZE) if small else (remaining > SMALL_SIZE):
            rest = _Block(block.addr + size, remaining, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self.blocks[rest.addr] = rest
            bisect.insort(pool, (rest.size, rest.addr))
        block.free = False
        return block.addr

    def free(self, addr: int) -> None:
        block = self.blocks[addr]
        block.free = True
        pool = self.pools[block.small]
        for neighbour in (block.next, block.prev):
            if neighbour is None or not neighbour.free:
                continue
            del pool[bisect.bisect_left(pool, (neighbour.size, neighbour.addr))]
            first, second = (block, neighbour) if neighbour is block.next else (neighbour, block)
            first.size += second.size
            first.next = second.next
            if second.next is not None:
                second.next.prev = first
            del self.blocks[second.addr]
            block = first
        bisect.insort(pool, (block.size, block.addr))


def simulate_caching_allocator(trace: MemoryTrace) -> CachingAllocatorResult:
    """Replay a trace through the caching-allocator model.

    Args:
        trace: the trace to replay; ``nbytes`` (the unrounded request) is what the allocator sees.
    """
    return simulate_arrays(trace.nbytes, trace.begin, trace.end)


def simulate_arrays(size: np.ndarray, begin: np.ndarray, end: np.ndarray) -> CachingAllocatorResult:
    """Replay raw columns (request bytes, event begin, event end) through the model.

    Zero-byte requests allocate nothing (the caching allocator returns a null pointer for them).
    """
    size = np.asarray(size, dtype=np.int64)
    begin = np.asarray(begin, dtype=np.int64)
    end = np.asarray(end, dtype=np.int64)
    if not (size.ndim == begin.ndim == end.ndim == 1 and len(size) == len(begin) == len(end)):
        raise ValueError(f"size, begin, end must be 1-D of one length, got shapes {size.shape}, {begin.shape}, {end.shape}")
    bad = np.flatnonzero((size < 0) | (begin < 0) | (begin >= end))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"allocation {i} has size {int(size[i])} and lifetime [{int(begin[i])}, {int(end[i])})")
    n = len(size)
    nz = np.flatnonzero(size > 0)
    times = np.concatenate([begin[nz], end[nz]])
    kinds = np.concatenate([np.ones(nz.size, np.int8), np.zeros(nz.size, np.int8)])  # frees first
    ids = np.concatenate([nz, nz])
    order = np.lexsort((kinds, times))

    sim = _Simulator()
    address = np.full(n, -1, dtype=np.int64)
    active = peak = 0
    for k in order.tolist():
        i = int(ids[k])
        if kinds[k]:
            address[i] = sim.malloc(int(size[i]), int(times[k]))
            active += round_size(int(size[i]))
            peak = max(peak, active)
        else:
            sim.free(int(address[i]))
            active -= round_size(int(size[i]))
    return CachingAllocatorResult(
        address=address, segments=sim.segments, reserved_peak_bytes=sim.top, active_peak_bytes=peak
    )
