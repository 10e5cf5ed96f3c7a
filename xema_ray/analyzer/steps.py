"""Step replication (paper §3.3): a raw trace of three denoising steps made a ``MemoryTrace`` of all of them.

Denoising steps repeat the same allocation pattern exactly (template-static execution), so only
three steps are traced: step 0 also carries one-off set-up, steps 1 and 2 are the steady state.
``expand_steps`` checks that steps 1 and 2 are identical and replicates step 2 for the remaining
steps, then cuts the request into its phases (text, each step, post, the decoders: ``xema_ray.vocabulary``) by the
markers the traced call set (``xema_ray.analyzer.assembly``).
"""

from __future__ import annotations

import hashlib

import numpy as np

from xema_ray.analyzer.tracer import ALLOC, FREE, MIN_BLOCK_SIZE, RawTrace, raw_to_arrays
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.vocabulary import Phase, trace_decode, trace_step

STEP_BOUNDARY = "scheduler_step"
REPLICATE_FROM = 3  # traced steps when replicating: step 0 carries set-up, steps 1 and 2 must match
DIT_BEGIN = "dit_begin"


class StepPatternError(RuntimeError):
    """Two traced denoising steps differ, so one step cannot stand for all of them."""


def _step_bounds(raw: RawTrace) -> list[int]:
    """Event index of each scheduler-step entry: region k = [bound[k-1], bound[k]) holds the
    scheduler update of step k-1 and DiT call k, so every tensor a region makes is freed in
    that region or the next (the previous latents die when the next loop iteration rebinds)."""
    bounds = [pos for pos, label in raw.markers if label == STEP_BOUNDARY]
    if not bounds:
        raise StepPatternError("the pipeline call made no denoising step (the scheduler never stepped)")
    return bounds


