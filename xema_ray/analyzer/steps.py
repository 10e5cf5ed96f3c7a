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


def steps_to_trace(settling_steps: int, step_lifetime: int) -> int:
    """Steps a model's call is traced for before its steady state is replicated
    (``ModelSpec.settling_steps`` and ``ModelSpec.step_lifetime``)."""
    return REPLICATE_FROM + settling_steps + step_lifetime - 1


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


def expand_steps(raw: RawTrace, steps: int, lifetime: int = 1) -> MemoryTrace:
    """Turn a raw trace of ``k`` traced steps into a ``MemoryTrace`` of ``steps`` steps.

    With ``k == steps`` nothing is replicated. Otherwise ``k`` must be at least ``REPLICATE_FROM
    + lifetime - 1``: the last ``lifetime + 1`` traced regions (the steady state; the last is
    called region 2, the one before it region 1; region 0 also holds the set-up, and earlier
    regions are kept as traced) must be identical, and region 2 is repeated for the remaining
    steps. A free in a copy of an allocation born ``d <= lifetime`` regions earlier is remapped to
    the copy ``d`` before it; a free after the loop of an allocation of the last ``lifetime``
    traced regions goes to the matching last copies. ``lifetime`` is the model's
    ``ModelSpec.step_lifetime``: 1 for a scheduler whose step keeps nothing past the next one, 2
    for a multistep solver of order 2 (UniPC keeps each step's model output for two steps).

    Raises:
        StepPatternError: the steady-state steps differ, or an allocation outlives ``lifetime + 1``
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
    if lifetime < 1:
        raise ValueError(f"lifetime must be >= 1, got {lifetime}")
    if traced < REPLICATE_FROM + lifetime - 1:
        raise ValueError(f"replication needs {REPLICATE_FROM + lifetime - 1} traced steps or more, got {traced} "
                         f"for {steps} steps")

    # the last ``lifetime + 1`` traced regions are the steady state (a model whose early steps
    # differ traces more: ``ModelSpec.settling_steps``); region j = [starts[j], starts[j + 1]) for
    # j = 0 .. lifetime, the last (j = lifetime) is the pattern, the tail = [bounds[-1], end)
    starts = bounds[-lifetime - 2:]
    _check_steady_regions_alike(kinds, allocs, starts, arrays, traced, lifetime)
    _check_steps_self_contained(kinds, allocs, starts, arrays["begin"], lifetime)
    extra = steps - traced  # copies of region 2 beyond the traced one
    copies = _Copies(kinds, allocs, starts, lifetime, n_orig=len(raw.records))
    kinds_n, allocs_n = _replicated_events(kinds, allocs, starts, copies, extra)
    cols = {
        name: np.concatenate([col, np.tile(col[copies.pattern], extra)])
        for name, col in arrays.items()
        if name not in ("begin", "end")
    }
    begin_n, end_n = _lifetimes(kinds_n, allocs_n, copies.n_orig + extra * copies.per_step)
    s_pat, s_end = starts[-2], starts[-1]
    step_len = s_end - s_pat
    new_bounds = [*bounds] + [s_end + i * step_len for i in range(1, extra + 1)]
    return _memory_trace(raw, cols, begin_n, end_n, len(kinds_n), new_bounds)


def _check_steady_regions_alike(kinds: np.ndarray, allocs: np.ndarray, starts: list[int],
                                arrays: dict[str, np.ndarray], traced: int, lifetime: int) -> None:
    """Raise ``StepPatternError`` naming the first event where two neighbouring steady regions differ."""
    sigs = [_event_signature(kinds, allocs, starts[j], starts[j + 1], arrays) for j in range(lifetime + 1)]
    for j in range(lifetime):
        sig1, sig2 = sigs[j], sigs[j + 1]
        if np.array_equal(sig1, sig2):
            continue
        m = min(len(sig1), len(sig2))
        differ = np.flatnonzero(np.any(sig1[:m] != sig2[:m], axis=1))
        where = int(differ[0]) if len(differ) else m

        def row(sig: np.ndarray) -> tuple[int, ...] | None:
            return tuple(int(v) for v in sig[where]) if where < len(sig) else None

        raise StepPatternError(
            f"denoising steps {traced - lifetime - 1 + j} and {traced - lifetime + j} differ ({len(sig1)} vs "
            f"{len(sig2)} events; first difference at event {where} of the step: {row(sig1)} vs {row(sig2)})"
            if lifetime > 1 else
            f"denoising steps 1 and 2 differ ({len(sig1)} vs {len(sig2)} events; first difference at event "
            f"{where} of the step: {row(sig1)} vs {row(sig2)})"
        )


def _check_steps_self_contained(kinds: np.ndarray, allocs: np.ndarray, starts: list[int], begin: np.ndarray,
                                lifetime: int) -> None:
    """Raise ``StepPatternError`` where an allocation outlives ``lifetime + 1`` regions: the pattern
    frees one made before the steady regions, or one of the first steady region's is alive after the loop."""
    s_first, s_pat, s_end = starts[0], starts[-2], starts[-1]
    freed_in_pat = allocs[s_pat:s_end][kinds[s_pat:s_end] == FREE]
    if np.any(begin[freed_in_pat] < s_first):
        raise StepPatternError(f"step 2 frees an allocation made before step {2 - lifetime}; steps are not "
                               "self-contained" if lifetime == 1 else
                               f"a steady step frees an allocation made more than {lifetime} steps before it; it "
                               "accumulates across steps")
    tail_freed = allocs[s_end:][kinds[s_end:] == FREE]
    if np.any((begin[tail_freed] >= s_first) & (begin[tail_freed] < starts[1])):
        raise StepPatternError("an allocation of step 1 is still alive after step 2; it accumulates across steps"
                               if lifetime == 1 else
                               f"an allocation of a steady step is still alive {lifetime + 1} steps later; it "
                               "accumulates across steps")


