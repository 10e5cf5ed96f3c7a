"""Static memory layout: an address for every allocation of a request template (paper §6).

Layout is rectangle packing on the address × time plane: allocation ``i`` occupies
``[begin[i], end[i]) × [offset[i], offset[i] + size[i])`` and allocations whose lifetimes overlap
must not overlap in address. The C++ solver (``xema_ray.allocator._solver``, Algorithm 1: largest
first, best-fit gap among the lifetime-overlapping placed allocations, else above them) does the
placing; this module validates its input, types its output and checks layouts independently.

Example:
    >>> import numpy as np
    >>> layout = solve_arrays(np.array([1024, 512, 1024]), np.array([0, 1, 2]), np.array([2, 3, 4]))
    >>> layout.offset.tolist(), layout.reserved_bytes, layout.lower_bound_bytes
    ([512, 0, 512], 1536, 1536)
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from xema_ray.memory.trace import MemoryTrace

LAYOUT_SCHEMA_VERSION = 1

# c10/core/AllocatorConfig.h kMinBlockSize: the caching allocator (and the tracer) round every
# request to 512 bytes, and the runtime allocator compares planned sizes after the same rounding.
DEFAULT_ALIGNMENT = 512

LayoutOrder = Literal["size", "size_longer_first", "area", "lifetime", "long_first"]

# Measured with bench/bench_layout.py --ablation: on the analyzer's real traces (CogVideoX-5B,
# Flux.2, LTX-2) "size" (the paper's order) was never beaten by "size_longer_first" (always equal),
# "area" or "lifetime" (up to 11% worse). "long_first" (long-lived allocations first, stacked from
# both ends of the region; see layout_solver.cpp) brings the CogVideoX VAE decode from 1.15x to
# 1.03x of the lower bound before refinement (which lets the descent reach 1.006x); elsewhere the
# two tie or trade places by a few percent (random traces), so both run and each segment keeps
# the one whose greedy placement ends lower. Each extra order costs a greedy pass.
DEFAULT_ORDERS: tuple[LayoutOrder, ...] = ("size", "long_first")


class SolverOptions(BaseModel):
    """How the layout solver runs. Part of a layout's identity (``StaticLayout.key``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    alignment: int = Field(default=DEFAULT_ALIGNMENT, ge=1)
    """Offsets and extents are multiples of this many bytes (a power of two)."""

    orders: tuple[LayoutOrder, ...] = Field(default=DEFAULT_ORDERS, min_length=1)
    """Visit orders to try; the layout with the lowest reserved peak wins (ties: first listed)."""

    hoist_universal: bool = True
    """Stack allocations that overlap every other one (weights, inputs) at the bottom first."""

    compact: bool = True
    """Second pass: drop each allocation, bottom-up, into the lowest gap that now fits it."""

    segment_size: int = Field(default=4096, ge=0)
    """Cut the trace into time segments of about this many allocations where few bytes cross the
    cut; crossing allocations are placed first, then each segment on its own (0 = no cuts)."""

    segment_max_crossing: float = Field(default=0.1, ge=0.0, le=1.0)
    """Only cut where the bytes crossing the cut are at most this fraction of the most bytes live
    at once (random-like traces, live everywhere, stay in one piece)."""

    refine_iterations: int = Field(default=48, ge=0)
    """Squeaky-wheel re-runs of the greedy on the segment that sets the peak (0 = none)."""

    descent: bool = True
    """Then move the allocations that reach that segment's top below it, evicting and re-placing
    what is in the way (a local search; never raises the peak)."""

    @field_validator("alignment")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"alignment must be a power of two, got {value}")
        return value


@dataclass(frozen=True)
class ReplayPlan:
    """What the runtime allocator needs for one armed request: per planned allocation, in the
    order the allocator will see them, the rounded size and the offset in the static region.

    Attributes:
        sizes: uint64, aligned sizes.
        offsets: uint64, offsets into the static region.
        static_bytes: the static region this plan needs (max offset + size).
        key: identifies the plan, so a runtime can load it once and arm it per request.
    """

    sizes: np.ndarray
    offsets: np.ndarray
    static_bytes: int
    key: str

    def __len__(self) -> int:
        return len(self.sizes)


