"""The layout solver (Algorithm 1): validity on random and real traces, the algorithm's choices on
hand-made cases, input validation and the JSON artifact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xema_ray.allocator import (
    SolverOptions,
    StaticLayout,
    first_overlap,
    lower_bound,
    solve_arrays,
    solve_layout,
)
from xema_ray.allocator.synthetic import diffusion_like_trace, random_trace

KIB = 1024
MIB = 1 << 20


def brute_force_overlap(size: np.ndarray, begin: np.ndarray, end: np.ndarray, offset: np.ndarray, align: int) -> bool:
    """O(n^2) reference check, independent of both the solver and ``first_overlap``."""
    ext = (size + align - 1) // align * align
    for i in range(len(size)):
        for j in range(i + 1, len(size)):
            if ext[i] == 0 or ext[j] == 0:
                continue
            live_together = begin[i] < end[j] and begin[j] < end[i]
            share_address = offset[i] < offset[j] + ext[j] and offset[j] < offset[i] + ext[i]
            if live_together and share_address:
                return True
    return False


def brute_force_lower_bound(size: np.ndarray, begin: np.ndarray, end: np.ndarray, align: int) -> int:
    ext = (size + align - 1) // align * align
    times = sorted(set(begin.tolist()))
    return max((int(ext[(begin <= t) & (end > t)].sum()) for t in times), default=0)


@st.composite
def allocations(draw: st.DrawFn, max_n: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = draw(st.integers(0, max_n))
    # Sizes from a small menu so equal sizes (ties) and exact fits are common, plus odd ones.
    size = draw(
        st.lists(
            st.one_of(st.sampled_from([0, 512, 1024, 1536, 4096, MIB]), st.integers(1, 3 * MIB)),
            min_size=n,
            max_size=n,
        )
    )
    begin = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    length = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    b = np.array(begin, dtype=np.int64)
    return np.array(size, dtype=np.int64), b, b + np.array(length, dtype=np.int64)


options_strategy = st.builds(
    SolverOptions,
    alignment=st.sampled_from([512, 256, 4096]),
    orders=st.sampled_from(
        [
            ("size",),
            ("size_longer_first",),
            ("area",),
            ("lifetime",),
            ("long_first",),
            ("size", "size_longer_first", "area", "lifetime", "long_first"),
        ]
    ),
    hoist_universal=st.booleans(),
    compact=st.booleans(),
    segment_size=st.sampled_from([0, 2, 5, 4096]),
    segment_max_crossing=st.sampled_from([0.1, 1.0]),
    refine_iterations=st.sampled_from([0, 3, 48]),
    descent=st.booleans(),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(allocations(), options_strategy)
def test_random_layouts_are_valid(cols: tuple[np.ndarray, np.ndarray, np.ndarray], options: SolverOptions) -> None:
    size, begin, end = cols
    layout = solve_arrays(size, begin, end, options=options)
    align = options.alignment
    ext = (size + align - 1) // align * align

    assert not brute_force_overlap(size, begin, end, layout.offset, align)
    assert np.all(layout.offset % align == 0)
    assert np.all(layout.offset >= 0)
    assert layout.lower_bound_bytes == brute_force_lower_bound(size, begin, end, align)
    assert layout.reserved_bytes >= layout.lower_bound_bytes
    assert layout.reserved_bytes == (int((layout.offset + ext).max()) if len(size) else 0)
    # Candidates are each order's greedy before compaction; the greedy keeps the better order per
    # segment and compacts the segments that set the peak.
    assert layout.greedy_reserved_bytes <= min(layout.candidates.values())
    assert layout.lower_bound_bytes <= layout.reserved_bytes <= layout.greedy_reserved_bytes
    layout.verify()


@settings(max_examples=100, deadline=None)
@given(allocations(max_n=30))
def test_first_overlap_agrees_with_brute_force(cols: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    size, begin, end = cols
    # Random offsets: overlaps are frequent, so both answers get exercised.
    rng = np.random.default_rng(len(size))
    offset = rng.integers(0, 8, size=len(size)) * 512
    ext = (size + 511) // 512 * 512
    assert (first_overlap(ext, begin, end, offset) is not None) == brute_force_overlap(size, begin, end, offset, 512)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**16), st.integers(8, 128))
def test_random_trace_layouts_are_valid(seed: int, max_live: int) -> None:
    trace = random_trace(800, seed=seed, max_live=max_live, keep=0.01)
    layout = solve_layout(trace)
    layout.verify()
    assert layout.lower_bound_bytes == trace.peak()
    assert layout.reserved_bytes >= layout.lower_bound_bytes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_diffusion_like_traces_meet_the_target(seed: int) -> None:
    trace = diffusion_like_trace(blocks=6, steps=3, seed=seed)
    layout = solve_layout(trace)
    layout.verify()
    assert layout.lower_bound_bytes == trace.peak()
    assert layout.reserved_bytes <= 1.02 * layout.lower_bound_bytes


def test_hundred_thousand_allocations_solve() -> None:
    """Size sanity, not timing (timings are in bench/bench_layout.py)."""
    trace = diffusion_like_trace(blocks=42, steps=170, seed=3)
    assert len(trace) > 100_000
    layout = solve_layout(trace)
    layout.verify()
    assert layout.reserved_bytes <= 1.02 * layout.lower_bound_bytes


@pytest.mark.slow
def test_cogvideox_720p_meets_the_target() -> None:
    """Issue #3's target on the analyzer's trace that missed it: the VAE decode, where each batch's
    conv caches live until the next batch has made its own."""
    from xema_ray.analyzer import run as analyzer
    from xema_ray.templates import RequestTemplate

    trace = analyzer.trace_template(RequestTemplate(model="cogvideox-5b", height=720, width=1280, frames=49))
    layout = solve_layout(trace)
    layout.verify()
    assert layout.reserved_bytes <= 1.02 * layout.lower_bound_bytes


# ---------------------------------------------------------------------------- Algorithm 1's choices


def test_disjoint_lifetimes_share_one_address() -> None:
    layout = solve_arrays(np.array([4096, 4096, 4096]), np.array([0, 2, 4]), np.array([2, 4, 6]))
    assert layout.offset.tolist() == [0, 0, 0]
    assert layout.reserved_bytes == layout.lower_bound_bytes == 4096


def test_best_fit_takes_the_smallest_gap_that_fits() -> None:
    # Placement order is size descending, ties by index: P0 F1 P1 F2 P2 D. The fillers F1, F2 live
    # only at t=0 and stack P0, P1, P2 apart; while D lives ([2, 10)) the conflicts are P0 [0, 4K),
    # P1 [6K, 8K), P2 [9K, 10K), leaving a 2 KiB gap at 4K and a 1 KiB gap at 8K. Best fit takes the
    # 1 KiB one (first fit would have taken 4K).
    #                 P0      F1      P1      F2   P2   D
    size = np.array([4 * KIB, 2 * KIB, 2 * KIB, KIB, KIB, KIB])
    begin = np.array([0, 0, 0, 0, 0, 2])
    end = np.array([10, 1, 10, 1, 10, 10])
    opts = SolverOptions(hoist_universal=False, compact=False, refine_iterations=0)
    layout = solve_arrays(size, begin, end, options=opts)
    assert layout.offset.tolist() == [0, 4 * KIB, 6 * KIB, 8 * KIB, 9 * KIB, 8 * KIB]
    assert layout.reserved_bytes == 10 * KIB


def test_no_fitting_gap_goes_above_all_conflicts() -> None:
    size = np.array([2 * KIB, 2 * KIB, 3 * KIB])
    begin = np.array([0, 0, 0])
    end = np.array([5, 5, 5])
    layout = solve_arrays(size, begin, end)
    assert sorted(layout.offset.tolist()) == [0, 3 * KIB, 5 * KIB]
    assert layout.reserved_bytes == 7 * KIB


def test_universal_allocations_are_stacked_at_the_bottom() -> None:
    trace = diffusion_like_trace(blocks=2, steps=2)
    layout = solve_layout(trace)
    weights = trace.category == 0
    assert int((layout.offset[weights] + trace.size[weights]).max()) <= trace.resident_bytes() + int(
        trace.size[trace.category == 1].sum()
    )


def test_time_segments_and_refinement_stay_valid_on_long_traces() -> None:
    trace = random_trace(6000, seed=7, max_live=24, keep=0.002)
    options = SolverOptions(segment_size=256, segment_max_crossing=1.0)
    layout = solve_layout(trace, options)
    layout.verify()
    assert layout.segments > 10
    assert layout.lower_bound_bytes <= layout.reserved_bytes <= layout.greedy_reserved_bytes


def test_error_raised_if_segment_crossing_fraction_out_of_range() -> None:
    with pytest.raises(ValueError):
        SolverOptions(segment_max_crossing=1.5)
    from xema_ray.allocator import _solver

    with pytest.raises(ValueError, match="segment_max_crossing"):
        _solver.solve(np.array([512]), np.array([0]), np.array([1]), segment_max_crossing=2.0)


def test_compaction_never_raises_the_peak() -> None:
    for seed in range(5):
        trace = random_trace(2000, seed=seed, max_live=48)
        plain = solve_layout(trace, SolverOptions(compact=False, refine_iterations=0, descent=False))
        compacted = solve_layout(trace, SolverOptions(compact=True, refine_iterations=0, descent=False))
        compacted.verify()
        assert compacted.reserved_bytes <= plain.reserved_bytes
        assert np.all(compacted.offset <= plain.offset)


def test_descent_never_raises_the_peak() -> None:
    # The descent runs after everything else and only accepts a level that fully succeeds, so it
    # can only lower the segments it visits; the layout stays valid.
    for seed in range(6):
        trace = random_trace(3000, seed=seed, max_live=64)
        for refine in (0, 48):
            without = solve_layout(trace, SolverOptions(refine_iterations=refine, descent=False))
            with_descent = solve_layout(trace, SolverOptions(refine_iterations=refine, descent=True))
            with_descent.verify()
            assert with_descent.lower_bound_bytes <= with_descent.reserved_bytes <= without.reserved_bytes


def test_descent_evicts_what_is_in_the_way() -> None:
    # Size order, ties by index: C [0, 2K), D [2K, 4K), E [2K, 4K) (after D ends), A [4K, 5K); B
    # (1 KiB, [1, 5)) comes last and only fits at 5K: 6 KiB. The descent moves B to 2K and
    # evicts D one KiB up: 5 KiB, the lower bound. Compaction and refinement alone stay at 6 KiB.
    #                  A        B        C        D        E
    size = np.array([1 * KIB, 1 * KIB, 2 * KIB, 2 * KIB, 2 * KIB])
    begin = np.array([4, 1, 2, 2, 5])
    end = np.array([7, 5, 6, 3, 8])
    opts = SolverOptions(orders=("size",), hoist_universal=False, segment_size=0, descent=False)
    without = solve_arrays(size, begin, end, options=opts)
    with_descent = solve_arrays(size, begin, end, options=opts.model_copy(update={"descent": True}))
    with_descent.verify()
    assert without.reserved_bytes == 6 * KIB
    assert with_descent.reserved_bytes == with_descent.lower_bound_bytes == 5 * KIB
    assert with_descent.offset.tolist() == [4 * KIB, 2 * KIB, 0, 3 * KIB, 2 * KIB]


def cache_generations(sizes: list[int], activation: int, generations: int = 3) -> tuple[np.ndarray, ...]:
    """Conv-cache-like generations, as in the CogVideoX VAE decode: generation g creates one cache
    per layer, two events apart, and each lives until the next generation has created all of its
    own; one short activation per generation lands between the first two creations."""
    k = len(sizes)
    period = 4 * k
    size, begin, end = [], [], []
    for g in range(generations):
        for j, s in enumerate(sizes):
            size.append(s)
            begin.append(g * period + 2 * j)
            end.append((g + 1) * period + 2 * k + j)
        size.append(activation)
        begin.append(g * period + 3)
        end.append(g * period + 4)
    return np.array(size), np.array(begin), np.array(end)


def test_long_first_stacks_cache_generations_from_both_ends() -> None:
    size, begin, end = cache_generations([3 * MIB, 3 * MIB, 3 * MIB], activation=4 * MIB)
    greedy_only = SolverOptions(
        hoist_universal=False, compact=False, segment_size=0, refine_iterations=0, descent=False
    )
    by_size = solve_arrays(size, begin, end, options=greedy_only.model_copy(update={"orders": ("size",)}))
    two_sided = solve_arrays(size, begin, end, options=greedy_only.model_copy(update={"orders": ("long_first",)}))
    two_sided.verify()
    # Size order places the (larger) activations first, at the base, so every generation of caches
    # stacks on top of the one before it (22 MiB); two-sided placement keeps consecutive
    # generations at opposite ends and the activations in between (19 MiB, the lower bound).
    assert by_size.reserved_bytes > by_size.lower_bound_bytes
    assert two_sided.reserved_bytes == two_sided.lower_bound_bytes == 19 * MIB
    # By default both orders run and each segment keeps the better one.
    assert solve_arrays(size, begin, end).reserved_bytes == 19 * MIB


def test_zero_byte_allocations_take_no_space() -> None:
    layout = solve_arrays(np.array([0, 512, 0]), np.array([0, 0, 1]), np.array([3, 3, 2]))
    assert layout.reserved_bytes == 512
    assert layout.lower_bound_bytes == 512


def test_lower_bound_matches_trace_peak() -> None:
    trace = diffusion_like_trace(blocks=3, steps=2)
    assert lower_bound(trace.size, trace.begin, trace.end) == trace.peak()


def test_half_open_lifetimes_do_not_conflict() -> None:
    # [0, 5) and [5, 9): one frees at the instant the other is allocated; they may share addresses.
    layout = solve_arrays(np.array([MIB, MIB]), np.array([0, 5]), np.array([5, 9]))
    assert layout.offset.tolist() == [0, 0]


# ---------------------------------------------------------------------------- validation


def test_error_raised_if_begin_not_before_end() -> None:
    with pytest.raises(ValueError, match=r"allocation 1 has lifetime \[4, 4\)"):
        solve_arrays(np.array([512, 512]), np.array([0, 4]), np.array([3, 4]))


def test_error_raised_if_size_negative() -> None:
    with pytest.raises(ValueError, match="allocation 0 has negative size -1"):
        solve_arrays(np.array([-1]), np.array([0]), np.array([1]))


def test_error_raised_if_columns_differ_in_length() -> None:
    with pytest.raises(ValueError, match="differ in length: 2, 1, 1"):
        solve_arrays(np.array([512, 512]), np.array([0]), np.array([1]))


def test_error_raised_if_columns_are_not_integers() -> None:
    with pytest.raises(ValueError, match="size must hold integers, got dtype float64"):
        solve_arrays(np.array([512.0]), np.array([0]), np.array([1]))


def test_error_raised_if_end_after_trace() -> None:
    with pytest.raises(ValueError, match="ends at 9, after the trace's 5 events"):
        solve_arrays(np.array([512]), np.array([0]), np.array([9]), n_events=5)


def test_error_raised_if_alignment_not_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two, got 768"):
        SolverOptions(alignment=768)


def test_error_raised_if_unknown_order() -> None:
    with pytest.raises(ValueError):
        SolverOptions(orders=("random",))  # type: ignore[arg-type]


def test_native_solver_rejects_bad_input_with_value_error() -> None:
    from xema_ray.allocator import _solver

    with pytest.raises(ValueError, match=r"lifetime \[3, 2\)"):
        _solver.solve(np.array([512]), np.array([3]), np.array([2]))
    with pytest.raises(ValueError, match="unknown layout order 'x'"):
        _solver.solve(np.array([512]), np.array([0]), np.array([2]), orders=["x"])


def test_verify_reports_an_overlap() -> None:
    layout = solve_arrays(np.array([512, 512]), np.array([0, 0]), np.array([2, 2]))
    broken = StaticLayout(**{**layout.__dict__, "offset": np.array([0, 0])})
    with pytest.raises(ValueError, match="allocations 0 and 1 overlap"):
        broken.verify()


# ---------------------------------------------------------------------------- artifact and plans


def test_layout_json_round_trip(tmp_path: Path) -> None:
    trace = diffusion_like_trace(blocks=2, steps=2)
    layout = solve_layout(trace)
    path = tmp_path / "layout.json"
    layout.save(path)
    again = StaticLayout.load(path)
    for column in ("size", "begin", "end", "offset"):
        assert np.array_equal(getattr(again, column), getattr(layout, column))
    assert again.reserved_bytes == layout.reserved_bytes
    assert again.options == layout.options
    assert again.key() == layout.key()
    assert again.meta["generator"] == "diffusion_like_trace"


def test_error_raised_if_layout_schema_version_differs(tmp_path: Path) -> None:
    layout = solve_arrays(np.array([512]), np.array([0]), np.array([1]))
    data = json.loads(layout.to_file().model_dump_json())
    data["schema_version"] = 99
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema version 99 is not supported"):
        StaticLayout.load(path)


def test_replay_plan_is_in_allocation_order_without_empty_rows() -> None:
    size = np.array([1024, 0, 512, 700])
    begin = np.array([3, 0, 1, 2])
    end = np.array([5, 4, 6, 4])
    layout = solve_arrays(size, begin, end)
    plan = layout.replay_plan()
    order = [2, 3, 0]  # by begin, zero-byte row 1 dropped
    assert plan.sizes.tolist() == [512, 1024, 1024]
    assert plan.offsets.tolist() == layout.offset[order].tolist()
    assert plan.static_bytes <= layout.reserved_bytes
    sub = layout.replay_plan(np.array([False, False, True, True]))
    assert sub.sizes.tolist() == [512, 1024]
    assert sub.key != plan.key


def test_error_raised_if_replay_rows_out_of_range() -> None:
    layout = solve_arrays(np.array([512]), np.array([0]), np.array([1]))
    with pytest.raises(ValueError, match="row mask has shape"):
        layout.replay_plan(np.array([True, False]))
    with pytest.raises(ValueError, match="row indices span"):
        layout.replay_plan(np.array([3]))


@pytest.mark.parametrize(("n", "max_live", "seed", "layout_id"), [
    (3000, 300, 1, "9cf675a6bb4ff9c5"),  # hundreds of conflicts per placement: GapFinder's radix order
    (2000, 64, 3, "2be3198638b332af"),  # tens: the comparison sort
])
def test_solved_offsets_are_pinned(n: int, max_live: int, seed: int, layout_id: str) -> None:
    """A layout's id is its content hash, and committed plan tables name layouts by it
    (``xema layouts`` rebuilds the files from the table): a change to the solver that moves any
    offset must be a deliberate re-plan, never a side effect of making it faster. The ids were
    computed with the solver before its gap search ordered large conflict sets by radix sort."""
    from xema_ray.allocator.artifact import content_id

    assert content_id(solve_layout(random_trace(n, seed=seed, max_live=max_live))) == layout_id
