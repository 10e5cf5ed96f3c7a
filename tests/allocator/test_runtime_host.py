"""The runtime allocator on a host arena: the same C functions torch would call (xema_malloc /
xema_free), driven through ctypes on a CPU. Every block is filled with a byte pattern when it is
handed out and checked when it is freed, so any overlap between live blocks shows up as corrupted
data (the CPU stand-in for "the output is unchanged")."""

from __future__ import annotations

import bisect
import ctypes
import threading

import numpy as np
import pytest

from tests.host_arena import alloc, device  # noqa: F401 - fixtures
from xema_ray.allocator import SolverOptions, solve_arrays, solve_layout
from xema_ray.allocator.runtime import AllocatorError, StaticAllocator
from xema_ray.allocator.synthetic import diffusion_like_trace, random_trace
from xema_ray.memory.trace import Category, MemoryTrace

KIB = 1024
MIB = 1 << 20


def small_trace(seed: int = 0) -> MemoryTrace:
    return diffusion_like_trace(blocks=3, steps=2, tokens=64, hidden=64, heads=4, vae_stages=2, seed=seed)


class Checker:
    """Tracks live blocks: fills each with a pattern, checks it at free, rejects overlaps."""

    def __init__(self) -> None:
        self.live: list[tuple[int, int, int]] = []  # (address, end, pattern) sorted by address
        self.size: dict[int, int] = {}

    def on_alloc(self, ptr: int, nbytes: int, pattern: int) -> None:
        end = ptr + nbytes
        pos = bisect.bisect_left(self.live, (ptr, end, pattern))
        if pos > 0:
            assert self.live[pos - 1][1] <= ptr, f"block {ptr:#x} overlaps a live block ending {self.live[pos - 1][1]:#x}"
        if pos < len(self.live):
            assert self.live[pos][0] >= end, f"block {ptr:#x}+{nbytes} overlaps a live block at {self.live[pos][0]:#x}"
        self.live.insert(pos, (ptr, end, pattern))
        self.size[ptr] = nbytes
        ctypes.memset(ptr, pattern, nbytes)

    def on_free(self, ptr: int) -> None:
        nbytes = self.size.pop(ptr)
        pos = next(k for k, (p, _, _) in enumerate(self.live) if p == ptr)
        pattern = self.live.pop(pos)[2]
        assert ctypes.string_at(ptr, nbytes) == bytes([pattern]) * nbytes, f"block {ptr:#x} was overwritten"


def replay(
    alloc: StaticAllocator,
    trace: MemoryTrace,
    device: int,
    *,
    requests: np.ndarray | None = None,
    free_all: bool = True,
    checker: Checker | None = None,
) -> tuple[np.ndarray, Checker]:
    """Allocate and free in the trace's event order; returns the address of each allocation."""
    requests = trace.nbytes if requests is None else requests
    checker = checker or Checker()
    events = sorted(
        [(int(trace.begin[i]), 1, i) for i in range(len(trace)) if requests[i] > 0]
        + [(int(trace.end[i]), 0, i) for i in range(len(trace)) if requests[i] > 0 and trace.end[i] < trace.n_events]
    )
    address = np.zeros(len(trace), dtype=np.int64)
    for _, kind, i in events:
        if kind == 1:
            address[i] = alloc.malloc(int(requests[i]), device=device)
            checker.on_alloc(int(address[i]), int(requests[i]), i % 251 + 1)
        else:
            checker.on_free(int(address[i]))
            alloc.free(int(address[i]), device=device)
    if free_all:
        for i in np.flatnonzero((trace.end == trace.n_events) & (requests > 0)):
            checker.on_free(int(address[i]))
            alloc.free(int(address[i]), device=device)
    return address, checker


def test_every_planned_allocation_hits(alloc: StaticAllocator, device: int) -> None:
    trace = small_trace()
    layout = solve_layout(trace)
    plan = layout.replay_plan()
    alloc.reserve(layout.reserved_bytes, device=device)
    base = alloc.stats(device=device).arena_base
    with alloc.armed(plan, device=device) as report:
        address, _ = replay(alloc, trace, device)
    assert report.hits == len(plan) == len(trace)
    assert report.misses == 0 and not report.fell_back
    assert np.array_equal(address - base, layout.offset)
    stats = alloc.stats(device=device)
    assert stats.active_bytes == 0
    assert stats.peak_active_bytes == trace.peak() == layout.lower_bound_bytes
    assert stats.reserved_bytes == layout.reserved_bytes + stats.dynamic_region_bytes