def _event_signature(kinds: np.ndarray, allocs: np.ndarray, start: int, stop: int,
                     arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Per event (one row each): kind, rounded size, module, op, and where a freed allocation was
    born (position in this region). A free of an earlier allocation keeps only its size: the tensor
    it releases (initial noise in step 1, the previous update in step 2) legitimately differs."""
    a = allocs[start:stop]
    born = arrays["begin"][a]
    inside = (born >= start) & (born < stop)
    nbytes = arrays["nbytes"][a]
    return np.stack([
        kinds[start:stop].astype(np.int64),
        np.where(nbytes > 0, (nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE * MIN_BLOCK_SIZE, 0),  # round_size
        np.where(inside, arrays["module"][a], -1),
        np.where(inside, arrays["op"][a], -1),
        np.where(inside, born - start, -1),
    ], axis=1)


def _local_index(ids: np.ndarray, n: int) -> np.ndarray:
    """``index[a]`` = position of allocation ``a`` in ``ids`` (-1 where absent), for ``a < n``."""
    index = np.full(n, -1, dtype=np.int64)
    index[ids] = np.arange(len(ids), dtype=np.int64)
    return index


def expand_steps(raw: RawTrace, steps: int) -> MemoryTrace:
    """Turn a raw trace of ``k`` traced steps into a ``MemoryTrace`` of ``steps`` steps.

    With ``k == steps`` nothing is replicated. Otherwise ``k`` must be at least ``REPLICATE_FROM``
    (3): the last two traced regions (the steady state, called 1 and 2 here; region 0 also holds the
    set-up, and regions before the last two are kept as traced) must be identical, and region 2 is repeated for steps 3..steps-1. A free in a copy of an allocation born in the
    previous region is remapped to the previous copy; a free after the loop of an allocation
    of the last traced region goes to the last copy.

    Raises:
        StepPatternError: the two steady-state steps differ, or an allocation outlives two
            regions (state that accumulates across steps), so replication would be wrong.
    """
    arrays = raw_to_arrays(raw)
    bounds = _step_bounds(raw)
    traced = len(bounds)
    kinds = np.asarray(raw.event_kind, dtype=np.int8)
    allocs = np.asarray(raw.event_alloc, dtype=np.int64)
    if traced == steps:
        return _memory_trace(raw, {k: v for k, v in arrays.items() if k not in ("begin", "end")},
                         arrays["begin"], arrays["end"], raw.n_events, bounds)
    if traced < REPLICATE_FROM:
        raise ValueError(f"replication needs {REPLICATE_FROM} traced steps or more, got {traced} for {steps} steps")

    # the last two traced steps are the steady state (a model whose early steps differ traces more:
    # ``ModelSpec.settling_steps``); region 1 = [s1, s2), region 2 = [s2, s3), tail = [s3, end)
    *head, s1, s2, s3 = bounds
    sig1 = _event_signature(kinds, allocs, s1, s2, arrays)
    sig2 = _event_signature(kinds, allocs, s2, s3, arrays)
    if not np.array_equal(sig1, sig2):
        m = min(len(sig1), len(sig2))
        differ = np.flatnonzero(np.any(sig1[:m] != sig2[:m], axis=1))
        where = int(differ[0]) if len(differ) else m

        def row(sig: np.ndarray) -> tuple[int, ...] | None:
            return tuple(int(v) for v in sig[where]) if where < len(sig) else None

        raise StepPatternError(
            f"denoising steps 1 and 2 differ ({len(sig1)} vs {len(sig2)} events; first difference at event "
            f"{where} of the step: {row(sig1)} vs {row(sig2)})"
        )
    begin = arrays["begin"]
    freed_in_2 = allocs[s2:s3][kinds[s2:s3] == FREE]
    if np.any(begin[freed_in_2] < s1):
        raise StepPatternError("step 2 frees an allocation made before step 1; steps are not self-contained")
    tail_kinds, tail_allocs = kinds[s3:], allocs[s3:]
    tail_freed = tail_allocs[tail_kinds == FREE]
    if np.any((begin[tail_freed] >= s1) & (begin[tail_freed] < s2)):
        raise StepPatternError("an allocation of step 1 is still alive after step 2; it accumulates across steps")

    prev_allocs = allocs[s1:s2][kinds[s1:s2] == ALLOC]  # region 1's allocations, in order
    pat_allocs = allocs[s2:s3][kinds[s2:s3] == ALLOC]  # region 2's allocations, in order
    per_step = len(pat_allocs)
    n_orig = len(raw.records)
    extra = steps - traced  # copies of region 2 beyond the traced one

    def ids_of_copy(c: int) -> np.ndarray:
        """Allocation ids of copy c of region 2: c = -1 is region 1, c = 0 the traced region 2."""
        if c < 0:
            return prev_allocs
        if c == 0:
            return pat_allocs
        return n_orig + (c - 1) * per_step + np.arange(per_step, dtype=np.int64)

    local_in_pat = _local_index(pat_allocs, n_orig)
    pat_kind, pat_alloc = kinds[s2:s3], allocs[s2:s3]
    self_idx = local_in_pat[pat_alloc]
    prev_idx = _local_index(prev_allocs, n_orig)[pat_alloc]
    is_self = self_idx >= 0

    out_kind, out_alloc = [kinds[:s3]], [allocs[:s3]]
    for c in range(1, extra + 1):
        cur, prev = ids_of_copy(c), ids_of_copy(c - 1)
        out_kind.append(pat_kind)
        out_alloc.append(np.where(is_self, cur[np.maximum(self_idx, 0)], prev[np.maximum(prev_idx, 0)]))
    last = ids_of_copy(extra)
    tail_local = local_in_pat[tail_allocs]
    tail_mapped = tail_allocs.copy()
    tail_mapped[tail_local >= 0] = last[tail_local[tail_local >= 0]]
    out_kind.append(tail_kinds)
    out_alloc.append(tail_mapped)
    kinds_n = np.concatenate(out_kind)
    allocs_n = np.concatenate(out_alloc)

    cols = {
        name: np.concatenate([col, np.tile(col[pat_allocs], extra)])
        for name, col in arrays.items()
        if name not in ("begin", "end")
    }
    n_total = n_orig + extra * per_step
    is_alloc = kinds_n == ALLOC
    begin_n = np.full(n_total, -1, dtype=np.int64)
    end_n = np.full(n_total, len(kinds_n), dtype=np.int64)
    begin_n[allocs_n[is_alloc]] = np.flatnonzero(is_alloc)
    is_free = ~is_alloc
    end_n[allocs_n[is_free]] = np.flatnonzero(is_free)
    step_len = s3 - s2
    new_bounds = [*head, s1, s2, s3] + [s3 + i * step_len for i in range(1, extra + 1)]
    return _memory_trace(raw, cols, begin_n, end_n, len(kinds_n), new_bounds)


def _memory_trace(
    raw: RawTrace,
    cols: dict[str, np.ndarray],
    begin: np.ndarray,
    end: np.ndarray,
    n_events: int,
    bounds: list[int],
) -> MemoryTrace:
    # Phases by where each allocation was made. Step k runs from the first DiT call (k = 0) or
    # the scheduler entry of step k-1 up to the scheduler entry of step k; the last scheduler
    # update and what follows is "post", with decode phases carved out of it by markers; what runs
    # before the first step is "text" (xema_ray.vocabulary).
    first_dit = next((pos for pos, label in raw.markers if label == DIT_BEGIN), 0)
    starts = [min(first_dit, bounds[0])] + bounds[:-1]
    phases: list[str] = [Phase.TEXT.value] + [trace_step(k) for k in range(len(bounds))]
    # the regions [starts[0], bounds[0]), [bounds[0], bounds[1]), ... are contiguous: phase k + 1
    # for region k, 0 before the first, len(phases) (post) from the last bound on
    edges = np.asarray([starts[0], *bounds], dtype=np.int64)
    phase = np.searchsorted(edges, begin, side="right").astype(np.int32)
    after = begin >= bounds[-1]
    phases.append(Phase.POST.value)
    # decode markers are in traced-event space; events after the loop shifted by the copies
    shift = n_events - raw.n_events
    opened: dict[str, int] = {}
    for pos, label in raw.markers:
        if label.startswith("begin:"):
            opened[label[6:]] = pos + shift
        elif label.startswith("end:") and label[4:] in opened:
            s, e = opened.pop(label[4:]), pos + shift
            phase[(begin >= s) & (begin < e) & after] = len(phases)
            phases.append(trace_decode(label[4:]))
    # canonical row order: by allocation event (replicated copies were appended at the end)
    if len(begin) > 1 and not np.all(begin[1:] >= begin[:-1]):
        order = np.argsort(begin, kind="stable")
        begin, end, phase = begin[order], end[order], phase[order]
        cols = {k: v[order] for k, v in cols.items()}
    nbytes = cols["nbytes"]
    size = ((nbytes + 511) // 512) * 512
    resident = cols["category"] != Category.ACTIVATION
    phase[resident] = 0
    meta = dict(raw.meta)
    meta["trace_hash"] = hashlib.sha256(size.tobytes() + begin.tobytes() + end.tobytes()).hexdigest()[:16]
    return MemoryTrace(
        size=size,
        nbytes=nbytes,
        begin=begin,
        end=end,
        category=cols["category"],
        module=cols["module"],
        phase=phase,
        op=cols["op"],
        free_module=cols["free_module"],
        n_events=n_events,
        modules=list(raw.modules),
        phases=phases,
        ops=list(raw.ops),
        step_bounds=[int(b) for b in bounds],
        meta=meta,
    )