@dataclass
class StaticLayout:
    """Offsets for every allocation of a trace, plus what they cost.

    Attributes:
        size, begin, end: the allocations as given (int64, event time; see ``MemoryTrace``).
        offset: int64 address of each allocation inside the static region.
        n_events: event count of the trace (``end == n_events`` means never freed).
        alignment: bytes every offset is a multiple of.
        reserved_bytes: highest used address: the static region's size.
        lower_bound_bytes: max live bytes at any instant; no layout can reserve less.
        solve_seconds: wall time of the C++ solve.
        order: the visit order of the segment that sets the peak.
        candidates: reserved bytes of the greedy in each order alone (before compaction and
            refinement).
        greedy_reserved_bytes: reserved bytes of the greedy (the better order per segment,
            compacted) before refinement and descent.
        segments: time segments solved independently.
        refine_rounds: greedy re-runs the refinement spent.
        options: the solver options used.
        meta: provenance (template key, trace meta).
    """

    size: np.ndarray
    begin: np.ndarray
    end: np.ndarray
    offset: np.ndarray
    n_events: int
    alignment: int
    reserved_bytes: int
    lower_bound_bytes: int
    solve_seconds: float
    order: str
    candidates: dict[str, int]
    greedy_reserved_bytes: int = 0
    segments: int = 1
    refine_rounds: int = 0
    options: SolverOptions = field(default_factory=SolverOptions)
    meta: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.size)

    @property
    def overhead(self) -> float:
        """``reserved / lower bound`` (1.0 is optimal; 1.0 for an empty trace)."""
        if self.lower_bound_bytes == 0:
            return 1.0
        return self.reserved_bytes / self.lower_bound_bytes

    def key(self) -> str:
        """Hash of what determines the offsets: the allocations, alignment and solver options."""
        h = hashlib.sha256()
        for column in (self.size, self.begin, self.end):
            h.update(np.ascontiguousarray(column, dtype=np.int64).tobytes())
        h.update(self.options.model_dump_json().encode())
        return h.hexdigest()[:16]

    def verify(self) -> None:
        """Raise ``ValueError`` unless offsets are aligned, inside the reserved region, and no two
        allocations with overlapping lifetimes overlap in address. Independent of the C++ solver."""
        ext = _aligned(self.size, self.alignment)
        misaligned = np.flatnonzero(self.offset % self.alignment)
        if misaligned.size:
            i = int(misaligned[0])
            raise ValueError(f"allocation {i} offset {int(self.offset[i])} is not a multiple of {self.alignment}")
        if len(self) and int((self.offset + ext).max()) > self.reserved_bytes:
            i = int(np.argmax(self.offset + ext))
            raise ValueError(
                f"allocation {i} ends at {int(self.offset[i] + ext[i])}, above reserved {self.reserved_bytes}"
            )
        clash = first_overlap(ext, self.begin, self.end, self.offset)
        if clash is not None:
            i, j = clash
            raise ValueError(
                f"allocations {i} and {j} overlap: lifetimes [{int(self.begin[i])}, {int(self.end[i])}) and "
                f"[{int(self.begin[j])}, {int(self.end[j])}), addresses [{int(self.offset[i])}, "
                f"{int(self.offset[i] + ext[i])}) and [{int(self.offset[j])}, {int(self.offset[j] + ext[j])})"
            )

    def replay_plan(self, rows: np.ndarray | None = None) -> ReplayPlan:
        """The runtime plan for a subset of allocations, in allocation (begin) order.

        Args:
            rows: boolean mask or integer indices of the allocations the armed request will make
                (e.g. everything but the weights, which are loaded once before requests). All
                allocations when ``None``. Zero-byte allocations are dropped: the allocator never
                sees them.

        Example:
            >>> import numpy as np
            >>> lay = solve_arrays(np.array([512, 512]), np.array([0, 1]), np.array([2, 3]))
            >>> plan = lay.replay_plan()
            >>> plan.sizes.tolist(), plan.offsets.tolist()
            ([512, 512], [0, 512])
        """
        n = len(self)
        if rows is None:
            idx = np.arange(n)
        else:
            rows = np.asarray(rows)
            if rows.dtype == np.bool_:
                if rows.shape != (n,):
                    raise ValueError(f"row mask has shape {rows.shape}, layout has {n} allocations")
                idx = np.flatnonzero(rows)
            else:
                idx = rows.astype(np.int64)
                if idx.size and (idx.min() < 0 or idx.max() >= n):
                    raise ValueError(f"row indices span [{idx.min()}, {idx.max()}], layout has {n} allocations")
        idx = idx[self.size[idx] > 0]
        idx = idx[np.argsort(self.begin[idx], kind="stable")]
        sizes = _aligned(self.size[idx], self.alignment).astype(np.uint64)
        offsets = self.offset[idx].astype(np.uint64)
        static = int((offsets + sizes).max()) if idx.size else 0
        h = hashlib.sha256(self.key().encode())
        h.update(idx.astype(np.int64).tobytes())
        return ReplayPlan(sizes=sizes, offsets=offsets, static_bytes=static, key=h.hexdigest()[:16])

    # ------------------------------------------------------------------ JSON
    def to_file(self) -> StaticLayoutFile:
        return StaticLayoutFile(
            schema_version=LAYOUT_SCHEMA_VERSION,
            n_events=self.n_events,
            alignment=self.alignment,
            reserved_bytes=self.reserved_bytes,
            lower_bound_bytes=self.lower_bound_bytes,
            solve_seconds=self.solve_seconds,
            order=self.order,
            candidates=self.candidates,
            greedy_reserved_bytes=self.greedy_reserved_bytes,
            segments=self.segments,
            refine_rounds=self.refine_rounds,
            options=self.options,
            size=self.size.tolist(),
            begin=self.begin.tolist(),
            end=self.end.tolist(),
            offset=self.offset.tolist(),
            meta=self.meta,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_file().model_dump_json())

    @classmethod
    def load(cls, path: str | Path) -> StaticLayout:
        return cls.from_file(StaticLayoutFile.model_validate(json.loads(Path(path).read_text())))

    @classmethod
    def from_file(cls, f: StaticLayoutFile) -> StaticLayout:
        if f.schema_version != LAYOUT_SCHEMA_VERSION:
            raise ValueError(
                f"layout schema version {f.schema_version} is not supported (this build reads {LAYOUT_SCHEMA_VERSION})"
            )
        lengths = {len(f.size), len(f.begin), len(f.end), len(f.offset)}
        if len(lengths) != 1:
            raise ValueError(
                f"layout columns differ in length: size {len(f.size)}, begin {len(f.begin)}, "
                f"end {len(f.end)}, offset {len(f.offset)}"
            )
        return cls(
            size=np.asarray(f.size, dtype=np.int64),
            begin=np.asarray(f.begin, dtype=np.int64),
            end=np.asarray(f.end, dtype=np.int64),
            offset=np.asarray(f.offset, dtype=np.int64),
            n_events=f.n_events,
            alignment=f.alignment,
            reserved_bytes=f.reserved_bytes,
            lower_bound_bytes=f.lower_bound_bytes,
            solve_seconds=f.solve_seconds,
            order=f.order,
            candidates=dict(f.candidates),
            greedy_reserved_bytes=f.greedy_reserved_bytes,
            segments=f.segments,
            refine_rounds=f.refine_rounds,
            options=f.options,
            meta=dict(f.meta),
        )