def test_a_second_request_hits_again(alloc: StaticAllocator, device: int) -> None:
    trace = small_trace(seed=1)
    layout = solve_layout(trace)
    alloc.reserve(layout.reserved_bytes, device=device)
    for _ in range(2):
        with alloc.armed(layout.replay_plan(), device=device) as report:
            replay(alloc, trace, device)
        assert report.hits == len(trace)
    assert alloc.stats(device=device).requests_armed == 2


@pytest.mark.parametrize("k", [0, 5, 40])
def test_forced_size_mismatch_falls_back_without_overlap(alloc: StaticAllocator, device: int, k: int) -> None:
    trace = small_trace()
    layout = solve_layout(trace)
    plan = layout.replay_plan()
    order = np.argsort(trace.begin, kind="stable")
    requests = trace.nbytes.copy()
    requests[order[k]] += 512  # rounds to a different size than planned
    alloc.reserve(layout.reserved_bytes, device=device)
    with alloc.armed(plan, device=device) as report:
        replay(alloc, trace, device, requests=requests)
    assert report.hits == k
    assert report.misses == len(plan) - k
    assert report.fell_back
    assert report.fallback_bytes > 0
    assert alloc.stats(device=device).requests_fell_back == 1


def test_live_previous_tenant_is_never_overwritten(alloc: StaticAllocator, device: int) -> None:
    # A and B share an offset (disjoint lifetimes). If A is still alive when B comes, the plan is
    # wrong about this run: B must go elsewhere and the request falls back.
    layout = solve_arrays(np.array([4 * KIB, 4 * KIB]), np.array([0, 2]), np.array([1, 3]))
    assert layout.offset.tolist() == [0, 0]
    alloc.reserve(layout.reserved_bytes, 64 * KIB, device=device)
    checker = Checker()
    with alloc.armed(layout.replay_plan(), device=device) as report:
        a = alloc.malloc(4 * KIB, device=device)
        checker.on_alloc(a, 4 * KIB, 1)
        b = alloc.malloc(4 * KIB, device=device)
        checker.on_alloc(b, 4 * KIB, 2)
    assert (report.hits, report.misses, report.fell_back) == (1, 1, True)
    assert b != a
    for p in (a, b):
        checker.on_free(p)
        alloc.free(p, device=device)


def test_tensor_kept_from_a_previous_request_makes_the_next_fall_back(alloc: StaticAllocator, device: int) -> None:
    trace = small_trace()
    layout = solve_layout(trace)
    plan = layout.replay_plan()
    alloc.reserve(layout.reserved_bytes, device=device)
    with alloc.armed(plan, device=device):
        address, checker = replay(alloc, trace, device, free_all=False)
    kept = np.flatnonzero(trace.end == trace.n_events)  # e.g. the output a client still holds
    with alloc.armed(plan, device=device) as report:
        second, checker2 = replay(alloc, trace, device, checker=Checker())
    assert report.fell_back and report.hits < len(plan)
    for i in kept:
        checker.on_free(int(address[i]))
        alloc.free(int(address[i]), device=device)
    assert not checker2.live


def test_frees_after_disarm_are_safe(alloc: StaticAllocator, device: int) -> None:
    trace = small_trace()
    layout = solve_layout(trace)
    alloc.reserve(layout.reserved_bytes, device=device)
    with alloc.armed(layout.replay_plan(), device=device):
        address, checker = replay(alloc, trace, device, free_all=False)
    assert not alloc.stats(device=device).armed
    with pytest.raises(AllocatorError, match="live bytes"):
        alloc.release(device=device)  # refused: those blocks will still be freed
    for i in np.flatnonzero(trace.end == trace.n_events):
        checker.on_free(int(address[i]))
        alloc.free(int(address[i]), device=device)
    assert alloc.stats(device=device).live_blocks == 0


def test_allocations_on_another_stream_are_unplanned(alloc: StaticAllocator, device: int) -> None:
    layout = solve_arrays(np.array([4 * KIB]), np.array([0]), np.array([1]))
    alloc.reserve(layout.reserved_bytes, 64 * KIB, device=device)
    with alloc.armed(layout.replay_plan(), device=device, stream=0) as report:
        other = alloc.malloc(4 * KIB, device=device, stream=0x1234)
        mine = alloc.malloc(4 * KIB, device=device, stream=0)
    assert (report.hits, report.unplanned) == (1, 1)
    stats = alloc.stats(device=device)
    assert stats.dynamic_active_bytes == 4 * KIB and stats.static_active_bytes == 4 * KIB
    alloc.free(other, device=device)
    alloc.free(mine, device=device)


