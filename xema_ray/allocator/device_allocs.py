"""Allocations a GPU makes that the meta trace does not (and the reverse), recorded once per GPU
model and template, kept with the layouts, and put into a trace before its layout is solved.

A layout armed on a GPU is indexed by allocation order and checks the size at each index, so it
is only as good as the trace's match with the real stream. On an H200 the real stream has
convolution workspaces in the VAE decode (e.g. 1,074,921,619 B at Flux.2 1024²'s full-resolution
up-blocks), layout copies around the fused attention kernel, and lacks the fp32 logsumexp the
meta trace allocates per flash call (docs/measured-facts.md, "Fused attention's allocations").
None of these can be derived on the meta
device, so they are recorded on the GPU:

1. ``events_from_snapshot`` (``torch.cuda.memory._record_memory_history`` on the default allocator)
   or ``events_from_recording`` (libxema_alloc's own recording) gives the real stream of one
   execution of the template in the serving worker;
2. ``compare(meta_trace, events)`` aligns it with the meta trace of the same execution, allocation
   by allocation (same order, same rounded size), and keeps what differs: ``extra`` allocations
   placed between meta events, meta rows ``absent`` on the GPU, meta rows made on another stream;
3. a ``DeviceAllocRecord`` (versioned, content-hashed JSON, tagged with the GPU model) holds one
   ``EntryRecord`` per meta trace, keyed by the trace's content hash;
4. ``include(trace, entry)`` returns the trace the GPU really makes (what the analyzer's peak and
   the layout solver then use) and which rows the runtime plan covers (the primary stream's).

A record for another GPU model, another record version, or a trace it was not taken against is
refused with the reason (``DeviceAllocMismatch``); ``lookup`` turns that into a note and solving
goes on without it.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.allocator.recording import Recording
from xema_ray.memory.trace import Category, MemoryTrace

DEVICE_ALLOCS_VERSION = 1
ROUND = 512  # the caching allocator's kMinBlockSize: sizes compare after this rounding, as in the trace
#: how far the alignment looks ahead for the next matching allocation on either side
LOOKAHEAD = 512
#: how far a resynchronisation that skips allocations on both sides at once looks (per side)
RESYNC = 64
#: allocations after a resynchronisation point that must match too (avoids syncing on a lone equal size)
CONFIRM = 8


class DeviceAllocMismatch(ValueError):
    """A record does not apply: another GPU model, another version, edited, or another trace."""


class GpuEvent(BaseModel):
    """One event of a real allocation stream."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["alloc", "free"]
    addr: int
    size: int = Field(ge=0, description="bytes (rounded to 512 by ``compare``)")
    stream: int = 0


class ExtraAllocation(BaseModel):
    """An allocation the GPU makes that the meta trace does not, placed between meta events."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=0, description="bytes, rounded to 512")
    alloc_after: int = Field(ge=-1, description="meta event time after which the GPU allocates it (-1: before all)")
    free_after: int | None = Field(default=None, description="meta event time after which the GPU frees it; "
                                                             "None: still live at the end of the request")
    primary: bool = Field(default=True, description="made on the stream the plan is armed for")
    site: str = Field(default="", description="module of the meta allocation just before it (for people)")


class EntryRecord(BaseModel):
    """What differs between one meta trace and the GPU's stream of the same execution."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    template: str
    config_hash: str = ""
    trace_key: str = Field(description="``trace_key`` of the meta trace it was aligned against")
    meta_allocations: int = Field(ge=0)
    gpu_allocations: int = Field(ge=0)
    matched: int = Field(ge=0, description="allocations found in both, same order and size")
    extra: list[ExtraAllocation] = Field(default_factory=list)
    absent: list[int] = Field(default_factory=list, description="meta trace rows the GPU does not allocate")
    side_stream: list[int] = Field(default_factory=list, description="meta rows the GPU allocates on another stream")
    meta_peak_bytes: int = Field(default=0, ge=0, description="max live bytes of the meta trace")
    gpu_peak_bytes: int = Field(default=0, ge=0, description="max live bytes of the GPU's stream")

    @property
    def extra_bytes(self) -> int:
        return sum(e.size for e in self.extra)


