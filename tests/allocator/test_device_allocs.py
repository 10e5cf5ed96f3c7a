"""GPU-only allocations (xema_ray.allocator.device_allocs) on CPU, with a synthetic record: a "GPU
stream" made from a real meta trace of a tiny model, with workspaces the meta trace lacks and
meta allocations the GPU does not make. The recording itself needs a GPU (tests/gpu/test_allocator_gpu.py)."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict

import numpy as np
import pytest

from bench.scenarios.factories import plan_entry, plan_table
from xema_ray.allocator.device_allocs import (
    DeviceAllocMismatch,
    DeviceAllocRecord,
    GpuEvent,
    compare,
    events_from_snapshot,
    include,
    load_record,
    lookup,
    record_path,
    save_record,
    trace_key,
)
from xema_ray.allocator.layout_replay import replay
from xema_ray.allocator.solver import solve_layout
from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.plan import ExecutionConfig, PlanTable
from xema_ray.allocator.artifact import layouts_dir, save_artifact
from xema_ray.measure.layout_solve import solve_entry_layout
from xema_ray.measure.verify import verify_table, worker_trace
from xema_ray.templates import RequestTemplate

H200, A6000 = "NVIDIA H200", "NVIDIA RTX A6000"
T = RequestTemplate(model="tiny-cogvideox", height=32, width=48, frames=5, steps=2)
WORKSPACE = 16 << 20  # a convolution workspace, larger than the tiny model's whole peak


def gpu_stream(trace: MemoryTrace, absent: set[int], extras: list[tuple[int, int, int | None]]) -> list[GpuEvent]:
    """The trace's events in order, without the ``absent`` rows, with ``extras`` = (alloc after
    event t, size, free after event t or None) in between; distinct fake addresses."""
    at: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for r in range(len(trace)):
        at[int(trace.begin[r])].append(("alloc", r))
        if trace.end[r] < trace.n_events:
            at[int(trace.end[r])].append(("free", r))
    x_alloc: dict[int, list[int]] = defaultdict(list)
    x_free: dict[int, list[int]] = defaultdict(list)
    for k, (after, _, free_after) in enumerate(extras):
        x_alloc[after].append(k)
        if free_after is not None:
            x_free[free_after].append(k)
    addrs = itertools.count(1 << 32, 1 << 24)
    ptr: dict[tuple[str, int], int] = {}
    out: list[GpuEvent] = []
    for t in sorted(set(at) | set(x_alloc) | set(x_free)):
        for kind, r in at.get(t, []):
            if r in absent or trace.size[r] == 0:
                continue
            if kind == "alloc":
                ptr["m", r] = next(addrs)
                out.append(GpuEvent(kind="alloc", addr=ptr["m", r], size=int(trace.size[r])))
            else:
                out.append(GpuEvent(kind="free", addr=ptr["m", r], size=int(trace.size[r])))
        for k in x_alloc.get(t, []):
            ptr["x", k] = next(addrs)
            out.append(GpuEvent(kind="alloc", addr=ptr["x", k], size=extras[k][1]))
        for k in x_free.get(t, []):
            out.append(GpuEvent(kind="free", addr=ptr["x", k], size=extras[k][1]))
    return out


def as_trace(events: list[GpuEvent]) -> MemoryTrace:
    """A real stream as a trace (one event per alloc/free), as ``Recording.trace`` makes it."""
    rows: list[list[int]] = []
    live: dict[int, int] = {}
    for t, e in enumerate(events):
        if e.kind == "alloc":
            live[e.addr] = len(rows)
            rows.append([e.size, t, -1])
        else:
            rows[live.pop(e.addr)][2] = t
    arr = np.array(rows, dtype=np.int64)
    n, end = len(arr), len(events)
    return MemoryTrace(size=arr[:, 0], nbytes=arr[:, 0], begin=arr[:, 1], end=np.where(arr[:, 2] < 0, end, arr[:, 2]),
                       category=np.full(n, int(Category.ACTIVATION), np.int8), module=np.full(n, -1, np.int32),
                       phase=np.zeros(n, np.int32), op=np.full(n, -1, np.int32), free_module=np.full(n, -1, np.int32),
                       n_events=end, phases=["request"])


def synthetic(trace: MemoryTrace) -> tuple[list[GpuEvent], set[int], list[tuple[int, int, int | None]]]:
    """Two workspaces late in the request (one freed three events later, one live to the end) and
    two meta allocations the GPU does not make."""
    order = np.argsort(trace.begin, kind="stable")
    order = order[trace.size[order] > 0]
    t1, t2 = int(trace.begin[order[len(order) * 2 // 3]]), int(trace.begin[order[-5]])
    extras = [(t1, WORKSPACE, t1 + 3), (t2, WORKSPACE // 2, None)]
    # rows a size sequence can tell apart (a row between two of its own size could be any of them)
    sizes = trace.size[order]

    def distinct(p: int) -> int:
        while sizes[p] in (sizes[p - 1], sizes[p + 1]):
            p += 1
        return int(order[p])

    absent = {distinct(len(order) // 3), distinct(len(order) // 2)}
    return gpu_stream(trace, absent, extras), absent, extras


@pytest.fixture(scope="module")
def meta() -> MemoryTrace:
    return trace_template(T, TraceOptions(device="meta", count_host=True))


def test_compare_finds_the_gpu_only_and_the_meta_only_allocations(meta: MemoryTrace) -> None:
    events, absent, extras = synthetic(meta)
    entry = compare(meta, events, template=T.shape_key)
    assert sorted(entry.absent) == sorted(absent)
    assert [(x.alloc_after, x.size) for x in entry.extra] == [(a, size) for a, size, _ in extras]
    # a free is placed after the last allocation before it (frees in between change no overlap)
    last_alloc = {f: int(meta.begin[meta.begin <= f].max()) for _, _, f in extras if f is not None}
    assert [x.free_after for x in entry.extra] == [last_alloc.get(f) if f is not None else None for _, _, f in extras]
    assert entry.matched == entry.meta_allocations - len(absent)
    assert entry.trace_key == trace_key(meta) and entry.side_stream == []


def test_the_analyzers_peak_and_the_solved_layout_include_them(meta: MemoryTrace) -> None:
    events, _, _ = synthetic(meta)
    entry = compare(meta, events, template=T.shape_key)
    real = as_trace(events)
    with_gpu, planned = include(meta, entry)
    assert planned.all() and len(with_gpu) == len(meta) - len(entry.absent) + len(entry.extra)
    # the analyzer's trace with the record has the GPU's peak, which the workspace raises
    assert with_gpu.peak() == real.peak() > meta.peak()
    layout = solve_layout(with_gpu)
    layout.verify()
    assert layout.lower_bound_bytes == real.peak()
    ok = replay(layout, real)
    assert ok.misses == 0 and ok.hits == len(real)
    # the layout solved without the record derails on the GPU's stream at the first difference
    assert replay(solve_layout(meta), real).misses > 0


def test_error_raised_if_record_is_for_another_gpu_edited_or_another_trace(meta: MemoryTrace, tmp_path) -> None:  # type: ignore[no-untyped-def]
    events, _, _ = synthetic(meta)
    entry = compare(meta, events, template=T.shape_key)
    path = save_record(DeviceAllocRecord(gpu=H200, torch="2.11").with_entry(entry), record_path(tmp_path, H200))
    assert path == tmp_path / "device-allocs" / "nvidia-h200.json"
    assert load_record(path, H200).entries[entry.trace_key] == entry
    with pytest.raises(DeviceAllocMismatch, match=r"recorded on 'NVIDIA H200', the layout is for 'NVIDIA RTX A6000'"):
        load_record(path, A6000)
    found, note, _ = lookup(tmp_path, A6000, meta)
    assert found is None and "no record for 'NVIDIA RTX A6000'" in note and "other GPU models ignored: nvidia-h200" in note
    found, note, rid = lookup(tmp_path, H200, meta)
    assert found == entry and "included 2 GPU-only allocation(s)" in note and rid
    other = meta.subset(np.arange(len(meta)) != 0)
    with pytest.raises(DeviceAllocMismatch, match=r"was taken against trace .*record again on the GPU"):
        include(other, entry)
    assert lookup(tmp_path, H200, other)[0] is None
    doc = json.loads(path.read_text())
    doc["entries"][entry.trace_key]["extra"][0]["size"] = 512
    path.write_text(json.dumps(doc))
    with pytest.raises(DeviceAllocMismatch, match=r"edited or corrupt"):
        load_record(path, H200)


def test_plan_entry_layout_includes_the_record_of_its_gpu_and_verify_replays_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = ExecutionConfig(template=RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2))
    stream = worker_trace(cfg)
    events, _, _ = synthetic(stream)
    table = tmp_path / "table.json"
    folder = layouts_dir(table)
    entry = compare(stream, events, template=cfg.template.shape_key, config_hash=cfg.config_hash())
    save_record(DeviceAllocRecord(gpu=H200).with_entry(entry), record_path(folder, H200))
    plain = solve_entry_layout(cfg, A6000, folder)  # the H200's record does not apply to an A6000 layout
    assert plain.device_allocs is None and "other GPU models ignored: nvidia-h200" in plain.device_allocs_note
    art = solve_entry_layout(cfg, H200, folder)
    assert art.device_allocs == entry and art.device_allocs_note.startswith("included 2 GPU-only")
    assert art.reserved_bytes >= plain.reserved_bytes and len(art.layout.size) == len(plain.layout.size) + len(entry.extra) - len(entry.absent)
    assert len(art.replay_plan()) == np.count_nonzero(np.asarray(art.layout.size) > 0)
    save_artifact(art, folder)
    plan_table([plan_entry(cfg, layout_ref=art.layout_id, peak_bytes=1, latency_s=1.0, slo_s=10.0,
                           latency_source="estimated")], hardware="x").save(str(table))
    (e,) = verify_table(PlanTable.load(str(table)), path=str(table)).entries
    assert e.error is None and e.layout_misses == 0 and e.static_reserved_bytes == art.reserved_bytes
    assert e.device_peak_bytes >= stream.loaded_bytes + WORKSPACE


def test_events_from_a_torch_snapshot() -> None:
    # the shape torch.cuda.memory._snapshot() gives with _record_memory_history on (torch/cuda/memory.py TraceEntry)
    snap = {"device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20, "stream": 0},
        {"action": "alloc", "addr": 0, "size": 1024, "stream": 0},
        {"action": "alloc", "addr": 1024, "size": 512, "stream": 7},
        {"action": "free_requested", "addr": 0, "size": 1024, "stream": 0},
        {"action": "free_completed", "addr": 0, "size": 1024, "stream": 0},
        {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0},  # allocated before recording
    ]]}
    assert [(e.kind, e.addr, e.size, e.stream) for e in events_from_snapshot(snap)] == [
        ("alloc", 0, 1024, 0), ("alloc", 1024, 512, 7), ("free", 0, 1024, 0)]
    with pytest.raises(ValueError, match="not device 1"):
        events_from_snapshot(snap, device=1)


def test_xema_analyze_includes_the_record_of_its_trace(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from xema_ray.cli import main

    trace = trace_template(T, TraceOptions(text_encoder="device"))  # what `xema analyze` traces
    events, _, _ = synthetic(trace)
    entry = compare(trace, events, template=T.shape_key)
    path = save_record(DeviceAllocRecord(gpu=H200).with_entry(entry), tmp_path / "device-allocs-h200.json")
    argv = ["analyze", "--model", T.model, "--height", "32", "--width", "48", "--frames", "5", "--steps", "2"]
    assert main([*argv, "--json", str(tmp_path / "plain.json")]) == 0
    assert main([*argv, "--device-allocs", str(path), "--json", str(tmp_path / "gpu.json")]) == 0
    assert "NVIDIA H200: +2 GPU-only" in capsys.readouterr().out
    plain = json.loads((tmp_path / "plain.json").read_text())["summary"]["peak_bytes"]
    with_gpu = json.loads((tmp_path / "gpu.json").read_text())["summary"]["peak_bytes"]
    assert with_gpu == as_trace(events).peak() > plain


def test_dense_clusters_of_gpu_only_copies_align_exactly() -> None:
    # like the three q-sized copies around every fused attention call on an H200
    # (docs/measured-facts.md, "Fused attention's allocations"):
    # clusters of equal-size GPU-only buffers every few allocations, and a few meta-only ones
    from xema_ray.allocator.synthetic import diffusion_like_trace

    trace = diffusion_like_trace(blocks=6, steps=4)
    order = np.argsort(trace.begin, kind="stable")
    copy = 7 * 512 * 1024  # a size the trace does not have
    assert copy not in set(trace.size.tolist())
    extras = [(int(trace.begin[r]), copy, int(trace.begin[r]) + 1) for r in order[5::9] for _ in range(3)]
    events = gpu_stream(trace, set(), extras)
    entry = compare(trace, events, template="synthetic")
    assert entry.matched == len(trace) and len(entry.extra) == len(extras) and entry.absent == []
    layout = solve_layout(include(trace, entry)[0])
    assert replay(layout, as_trace(events)).misses == 0