def test_zero_byte_requests_consume_no_plan_index(alloc: StaticAllocator, device: int) -> None:
    layout = solve_arrays(np.array([4 * KIB]), np.array([0]), np.array([1]))
    alloc.reserve(layout.reserved_bytes, device=device)
    with alloc.armed(layout.replay_plan(), device=device) as report:
        assert alloc.malloc(0, device=device) == 0
        p = alloc.malloc(4000, device=device)
    assert report.hits == 1
    alloc.free(p, device=device)


def test_dynamic_region_best_fit_reuse_and_coalescing(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(0, 2 * MIB, device=device)
    dyn = alloc.stats(device=device).dynamic_base
    a, b, c = (alloc.malloc(256 * KIB, device=device) for _ in range(3))
    assert [a - dyn, b - dyn, c - dyn] == [0, 256 * KIB, 512 * KIB]
    alloc.free(b, device=device)
    d = alloc.malloc(200 * KIB, device=device)  # best fit: b's 256 KiB hole, not the 1.25 MiB tail
    assert d == b
    for p in (a, c, d):
        alloc.free(p, device=device)
    whole = alloc.malloc(2 * MIB, device=device)  # everything coalesced back into one block
    assert whole == dyn
    alloc.free(whole, device=device)
    stats = alloc.stats(device=device)
    assert stats.dynamic_allocs == 5 and stats.driver_allocs == 0


def test_freed_block_is_not_reused_by_another_stream(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(0, 1 * MIB, device=device)
    a = alloc.malloc(512 * KIB, device=device, stream=1)
    alloc.free(a, device=device, stream=1)
    # Stream 2 must not get the block stream 1 may still be using; it takes the untouched rest.
    b = alloc.malloc(256 * KIB, device=device, stream=2)
    assert b >= a + 512 * KIB
    c = alloc.malloc(512 * KIB, device=device, stream=1)
    assert c == a
    for p, s in ((b, 2), (c, 1)):
        alloc.free(p, device=device, stream=s)


def test_driver_is_the_last_resort(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(0, 64 * KIB, device=device)
    before = alloc.stats(device=device)
    big = alloc.malloc(1 * MIB, device=device)
    during = alloc.stats(device=device)
    assert during.driver_allocs == before.driver_allocs + 1
    assert during.reserved_bytes == before.reserved_bytes + MIB
    assert during.peak_reserved_bytes >= during.reserved_bytes
    alloc.free(big, device=device)
    assert alloc.stats(device=device).reserved_bytes == before.reserved_bytes


def test_without_an_arena_everything_goes_to_the_driver(alloc: StaticAllocator, device: int) -> None:
    p = alloc.malloc(1000, device=device)
    stats = alloc.stats(device=device)
    assert (stats.driver_allocs, stats.active_bytes, stats.reserved_bytes) == (1, 1024, 1024)
    alloc.free(p, device=device)


def test_unknown_frees_are_counted_not_followed(alloc: StaticAllocator, device: int) -> None:
    alloc.free(0xDEAD0000, device=device)
    alloc.free(0, device=device)  # a null free is a no-op, as for cudaFree
    assert alloc.stats(device=device).unknown_frees == 1


def test_peaks_reset(alloc: StaticAllocator, device: int) -> None:
    p = alloc.malloc(MIB, device=device)
    alloc.free(p, device=device)
    assert alloc.stats(device=device).peak_active_bytes == MIB
    alloc.reset_peaks(device=device)
    assert alloc.stats(device=device).peak_active_bytes == 0


def test_concurrent_threads_never_share_memory(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(0, 4 * MIB, device=device)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine: list[tuple[int, int, int]] = []
        try:
            for step in range(3000):
                if mine and (len(mine) > 40 or rng.random() < 0.5):
                    ptr, n, pattern = mine.pop(int(rng.integers(len(mine))))
                    assert ctypes.string_at(ptr, n) == bytes([pattern]) * n
                    alloc.free(ptr, device=device, stream=seed)
                else:
                    n = int(rng.integers(1, 128 * KIB))
                    ptr = alloc.malloc(n, device=device, stream=seed)
                    pattern = (seed * 31 + step) % 255 + 1
                    ctypes.memset(ptr, pattern, n)
                    mine.append((ptr, n, pattern))
            for ptr, n, pattern in mine:
                assert ctypes.string_at(ptr, n) == bytes([pattern]) * n
                alloc.free(ptr, device=device, stream=seed)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    stats = alloc.stats(device=device)
    assert stats.live_blocks == 0 and stats.active_bytes == 0
    assert stats.dynamic_allocs > 0


def test_recording_reproduces_the_trace(alloc: StaticAllocator, device: int) -> None:
    trace = small_trace()
    alloc.reserve(0, 64 * MIB, device=device)
    with alloc.record(device=device) as rec:
        address, checker = replay(alloc, trace, device, free_all=False)
    recorded = rec.trace()
    order = np.argsort(trace.begin, kind="stable")
    # Never-freed allocations of the trace are still live when recording stops.
    assert np.array_equal(recorded.size, trace.size[order])
    assert np.array_equal(recorded.nbytes, trace.nbytes[order])
    assert np.array_equal(recorded.begin, trace.begin[order])
    assert np.array_equal(recorded.end, trace.end[order])
    assert recorded.n_events == trace.n_events
    # A layout of the recorded trace replays with every allocation planned.
    layout = solve_layout(recorded)
    for i in np.flatnonzero(trace.end == trace.n_events):
        checker.on_free(int(address[i]))
        alloc.free(int(address[i]), device=device)
    alloc.release(device=device)
    alloc.reserve(layout.reserved_bytes, device=device)
    with alloc.armed(layout.replay_plan(), device=device) as report:
        replay(alloc, recorded, device)
    assert report.hits == len(recorded)


def test_random_traces_replay_with_every_allocation_planned(alloc: StaticAllocator, device: int) -> None:
    trace = random_trace(1500, seed=3, max_live=32, max_size=256 * KIB, keep=0.01)
    layout = solve_layout(trace, SolverOptions(segment_size=128))
    alloc.reserve(layout.reserved_bytes, device=device)
    with alloc.armed(layout.replay_plan(), device=device) as report:
        replay(alloc, trace, device)
    assert report.hits == len(trace)


def test_weights_first_then_requests(alloc: StaticAllocator, device: int) -> None:
    """The serving pattern: a resident plan while loading weights, then one plan per request."""
    trace = small_trace()
    layout = solve_layout(trace)
    resident = trace.category == Category.WEIGHT
    alloc.reserve(layout.reserved_bytes, device=device)
    weights = trace.subset(resident)
    with alloc.armed(layout.replay_plan(resident), device=device) as loaded:
        w_addr, w_check = replay(alloc, weights, device, free_all=False)
    assert loaded.hits == int(resident.sum())
    request = trace.subset(~resident)
    for _ in range(2):
        with alloc.armed(layout.replay_plan(~resident), device=device) as report:
            replay(alloc, request, device, checker=Checker())
        assert report.hits == int((~resident).sum())
    for i in range(len(weights)):
        w_check.on_free(int(w_addr[i]))
        alloc.free(int(w_addr[i]), device=device)


# ---------------------------------------------------------------------------- errors


def test_error_raised_if_plan_needs_more_than_the_static_region(alloc: StaticAllocator, device: int) -> None:
    layout = solve_arrays(np.array([8 * KIB]), np.array([0]), np.array([1]))
    alloc.reserve(4 * KIB, device=device)
    with pytest.raises(AllocatorError, match="needs a static region of 8192 bytes"):
        alloc.arm(layout.replay_plan(), device=device)


def test_error_raised_if_armed_twice(alloc: StaticAllocator, device: int) -> None:
    layout = solve_arrays(np.array([4 * KIB]), np.array([0]), np.array([1]))
    alloc.reserve(layout.reserved_bytes, device=device)
    alloc.arm(layout.replay_plan(), device=device)
    with pytest.raises(AllocatorError, match="already armed"):
        alloc.arm(layout.replay_plan(), device=device)
    alloc.disarm(device=device)


def test_error_raised_if_device_out_of_range(alloc: StaticAllocator) -> None:
    with pytest.raises(ValueError, match=r"device must be in \[0, 256\), got 256"):
        alloc.stats(device=256)


def test_error_raised_if_switching_backend_while_memory_is_held(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(0, 64 * KIB, device=device)
    with pytest.raises(AllocatorError, match="cannot switch backend from host to cuda"):
        StaticAllocator("cuda")
    assert StaticAllocator("host").backend == "host"


def test_error_raised_if_reserving_negative_bytes(alloc: StaticAllocator, device: int) -> None:
    with pytest.raises(ValueError, match="arena sizes must be >= 0"):
        alloc.reserve(-1, device=device)


def test_error_raised_if_warm_up_while_armed(alloc: StaticAllocator, device: int) -> None:
    layout = solve_arrays(np.array([4 * KIB]), np.array([0]), np.array([1]))
    alloc.reserve(layout.reserved_bytes, device=device)
    ran: list[int] = []
    stats = alloc.warm_up(lambda: ran.append(1), device=device)
    assert ran == [1] and not stats.armed
    alloc.arm(layout.replay_plan(), device=device)
    with pytest.raises(AllocatorError, match="warm up before arming"):
        alloc.warm_up(lambda: None, device=device)
    alloc.disarm(device=device)


def test_stats_mirror_the_c_struct() -> None:
    from xema_ray.allocator.runtime import AllocatorStats, _CStats

    assert ctypes.sizeof(_CStats) == 8 * len(AllocatorStats.model_fields) == 8 * 31


TINY_TEMPLATES = [("tiny-flux2", 64, 64, 1), ("tiny-cogvideox", 64, 64, 9), ("tiny-ltx2", 64, 64, 9)]


@pytest.mark.parametrize(("model", "height", "width", "frames"), TINY_TEMPLATES, ids=[t[0] for t in TINY_TEMPLATES])
def test_traced_tiny_model_request_replays_on_the_host_arena(
    alloc: StaticAllocator, device: int, model: str, height: int, width: int, frames: int
) -> None:
    """The analyzer's trace of a real (tiny) pipeline: weights loaded under a resident plan, then
    two requests under the request plan, every allocation planned; then a request whose 100th
    allocation comes with another size falls back without touching live data."""
    from xema_ray.analyzer import run as analyzer
    from xema_ray.templates import RequestTemplate

    trace = analyzer.trace_template(RequestTemplate(model=model, height=height, width=width, frames=frames, steps=2))
    layout = solve_layout(trace)
    layout.verify()
    assert layout.reserved_bytes <= 1.02 * layout.lower_bound_bytes
    resident = trace.category == Category.WEIGHT
    alloc.reserve(layout.reserved_bytes, device=device)

    weights = trace.subset(resident)
    with alloc.armed(layout.replay_plan(resident), device=device) as loaded:
        w_addr, w_check = replay(alloc, weights, device, free_all=False)
    assert loaded.hits == int((weights.size > 0).sum())

    request = trace.subset(~resident)
    plan = layout.replay_plan(~resident)
    for _ in range(2):
        with alloc.armed(plan, device=device) as report:
            replay(alloc, request, device, checker=Checker())
        assert (report.hits, report.misses) == (len(plan), 0)

    requests = request.nbytes.copy()
    k = int(np.argsort(request.begin, kind="stable")[100])
    requests[k] += 4096
    with alloc.armed(plan, device=device) as report:
        replay(alloc, request, device, requests=requests, checker=Checker())
    assert report.fell_back and report.hits == 100

    for i in np.flatnonzero(weights.size > 0):
        w_check.on_free(int(w_addr[i]))
        alloc.free(int(w_addr[i]), device=device)


def test_unloaded_plan_stays_valid_while_armed(alloc: StaticAllocator, device: int) -> None:
    layout = solve_arrays(np.array([4 * KIB]), np.array([0]), np.array([1]))
    plan = layout.replay_plan()
    alloc.reserve(layout.reserved_bytes, device=device)
    alloc.arm(plan, device=device)
    alloc.unload(plan, device=device)
    p = alloc.malloc(4 * KIB, device=device)
    assert alloc.stats(device=device).planned_hits == 1
    alloc.disarm(device=device)
    alloc.free(p, device=device)
    with alloc.armed(plan, device=device) as report:  # loaded again on demand
        q = alloc.malloc(4 * KIB, device=device)
    assert report.hits == 1
    alloc.free(q, device=device)


# ---------------------------------------------------------------- resize_static (the arena follows the template)


def test_resize_static_refused_while_a_static_block_is_live(alloc: StaticAllocator, device: int) -> None:
    layout = solve_arrays(np.array([4 * KIB, 8 * KIB]), np.array([0, 1]), np.array([2, 3]))
    alloc.reserve(layout.reserved_bytes, 64 * KIB, device=device)
    with alloc.armed(layout.replay_plan(), device=device):
        a = alloc.malloc(4 * KIB, device=device)
    with pytest.raises(AllocatorError, match=r"wrong state.*static region still holds 4096 live bytes in 1 block"):
        alloc.resize_static(64 * KIB, device=device)
    assert alloc.stats(device=device).static_region_bytes == layout.reserved_bytes  # unchanged
    alloc.free(a, device=device)
    alloc.resize_static(64 * KIB, device=device)
    stats = alloc.stats(device=device)
    assert (stats.static_region_bytes, stats.static_resizes) == (64 * KIB, 1)


def test_resize_static_refused_while_armed(alloc: StaticAllocator, device: int) -> None:
    layout = solve_arrays(np.array([4 * KIB]), np.array([0]), np.array([1]))
    alloc.reserve(layout.reserved_bytes, 64 * KIB, device=device)
    alloc.arm(layout.replay_plan(), device=device)
    with pytest.raises(AllocatorError, match="is armed; disarm before resizing the static region"):
        alloc.resize_static(0, device=device)
    alloc.disarm(device=device)
    alloc.resize_static(0, device=device)
    assert alloc.stats(device=device).static_region_bytes == 0


def test_resize_static_refused_without_an_arena(alloc: StaticAllocator, device: int) -> None:
    with pytest.raises(AllocatorError, match="has no arena; reserve before resizing"):
        alloc.resize_static(4 * KIB, device=device)
    with pytest.raises(ValueError, match="static_bytes must be >= 0"):
        alloc.resize_static(-1, device=device)


def test_dynamic_region_data_survives_static_resizes(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(1 * MIB, 256 * KIB, device=device)
    dyn = alloc.stats(device=device).dynamic_base
    kept = [alloc.malloc(32 * KIB, device=device) for _ in range(3)]  # a warm-up's workspaces
    for k, p in enumerate(kept):
        assert dyn <= p < dyn + 256 * KIB
        ctypes.memset(p, 0x41 + k, 32 * KIB)
    for size in (64 * KIB, 4 * MIB, 0, 2 * MIB):  # shrink, grow, none, grow again
        alloc.resize_static(size, device=device)
        stats = alloc.stats(device=device)
        assert (stats.static_region_bytes, stats.dynamic_base, stats.dynamic_active_bytes) == (size, dyn, 96 * KIB)
        assert stats.reserved_bytes == size + 256 * KIB
    for k, p in enumerate(kept):
        assert ctypes.string_at(p, 32 * KIB) == bytes([0x41 + k]) * (32 * KIB)
        alloc.free(p, device=device)
    assert alloc.stats(device=device).static_resizes == 4


def test_resize_static_frees_before_it_allocates(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(4 * MIB, 64 * KIB, device=device)
    alloc.reset_peaks(device=device)
    alloc.resize_static(1 * MIB, device=device)
    alloc.resize_static(3 * MIB, device=device)
    # never old + new at once: the peak is the larger of the two arenas, not their sum
    assert alloc.stats(device=device).peak_reserved_bytes == 4 * MIB + 64 * KIB


def test_resized_static_region_serves_a_plan_that_needs_it(alloc: StaticAllocator, device: int) -> None:
    trace = small_trace()
    layout = solve_layout(trace)
    alloc.reserve(0, 64 * KIB, device=device)
    with pytest.raises(AllocatorError, match="needs a static region"):
        alloc.arm(layout.replay_plan(), device=device)
    alloc.resize_static(layout.reserved_bytes, device=device)
    with alloc.armed(layout.replay_plan(), device=device) as report:
        replay(alloc, trace, device)
    assert (report.hits, report.misses) == (len(layout), 0)


def test_a_refused_grow_leaves_the_static_region_as_it_was(alloc: StaticAllocator, device: int) -> None:
    alloc.reserve(1 * MIB, 64 * KIB, device=device)
    with pytest.raises(AllocatorError, match=r"out of memory.*refused.*back at 1048576 bytes"):
        alloc.resize_static(1 << 50, device=device)  # beyond the address space: the host mmap fails
    stats = alloc.stats(device=device)
    assert (stats.static_region_bytes, stats.reserved_bytes) == (1 * MIB, 1 * MIB + 64 * KIB)
    p = alloc.malloc(KIB, device=device)  # the arena still works
    alloc.free(p, device=device)
