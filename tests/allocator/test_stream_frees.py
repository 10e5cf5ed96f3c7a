"""Stream-ordered frees in the arena (libxema_alloc's host backend): a block another stream used
stays out of reuse until that stream has passed an event recorded at the free, and the bytes it
holds meanwhile count in the statistics (pending_free_bytes, part of active_bytes)."""

from __future__ import annotations

import pytest

from tests.host_arena import alloc, device  # noqa: F401 - fixtures
from xema_ray.allocator.runtime import StaticAllocator

pytestmark = pytest.mark.streams

COMPUTE, SIDE = 0, 0x5EED


def test_block_used_by_another_stream_is_not_reused_until_that_stream_passes(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(0, 1 << 20, device=device)
    alloc.host_stream_progress(SIDE, issued=3, completed=1)  # a copy queued on the side stream, not run
    a = alloc.malloc(4096, device=device, stream=COMPUTE)
    assert alloc.mark_used(a, SIDE, device=device)
    alloc.free(a, device=device, stream=COMPUTE)
    s = alloc.stats(device=device)
    assert (s.pending_free_bytes, s.pending_blocks, s.deferred_frees) == (4096, 1, 1)
    assert s.active_bytes == 4096  # still taken
    b = alloc.malloc(4096, device=device, stream=COMPUTE)
    assert b != a  # the compute stream's next block of that size is elsewhere
    alloc.host_stream_progress(SIDE, issued=3, completed=3)  # the side stream ran its work
    assert alloc.poll(device=device) == 1
    s = alloc.stats(device=device)
    assert (s.pending_free_bytes, s.pending_blocks, s.peak_pending_free_bytes) == (0, 0, 4096)
    c = alloc.malloc(4096, device=device, stream=COMPUTE)
    assert c == a  # back in the compute stream's free list, reused at once
    alloc.free(b, device=device, stream=COMPUTE)
    alloc.free(c, device=device, stream=COMPUTE)


def test_work_issued_after_the_free_does_not_hold_the_block(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(0, 1 << 20, device=device)
    alloc.host_stream_progress(SIDE, issued=2, completed=0)
    a = alloc.malloc(1000, device=device, stream=COMPUTE)
    alloc.mark_used(a, SIDE, device=device)
    alloc.free(a, device=device, stream=COMPUTE)  # event at the side stream's 2nd unit
    alloc.host_stream_progress(SIDE, issued=9, completed=2)
    assert alloc.poll(device=device) == 1


def test_allocation_polls_pending_frees(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(0, 1 << 20, device=device)
    alloc.host_stream_progress(SIDE, issued=1, completed=0)
    a = alloc.malloc(2048, device=device, stream=COMPUTE)
    alloc.mark_used(a, SIDE, device=device)
    alloc.free(a, device=device, stream=COMPUTE)
    alloc.host_stream_progress(SIDE, issued=1, completed=1)
    b = alloc.malloc(2048, device=device, stream=COMPUTE)  # polls first: a is free again
    assert b == a and alloc.stats(device=device).pending_blocks == 0
    alloc.free(b, device=device, stream=COMPUTE)


def test_same_stream_and_unmarked_frees_are_immediate(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(0, 1 << 20, device=device)
    a = alloc.malloc(512, device=device, stream=COMPUTE)
    alloc.mark_used(a, COMPUTE, device=device)  # its own stream: stream order already covers it
    alloc.free(a, device=device, stream=COMPUTE)
    assert alloc.stats(device=device).pending_blocks == 0
    assert not alloc.mark_used(a, SIDE, device=device)  # freed: no live block starts there


def test_error_raised_if_released_with_pending_frees(alloc: StaticAllocator, device: int) -> None:
    from xema_ray.allocator.runtime import AllocatorError

    alloc.reserve(0, 1 << 20, device=device)
    alloc.host_stream_progress(SIDE, issued=1, completed=0)
    a = alloc.malloc(512, device=device, stream=COMPUTE)
    alloc.mark_used(a, SIDE, device=device)
    alloc.free(a, device=device, stream=COMPUTE)
    with pytest.raises(AllocatorError, match="still in use by another stream"):
        alloc.release(device=device)
    alloc.host_stream_progress(SIDE, issued=1, completed=1)
    alloc.release(device=device)


def test_driver_block_frees_are_deferred_too(alloc: StaticAllocator, device: int) -> None:
    # no arena: the block comes from the backend and goes back to it only once the stream passed
    alloc.host_stream_progress(SIDE, issued=1, completed=0)
    a = alloc.malloc(4096, device=device, stream=COMPUTE)
    alloc.mark_used(a, SIDE, device=device)
    alloc.free(a, device=device, stream=COMPUTE)
    s = alloc.stats(device=device)
    assert s.pending_free_bytes == 4096 and s.reserved_bytes >= 4096
    alloc.host_stream_progress(SIDE, issued=1, completed=1)
    alloc.poll(device=device)
    assert alloc.stats(device=device).driver_active_bytes == 0


def test_a_block_is_free_for_its_own_stream_once_that_stream_is_ordered_after_the_user(alloc: StaticAllocator, device: int) -> None:
    # compute waited on a fresh side-stream event: its next kernels run after the copy, so its
    # next allocation may take the block even though the copy is not known to have finished
    alloc.reserve(0, 1 << 20, device=device)
    alloc.host_stream_progress(SIDE, issued=1, completed=0)
    a = alloc.malloc(4096, device=device, stream=COMPUTE)
    alloc.mark_used(a, SIDE, device=device)
    alloc.free(a, device=device, stream=COMPUTE)
    assert alloc.stream_ordered(SIDE, COMPUTE, device=device) == 0  # the side stream's blocks only
    assert alloc.stats(device=device).pending_blocks == 1
    assert alloc.stream_ordered(COMPUTE, SIDE, device=device) == 1
    b = alloc.malloc(4096, device=device, stream=COMPUTE)
    assert b == a
    alloc.free(b, device=device, stream=COMPUTE)