class DeviceAllocRecord(BaseModel):
    """Every recorded entry of one GPU model; one JSON file per GPU model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = DEVICE_ALLOCS_VERSION
    gpu: str = Field(description="GPU model the streams were recorded on, e.g. 'NVIDIA H200'")
    torch: str = Field(default="", description="torch build of the recording (kernels, hence workspaces, follow it)")
    record_id: str = Field(default="", description="content hash of the entries (``record_hash``), checked on load")
    entries: dict[str, EntryRecord] = Field(default_factory=dict, description="by trace_key")

    def with_entry(self, entry: EntryRecord) -> DeviceAllocRecord:
        entries = {**self.entries, entry.trace_key: entry}
        return self.model_copy(update={"entries": entries, "record_id": record_hash(entries)})


def record_hash(entries: dict[str, EntryRecord]) -> str:
    h = hashlib.sha256()
    for key in sorted(entries):
        h.update(entries[key].model_dump_json().encode())
    return h.hexdigest()[:16]


def trace_key(trace: MemoryTrace) -> str:
    """Content hash of what an alignment depends on: sizes and lifetimes, in row order."""
    h = hashlib.sha256()
    for column in (trace.size, trace.begin, trace.end):
        h.update(np.ascontiguousarray(column, dtype=np.int64).tobytes())
    h.update(str(trace.n_events).encode())
    return h.hexdigest()[:16]


def gpu_slug(gpu: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"


def record_path(layouts_dir: str | Path, gpu: str) -> Path:
    """Where a table's record for ``gpu`` lives: ``<table>.layouts/device-allocs/<gpu>.json``."""
    return Path(layouts_dir) / "device-allocs" / f"{gpu_slug(gpu)}.json"


def save_record(record: DeviceAllocRecord, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record.model_copy(update={"record_id": record_hash(record.entries)}).model_dump_json())
    return path


def load_record(path: str | Path, gpu: str | None = None) -> DeviceAllocRecord:
    """Read and check a record: version, content hash and (when given) the GPU model.

    Raises:
        DeviceAllocMismatch: naming the file and what differs.
    """
    path = Path(path)
    rec = DeviceAllocRecord.model_validate_json(path.read_text())
    if rec.version != DEVICE_ALLOCS_VERSION:
        raise DeviceAllocMismatch(f"{path}: record version {rec.version}, this build reads {DEVICE_ALLOCS_VERSION}")
    if rec.record_id != record_hash(rec.entries):
        raise DeviceAllocMismatch(f"{path}: content hashes to {record_hash(rec.entries)}, the file says "
                                  f"{rec.record_id} (edited or corrupt)")
    if gpu is not None and rec.gpu != gpu:
        raise DeviceAllocMismatch(f"{path}: recorded on {rec.gpu!r}, the layout is for {gpu!r}; GPU-only allocations "
                                  "(convolution workspaces, attention copies) differ per GPU model: record on that GPU")
    return rec


def lookup(layouts_dir: str | Path | None, gpu: str, trace: MemoryTrace) -> tuple[EntryRecord | None, str, str | None]:
    """The entry of ``gpu``'s record for ``trace``, or why there is none: (entry, note, record id)."""
    if layouts_dir is None:
        return None, "no layouts folder: GPU-only allocations not included", None
    folder = Path(layouts_dir) / "device-allocs"
    path = record_path(layouts_dir, gpu)
    if not path.is_file():
        others = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
        note = f"no record for {gpu!r} under {folder}"
        if others:
            note += f" (records for other GPU models ignored: {', '.join(others)})"
        return None, note, None
    try:
        rec = load_record(path, gpu)
    except DeviceAllocMismatch as e:
        return None, f"record ignored: {e}", None
    key = trace_key(trace)
    entry = rec.entries.get(key)
    if entry is None:
        return None, (f"{path}: no entry for this trace ({key}); it was recorded against other traces "
                      "(the model code, template or plan changed): record again on the GPU"), rec.record_id
    return entry, (f"included {len(entry.extra)} GPU-only allocation(s) ({entry.extra_bytes} B), "
                   f"{len(entry.absent)} meta-only dropped, from {path.name} ({rec.record_id})"), rec.record_id