class _Copies:
    """Allocation ids of the pattern region's copies, and events remapped into a copy: a free in a
    copy of an allocation born ``d`` steady regions earlier goes to the copy ``d`` before it."""

    def __init__(self, kinds: np.ndarray, allocs: np.ndarray, starts: list[int], lifetime: int, n_orig: int) -> None:
        self.lifetime = lifetime
        self.n_orig = n_orig
        self.region_allocs = [allocs[starts[j]:starts[j + 1]][kinds[starts[j]:starts[j + 1]] == ALLOC]
                              for j in range(self.lifetime + 1)]
        self.pattern = self.region_allocs[-1]
        self.per_step = len(self.pattern)
        # where each allocation of the steady regions was born: d regions before the pattern, at idx
        self.born_d = np.full(n_orig, -1, dtype=np.int64)
        self.born_idx = np.full(n_orig, -1, dtype=np.int64)
        for j, region in enumerate(self.region_allocs):
            self.born_d[region] = self.lifetime - j
            self.born_idx[region] = np.arange(len(region), dtype=np.int64)

    def ids_of_copy(self, c: int) -> np.ndarray:
        """Allocation ids of copy c of region 2: c = 0 the traced region 2, c < 0 the traced
        regions before it, c > 0 the new copies."""
        if c <= 0:
            return self.region_allocs[self.lifetime + c]
        return self.n_orig + (c - 1) * self.per_step + np.arange(self.per_step, dtype=np.int64)

    def remapped(self, events: np.ndarray, c: int) -> np.ndarray:
        """``events``' allocation ids as copy ``c`` sees them (steady-region ones d copies back)."""
        out = events.copy()
        d, idx = self.born_d[events], self.born_idx[events]
        for dist in np.unique(d[d >= 0]):
            sel = d == dist
            out[sel] = self.ids_of_copy(c - int(dist))[idx[sel]]
        return out


def _replicated_events(kinds: np.ndarray, allocs: np.ndarray, starts: list[int], copies: _Copies,
                       extra: int) -> tuple[np.ndarray, np.ndarray]:
    """The event stream (kinds, allocation ids) with ``extra`` copies of the pattern region between
    the traced steps and the tail, the tail's frees remapped to the last copies."""
    s_pat, s_end = starts[-2], starts[-1]
    pat_kind, pat_alloc = kinds[s_pat:s_end], allocs[s_pat:s_end]
    out_kind, out_alloc = [kinds[:s_end]], [allocs[:s_end]]
    for c in range(1, extra + 1):
        out_kind.append(pat_kind)
        out_alloc.append(copies.remapped(pat_alloc, c))
    out_kind.append(kinds[s_end:])
    out_alloc.append(copies.remapped(allocs[s_end:], extra))
    return np.concatenate(out_kind), np.concatenate(out_alloc)


def _lifetimes(kinds: np.ndarray, allocs: np.ndarray, n_total: int) -> tuple[np.ndarray, np.ndarray]:
    """Each allocation's begin and end event in the replicated event stream (never freed: the end)."""
    is_alloc = kinds == ALLOC
    begin = np.full(n_total, -1, dtype=np.int64)
    end = np.full(n_total, len(kinds), dtype=np.int64)
    begin[allocs[is_alloc]] = np.flatnonzero(is_alloc)
    is_free = ~is_alloc
    end[allocs[is_free]] = np.flatnonzero(is_free)
    return begin, end


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