class StaticLayoutFile(BaseModel):
    """JSON form of a ``StaticLayout`` (columns as lists)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = Field(description="LAYOUT_SCHEMA_VERSION of the writer")
    n_events: int = Field(ge=0)
    alignment: int = Field(ge=1)
    reserved_bytes: int = Field(ge=0)
    lower_bound_bytes: int = Field(ge=0)
    solve_seconds: float = Field(ge=0)
    order: str
    candidates: dict[str, int]
    greedy_reserved_bytes: int = Field(ge=0)
    segments: int = Field(ge=0)
    refine_rounds: int = Field(ge=0)
    options: SolverOptions
    size: list[int]
    begin: list[int]
    end: list[int]
    offset: list[int]
    meta: dict[str, str] = Field(default_factory=dict)


# ---------------------------------------------------------------------- solving


def solve_layout(trace: MemoryTrace, options: SolverOptions | None = None) -> StaticLayout:
    """Solve the static layout of every allocation in a trace.

    Args:
        trace: the analyzer's trace (``size`` is already rounded to 512 bytes).
        options: solver options; defaults to ``SolverOptions()``.

    Example:
        >>> from xema_ray.allocator.synthetic import random_trace
        >>> layout = solve_layout(random_trace(200, seed=0))
        >>> layout.reserved_bytes >= layout.lower_bound_bytes
        True
    """
    layout = solve_arrays(trace.size, trace.begin, trace.end, n_events=trace.n_events, options=options)
    layout.meta.update(trace.meta)
    return layout


def solve_arrays(
    size: np.ndarray,
    begin: np.ndarray,
    end: np.ndarray,
    *,
    n_events: int | None = None,
    options: SolverOptions | None = None,
) -> StaticLayout:
    """Solve the static layout of raw columns (same meaning as ``MemoryTrace``'s).

    Args:
        size: bytes per allocation (>= 0).
        begin: event index of each allocation (>= 0).
        end: event index of each free (> begin).
        n_events: the trace's event count; defaults to ``max(end)``. Every ``end`` must be <= it.
        options: solver options; defaults to ``SolverOptions()``.
    """
    options = options or SolverOptions()
    size, begin, end = _validated(size, begin, end, n_events)
    if n_events is None:
        n_events = int(end.max()) if len(end) else 0
    raw = _native().solve(
        size,
        begin,
        end,
        alignment=options.alignment,
        orders=list(options.orders),
        hoist_universal=options.hoist_universal,
        compact=options.compact,
        segment_size=options.segment_size,
        segment_max_crossing=options.segment_max_crossing,
        refine_iterations=options.refine_iterations,
        descent=options.descent,
    )
    return StaticLayout(
        size=size,
        begin=begin,
        end=end,
        offset=np.asarray(raw["offsets"], dtype=np.int64),
        n_events=n_events,
        alignment=options.alignment,
        reserved_bytes=int(raw["reserved"]),
        lower_bound_bytes=int(raw["lower_bound"]),
        solve_seconds=float(raw["seconds"]),
        order=str(raw["order"]),
        candidates={str(k): int(v) for k, v in raw["candidates"].items()},
        greedy_reserved_bytes=int(raw["reserved_greedy"]),
        segments=int(raw["segments"]),
        refine_rounds=int(raw["refine_rounds"]),
        options=options,
    )


def lower_bound(size: np.ndarray, begin: np.ndarray, end: np.ndarray, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Max live bytes (sizes rounded up to ``alignment``) at any instant: no allocator does better."""
    size, begin, end = _validated(size, begin, end, None)
    return int(_native().lower_bound(size, begin, end, alignment=alignment))


def first_overlap(
    extent: np.ndarray, begin: np.ndarray, end: np.ndarray, offset: np.ndarray
) -> tuple[int, int] | None:
    """The first pair of allocations that are live together and overlap in address, or ``None``.

    A sweep over time that keeps the live address ranges sorted: inserting a range only has to be
    checked against its two neighbours while the live set is disjoint.
    """
    nz = np.flatnonzero(np.asarray(extent) > 0)
    # At equal times frees sort before allocations: lifetimes are half-open.
    times = np.concatenate([begin[nz], end[nz]])
    kinds = np.concatenate([np.ones(nz.size, np.int8), np.zeros(nz.size, np.int8)])
    ids = np.concatenate([nz, nz])
    order = np.lexsort((kinds, times))
    lo_of = np.asarray(offset, dtype=np.int64).tolist()
    hi_of = (np.asarray(offset, dtype=np.int64) + np.asarray(extent, dtype=np.int64)).tolist()
    # the live ranges as three parallel lists sorted by start: while they are disjoint (else the
    # sweep has returned) and non-empty, no two share a start, so a range is found by its start
    los: list[int] = []
    his: list[int] = []
    who: list[int] = []
    find = bisect.bisect_left
    for i, made in zip(ids[order].tolist(), kinds[order].tolist(), strict=True):
        lo = lo_of[i]
        pos = find(los, lo)
        if not made:
            del los[pos], his[pos], who[pos]
            continue
        if pos > 0 and his[pos - 1] > lo:
            return who[pos - 1], i
        hi = hi_of[i]
        if pos < len(los) and los[pos] < hi:
            return who[pos], i
        los.insert(pos, lo)
        his.insert(pos, hi)
        who.insert(pos, i)
    return None


def _aligned(size: np.ndarray, alignment: int) -> np.ndarray:
    return (np.asarray(size, dtype=np.int64) + alignment - 1) // alignment * alignment


def _validated(
    size: np.ndarray, begin: np.ndarray, end: np.ndarray, n_events: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cols = []
    for name, col in (("size", size), ("begin", begin), ("end", end)):
        arr = np.asarray(col)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
        cols.append(np.ascontiguousarray(arr, dtype=np.int64))
    size, begin, end = cols
    if not (len(size) == len(begin) == len(end)):
        raise ValueError(f"size, begin and end differ in length: {len(size)}, {len(begin)}, {len(end)}")
    bad = np.flatnonzero(size < 0)
    if bad.size:
        raise ValueError(f"allocation {int(bad[0])} has negative size {int(size[bad[0]])}")
    bad = np.flatnonzero((begin < 0) | (begin >= end))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"allocation {i} has lifetime [{int(begin[i])}, {int(end[i])}) (need 0 <= begin < end)")
    if n_events is not None and len(end) and int(end.max()) > n_events:
        i = int(np.argmax(end))
        raise ValueError(f"allocation {i} ends at {int(end[i])}, after the trace's {n_events} events")
    return size, begin, end


def _native() -> ModuleType:
    """The compiled solver (typed by ``_solver.pyi``); imported lazily so this module loads without
    a build, e.g. to read a layout file."""
    try:
        from xema_ray.allocator import _solver
    except ImportError as e:  # pragma: no cover - only without a build
        raise ImportError(
            "xema_ray.allocator._solver is not built; install the package with `pip install -e .`"
        ) from e
    return _solver
