"""The caching-allocator model: segment sizes, pools, best fit, splitting, coalescing, and that
its blocks never overlap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xema_ray.allocator import simulate_arrays, simulate_caching_allocator
from xema_ray.allocator.caching_sim import allocation_size, round_size
from xema_ray.allocator.synthetic import diffusion_like_trace

KIB = 1024
MIB = 1 << 20


def test_rounding_and_segment_sizes_follow_the_allocator_constants() -> None:
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(1000) == 1024
    assert allocation_size(512) == 2 * MIB
    assert allocation_size(MIB) == 2 * MIB  # still small
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(11 * MIB + 1) == 12 * MIB


def test_small_requests_pack_into_one_two_mib_segment() -> None:
    n = 8
    r = simulate_arrays(np.full(n, 100 * KIB), np.arange(n), np.full(n, n + 1))
    assert r.reserved_peak_bytes == 2 * MIB
    assert len(r.segments) == 1 and r.segments[0].small
    assert r.address.tolist() == [i * 100 * KIB for i in range(n)]


def test_small_and_large_pools_do_not_share_segments() -> None:
    # A freed 2 MiB small segment cannot serve a 1.5 MiB (large) request.
    r = simulate_arrays(np.array([512 * KIB, 1536 * KIB]), np.array([0, 2]), np.array([1, 3]))
    assert [s.small for s in r.segments] == [True, False]
    assert r.reserved_peak_bytes == 22 * MIB


def test_large_block_split_only_above_one_mib_remainder() -> None:
    # 11 MiB request -> 12 MiB segment, remainder 1 MiB is not split (must be > 1 MiB), so a later
    # 512 KiB request cannot use it and a 1 MiB small request would not either (different pool).
    r = simulate_arrays(np.array([11 * MIB, 2 * MIB]), np.array([0, 1]), np.array([3, 3]))
    assert r.segments[0].size == 12 * MIB
    assert r.address[1] == 12 * MIB  # a new 20 MiB segment, not the 1 MiB tail
    assert r.reserved_peak_bytes == 32 * MIB


def test_best_fit_picks_smallest_free_block() -> None:
    # Three 12 MiB segments; free the 2nd (12 MiB) and shrink nothing; then a 10 MiB request must
    # take the smallest free block that fits.
    size = np.array([20 * MIB, 12 * MIB, 14 * MIB, 10 * MIB])
    begin = np.array([0, 1, 2, 5])
    end = np.array([4, 3, 4, 6])
    r = simulate_arrays(size, begin, end)
    # at t=5 the three segments (20, 12, 14 MiB) are all free; best fit for 10 MiB is the 12 MiB one
    assert r.address[3] == r.address[1]
    assert r.reserved_peak_bytes == (20 + 12 + 14) * MIB


def test_freed_neighbours_coalesce() -> None:
    # Two 3 MiB blocks split out of one 20 MiB segment; after both are freed a 6 MiB block fits at
    # the segment start without a new segment.
    size = np.array([3 * MIB, 3 * MIB, 6 * MIB])
    begin = np.array([0, 1, 4])
    end = np.array([2, 3, 5])
    r = simulate_arrays(size, begin, end)
    assert r.address[2] == 0
    assert r.reserved_peak_bytes == 20 * MIB


def test_zero_byte_requests_allocate_nothing() -> None:
    r = simulate_arrays(np.array([0, 512]), np.array([0, 1]), np.array([2, 3]))
    assert r.address[0] == -1
    assert r.active_peak_bytes == 512


def test_error_raised_if_lifetime_empty() -> None:
    with pytest.raises(ValueError, match=r"allocation 0 has size 512 and lifetime \[2, 2\)"):
        simulate_arrays(np.array([512]), np.array([2]), np.array([2]))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.integers(1, 2 * MIB), st.integers(1, 40 * MIB)),
            st.integers(0, 50),
            st.integers(1, 30),
        ),
        max_size=60,
    )
)
def test_live_blocks_never_overlap_and_lie_in_segments(rows: list[tuple[int, int, int]]) -> None:
    size = np.array([r[0] for r in rows], dtype=np.int64)
    begin = np.array([r[1] for r in rows], dtype=np.int64)
    end = begin + np.array([r[2] for r in rows], dtype=np.int64)
    r = simulate_arrays(size, begin, end)
    ext = np.array([round_size(int(s)) for s in size], dtype=np.int64)
    for i in range(len(rows)):
        seg = [s for s in r.segments if s.address <= r.address[i] < s.address + s.size]
        assert len(seg) == 1 and r.address[i] + ext[i] <= seg[0].address + seg[0].size
        for j in range(i + 1, len(rows)):
            if begin[i] < end[j] and begin[j] < end[i]:
                assert r.address[i] + ext[i] <= r.address[j] or r.address[j] + ext[j] <= r.address[i]
    assert r.reserved_peak_bytes >= r.active_peak_bytes
    assert r.reserved_peak_bytes == sum(s.size for s in r.segments)


def test_caching_allocator_reserves_more_than_the_static_layout() -> None:
    from xema_ray.allocator import solve_layout

    trace = diffusion_like_trace(blocks=4, steps=3)
    sim = simulate_caching_allocator(trace)
    layout = solve_layout(trace)
    assert sim.active_peak_bytes == trace.peak()
    assert sim.reserved_peak_bytes > layout.reserved_bytes >= layout.lower_bound_bytes