# ---------------------------------------------------------------------- the real stream


def events_from_snapshot(snapshot: dict[str, Any], device: int = 0) -> list[GpuEvent]:
    """The allocation stream in a ``torch.cuda.memory._snapshot()`` taken with
    ``_record_memory_history`` on: ``alloc`` and ``free_requested`` (the moment the tensor dies:
    when a pluggable allocator's free is called) per block; segment events are the caching
    allocator's own and are skipped."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces):
        raise ValueError(f"the snapshot has traces for {len(traces)} device(s), not device {device}")
    out: list[GpuEvent] = []
    live: set[int] = set()
    for e in traces[device]:
        action = e.get("action")
        addr = int(e.get("addr", 0))
        if action == "alloc":
            live.add(addr)
            out.append(GpuEvent(kind="alloc", addr=addr, size=int(e["size"]), stream=int(e.get("stream", 0))))
        elif action in ("free_requested", "free_completed") and addr in live:
            live.discard(addr)  # free_completed after free_requested of the same block is the same free
            out.append(GpuEvent(kind="free", addr=addr, size=int(e.get("size", 0)), stream=int(e.get("stream", 0))))
    return out


def events_from_recording(recording: Recording) -> list[GpuEvent]:
    """The allocation stream libxema_alloc recorded (``StaticAllocator.record``)."""
    if recording.events is None:
        raise ValueError("the recording is still running")
    return [GpuEvent(kind="alloc" if e.kind == 0 else "free", addr=e.ptr, size=e.size, stream=e.stream)
            for e in recording.events]


# ---------------------------------------------------------------------- alignment


def _rounded(size: int) -> int:
    return (size + ROUND - 1) // ROUND * ROUND


def _align(meta: list[int], gpu: list[int]) -> list[int]:
    """For each GPU allocation, the index of the meta allocation it is (same order and size), or -1.

    Greedy with resynchronisation: on a mismatch, the cheapest skip on either side (GPU-only
    allocations, or meta-only ones) after which the next ``CONFIRM`` meta allocations follow in the
    GPU's stream wins (cost: the skip plus the GPU-only allocations passed over while confirming).
    """
    n_m, n_g = len(meta), len(gpu)
    match = [-1] * n_g
    i = j = 0

    def skips(a: int, g: int) -> int | None:
        # allocations passed over (GPU-only ones, which come in clusters: several copies around
        # one attention call; or a meta-only one) before CONFIRM more meta allocations are found
        # in the GPU's stream; None: not within the budget, this is no resynchronisation point
        found, x, y, used = 0, a + 1, g + 1, 0
        while found < CONFIRM and x < n_m and y < n_g:
            if meta[x] == gpu[y]:
                found, x, y = found + 1, x + 1, y + 1
            elif used == 2 * CONFIRM:
                return None
            elif x + 1 < n_m and meta[x + 1] == gpu[y]:  # a meta-only allocation
                x, used = x + 1, used + 1
            else:  # a GPU-only allocation
                y, used = y + 1, used + 1
        return used

    def both_sides(limit: int) -> tuple[int, int] | None:
        # the first (di, dj), fewest skipped in total, after which both streams agree again
        for total in range(2, limit + 1):
            for di in range(1, total):
                dj = total - di
                if i + di < n_m and j + dj < n_g and meta[i + di] == gpu[j + dj] and skips(i + di, j + dj) == 0:
                    return di, dj
        return None

    while i < n_m and j < n_g:
        if meta[i] == gpu[j]:
            match[j] = i
            i += 1
            j += 1
            continue
        # the cheapest resynchronisation: d allocations skipped on one side plus what the
        # confirmation had to pass over; d only grows, so stop once d alone costs more
        best: tuple[str, int] | None = None
        best_cost = LOOKAHEAD
        near = both_sides(4)  # e.g. one meta-only next to one GPU-only allocation: cost 2
        if near is not None:
            best, best_cost = ("both", near[0] * n_g + near[1]), near[0] + near[1]
        for d in range(1, LOOKAHEAD):
            if d >= best_cost:
                break
            if j + d < n_g and gpu[j + d] == meta[i]:
                c = skips(i, j + d)
                if c is not None and d + c < best_cost:
                    best, best_cost = ("gpu", d), d + c
            if i + d < n_m and meta[i + d] == gpu[j]:
                c = skips(i + d, j)
                if c is not None and d + c < best_cost:
                    best, best_cost = ("meta", d), d + c
        if best is None:  # both sides differ for longer: skip some of each, the fewest in total
            di, dj = both_sides(2 * RESYNC) or (1, 1)
            i += di
            j += dj
        elif best[0] == "both":
            i += best[1] // n_g
            j += best[1] % n_g
        elif best[0] == "gpu":
            j += best[1]
        else:
            i += best[1]
    return match


def _peak(events: Iterable[tuple[bool, int]]) -> int:
    live = peak = 0
    for is_alloc, size in events:
        live += size if is_alloc else -size
        peak = max(peak, live)
    return peak


def compare(meta: MemoryTrace, events: list[GpuEvent], *, template: str, config_hash: str = "",
            rows: np.ndarray | None = None) -> EntryRecord:
    """Align a real stream with the meta trace of the same execution and keep what differs.

    Args:
        meta: the meta trace (rows in any order; matched in allocation order).
        events: the GPU's events of that execution (``events_from_snapshot`` / ``_recording``).
        template: shape key, for people reading the record.
        config_hash: the plan entry's ``ExecutionConfig.config_hash``, likewise.
        rows: boolean mask of the meta rows the stream covers (e.g. the activations, where the
            recording started after the weights were placed); the others are left as they are.
    """
    order = np.argsort(meta.begin, kind="stable")
    order = order[meta.size[order] > 0]
    if rows is not None:
        order = order[np.asarray(rows, dtype=bool)[order]]
    meta_sizes = [int(s) for s in meta.size[order]]
    allocs = [e for e in events if e.kind == "alloc" and e.size > 0]
    gpu_sizes = [_rounded(e.size) for e in allocs]
    streams = Counter(e.stream for e in allocs)
    primary = streams.most_common(1)[0][0] if streams else 0
    match = _align(meta_sizes, gpu_sizes)
    seen = np.zeros(len(meta_sizes), dtype=bool)
    side: list[int] = []
    for j, i in enumerate(match):
        if i >= 0:
            seen[i] = True
            if allocs[j].stream != primary:
                side.append(int(order[i]))
    absent = sorted(int(order[i]) for i in np.flatnonzero(~seen))

    # walk the real stream with a clock in meta event time: the last matched allocation seen. Frees
    # do not move it: which allocations a block overlaps (what a layout must respect) and the live
    # bytes at each allocation only depend on the allocations it outlives, and a free matched to a
    # mis-aligned row of equal size would move the clock to that row's (other) end
    clock = -1
    alloc_idx = 0
    live_extra: dict[int, int] = {}  # addr -> index in extras
    extras: list[dict[str, Any]] = []
    anchor_module = -1
    for e in events:
        if e.kind == "alloc":
            if e.size == 0:
                continue
            i = match[alloc_idx]
            alloc_idx += 1
            if i >= 0:
                row = int(order[i])
                clock = max(clock, int(meta.begin[row]))
                anchor_module = int(meta.module[row])
            else:
                site = meta.modules[anchor_module] if 0 <= anchor_module < len(meta.modules) else ""
                live_extra[e.addr] = len(extras)
                extras.append({"size": _rounded(e.size), "alloc_after": clock, "free_after": None,
                               "primary": e.stream == primary, "site": site})
        elif e.addr in live_extra:
            extras[live_extra.pop(e.addr)]["free_after"] = clock
    gpu_peak = _peak((e.kind == "alloc", _rounded(e.size)) for e in events)
    return EntryRecord(template=template, config_hash=config_hash, trace_key=trace_key(meta),
                       meta_allocations=len(meta_sizes), gpu_allocations=len(allocs),
                       matched=int(seen.sum()), extra=[ExtraAllocation(**x) for x in extras], absent=absent,
                       side_stream=sorted(side), meta_peak_bytes=meta.peak(), gpu_peak_bytes=gpu_peak)


# ---------------------------------------------------------------------- inclusion


def include(trace: MemoryTrace, entry: EntryRecord) -> tuple[MemoryTrace, np.ndarray]:
    """The trace the GPU makes: ``entry``'s meta-only rows dropped, its GPU-only allocations inserted
    between the meta events they came between; and a row mask of what a runtime plan covers
    (allocations on the primary stream). Event times are renumbered (spread to leave room).

    Raises:
        DeviceAllocMismatch: the entry was recorded against another trace.
    """
    key = trace_key(trace)
    if entry.trace_key != key:
        raise DeviceAllocMismatch(f"the record of {entry.template} was taken against trace {entry.trace_key}, "
                                  f"this trace is {key}: record again on the GPU")
    keep = np.ones(len(trace), dtype=bool)
    keep[np.asarray(entry.absent, dtype=np.int64)] = False
    planned_meta = np.ones(len(trace), dtype=bool)
    planned_meta[np.asarray(entry.side_stream, dtype=np.int64)] = False
    # per gap (after meta time t), the extras' allocations come first, then their frees: within a
    # gap an extra may only overlap more than on the GPU, never less
    allocs_in: Counter[int] = Counter(x.alloc_after for x in entry.extra)
    frees_in: Counter[int] = Counter(x.free_after for x in entry.extra if x.free_after is not None)
    spread = 1 + max([allocs_in[g] + frees_in[g] for g in set(allocs_in) | set(frees_in)], default=0)
    n_events = (trace.n_events + 1) * spread

    def at(t: np.ndarray) -> np.ndarray:
        return np.where(t >= trace.n_events, n_events, (t + 1) * spread)

    slot_a: Counter[int] = Counter()
    slot_f: Counter[int] = Counter()
    xb, xe, xs, xp, xm = [], [], [], [], []
    module_ids = {m: k for k, m in enumerate(trace.modules)}
    for x in entry.extra:
        slot_a[x.alloc_after] += 1
        xb.append((x.alloc_after + 1) * spread + slot_a[x.alloc_after])
        if x.free_after is None:
            xe.append(n_events)
        else:
            slot_f[x.free_after] += 1
            xe.append((x.free_after + 1) * spread + allocs_in[x.free_after] + slot_f[x.free_after])
        xs.append(x.size)
        xp.append(x.primary)
        xm.append(module_ids.get(x.site, -1))
    n_x = len(entry.extra)
    xb_a, xe_a = np.asarray(xb, dtype=np.int64), np.asarray(xe, dtype=np.int64)
    xe_a = np.maximum(xe_a, xb_a + 1)
    sub = trace.subset(keep)
    meta = {k: v for k, v in trace.meta.items() if k != "trace_hash"}  # the analyzer's hash is of the meta trace
    meta["device_allocs"] = entry.trace_key
    step_bounds = [(int(b) + 1) * spread for b in trace.step_bounds]  # event positions, renumbered like every event
    cat = lambda a, b, dt: np.concatenate([np.asarray(a, dtype=dt), np.asarray(b, dtype=dt)])  # noqa: E731
    out = MemoryTrace(
        size=cat(sub.size, xs, np.int64), nbytes=cat(sub.nbytes, xs, np.int64),
        begin=cat(at(sub.begin), xb_a, np.int64), end=cat(at(sub.end), xe_a, np.int64),
        category=cat(sub.category, np.full(n_x, int(Category.ACTIVATION)), np.int8),
        module=cat(sub.module, xm, np.int32), phase=cat(sub.phase, np.zeros(n_x), np.int32),
        op=cat(sub.op, np.full(n_x, -1), np.int32), free_module=cat(sub.free_module, np.full(n_x, -1), np.int32),
        n_events=n_events, modules=trace.modules, phases=trace.phases or ["request"], ops=trace.ops,
        step_bounds=step_bounds, loaded_bytes=trace.loaded_bytes, mitigations=list(trace.mitigations), meta=meta,
    )
    planned = np.concatenate([planned_meta[keep], np.asarray(xp, dtype=bool)])
    return out, planned
