"""GPU check of a worker with its static layout armed (issue #15, run by `make gpu-check`).

CogVideoX-5B 720×480×49 (real config, random bf16 weights, ``STEPS`` steps, activation offload of
its VAE decoder as the reference table's CogVideoX entries: issue #35's stream-ordered frees) in the serving
worker, under a 48 GB cap, first with PyTorch's caching allocator (the reference output and step
time, and a recording of the real allocation stream), then with libxema_alloc installed by the
worker's constructor and the entry's layout armed per batch. The layout is solved here from the
worker's meta trace with the GPU-only allocations of the recording included (``device_allocs``):
0 fallbacks after warm-up, static region ≤ 1.02 × the request's active peak, outputs bitwise equal,
per-step latency within 1 %. Then Flux.2 1024² with its 48 GB offload plan
(plans/flux2-1024-1gpu.json) the same way. The records of GPU-only allocations are written to
$XEMA_GPU_OUT (device-allocs-<gpu>.json) for planning with (copy into <table>.layouts/device-allocs/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by `make gpu-check`)")]

REPO = Path(__file__).resolve().parents[2]
RUN = Path(__file__).with_name("allocator_gpu_run.py")
OUT = Path(os.environ.get("XEMA_GPU_OUT", "out"))
STEPS = 3


def _env() -> dict[str, str]:
    """The child's environment: the repo prepended to PYTHONPATH, never replacing it (the GPU
    machine's carried packages are on it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return env


def _run(mode: str, config_path: Path, out: Path, *, layouts: Path | None = None, events: Path | None = None,
         timeout: int = 150) -> dict:
    env = _env()
    cmd = [sys.executable, str(RUN), "--mode", mode, "--config", str(config_path), "--out", str(out)]
    cmd += ["--layouts", str(layouts)] if layouts is not None else []
    cmd += ["--events", str(events)] if events is not None else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(out.read_text())


def _gpu_name() -> str:
    import pynvml  # the test process must not initialise CUDA before its children choose allocators

    pynvml.nvmlInit()
    try:
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        pynvml.nvmlShutdown()
    return name.decode() if isinstance(name, bytes) else str(name)


def _armed_check(name: str, config, tmp_path: Path, timeout: int = 150) -> dict:  # type: ignore[no-untyped-def]
    """Default run (+ recording) -> record -> layout with it -> static run; the combined report."""
    from xema_ray.allocator.device_allocs import (DeviceAllocRecord, GpuEvent, compare, include, record_path,
                                                  save_record)
    from xema_ray.analyzer.run import TraceOptions, trace_template
    from xema_ray.memory.trace import Category
    from xema_ray.allocator.artifact import save_artifact
    from xema_ray.measure.layout_solve import solve_entry_layout
    from xema_ray.measure.verify import worker_trace

    gpu = _gpu_name()
    layouts = tmp_path / "table.layouts"
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(config.model_dump_json())
    events_path = tmp_path / "events.json"
    default = _run("default", cfg_path, tmp_path / "default.json", events=events_path, timeout=timeout)
    events = [GpuEvent.model_validate(e) for e in json.loads(events_path.read_text())]
    meta = worker_trace(config)
    entry = compare(meta, events, template=config.template.shape_key, config_hash=config.config_hash())
    record = DeviceAllocRecord(gpu=gpu, torch=default["torch"]).with_entry(entry)
    # and the analyzer's own trace of the template (weights placed before the recording started)
    analyzed = trace_template(config.template, TraceOptions())
    a_entry = compare(analyzed, events, template=config.template.shape_key,
                      rows=analyzed.category == Category.ACTIVATION)
    record = record.with_entry(a_entry)
    save_record(record, record_path(layouts, gpu))
    OUT.mkdir(parents=True, exist_ok=True)
    save_record(record, OUT / f"device-allocs-{name}.json")
    analyzer_peak, analyzer_with_record = analyzed.peak(), include(analyzed, a_entry)[0].peak()
    art = solve_entry_layout(config, gpu, layouts)
    save_artifact(art, layouts)
    armed = config.model_copy(update={"layout_ref": art.layout_id})
    cfg_path.write_text(armed.model_dump_json())
    static = _run("static", cfg_path, tmp_path / "static.json", layouts=layouts, timeout=timeout)
    request_peak = static["peak_active_bytes"] - static["active_before_bytes"]
    report = {
        "template": config.template.shape_key, "plan": config.describe(), "gpu": gpu, "steps": STEPS,
        "device_allocs": {"matched": entry.matched, "meta_allocations": entry.meta_allocations,
                          "gpu_allocations": entry.gpu_allocations, "extra": len(entry.extra),
                          "extra_bytes": entry.extra_bytes, "absent": len(entry.absent),
                          "side_stream": len(entry.side_stream), "meta_peak_bytes": entry.meta_peak_bytes,
                          "gpu_peak_bytes": entry.gpu_peak_bytes, "note": art.device_allocs_note},
        "analyzer": {"peak_bytes": analyzer_peak, "peak_with_record_bytes": analyzer_with_record,
                     "gpu_peak_active_bytes": default["peak_active_bytes"],
                     "error": analyzer_peak / default["peak_active_bytes"] - 1,
                     "error_with_record": analyzer_with_record / default["peak_active_bytes"] - 1},
        "layout": {"reserved_bytes": art.reserved_bytes, "lower_bound_bytes": art.layout.lower_bound_bytes,
                   "planned": len(art.replay_plan())},
        "static_over_request_active": art.reserved_bytes / max(1, request_peak),
        "reserved_over_active": static["peak_reserved_bytes"] / max(1, static["peak_active_bytes"]),
        "caching_reserved_over_active": default["peak_reserved_bytes"] / max(1, default["peak_active_bytes"]),
        "step_ratio": static["step_s"] / default["step_s"],
        "outputs_equal": static["output_sha256"] == default["output_sha256"],
        "default": default, "static": {k: v for k, v in static.items() if k != "stats"},
    }
    (OUT / f"allocator_gpu_{name}.json").write_text(json.dumps(report, indent=1))
    return report


@pytest.mark.streams
def test_cogvideox_720x480_armed_layout_against_the_caching_allocator(tmp_path: Path) -> None:
    """With activation offload of the VAE decoder's conv caches, as every CogVideoX entry of
    plans/a6000x8.json arms its layout over it (issue #35): the caches leave on a side stream and
    torch never forwards ``record_stream`` to the pluggable allocator, so the worker's
    ``mark_used`` must keep each cache's block until its copy read it (the CPU model of the same
    semantics: ``pytest -m streams``, tests/runtime/test_streams.py)."""
    from xema_ray.plan import ExecutionConfig, Mitigation
    from xema_ray.templates import RequestTemplate

    config = ExecutionConfig(template=RequestTemplate(model="cogvideox-5b", width=720, height=480, frames=49, steps=STEPS),
                             mitigations=(Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=4096),))
    r = _armed_check("cogvideox-5b_720x480x49", config, tmp_path)
    stats = json.loads((tmp_path / "static.json").read_text())["stats"]
    streams = {k: stats[k] for k in ("marked_uses", "deferred_frees", "peak_pending_free_bytes")}
    (OUT / "allocator_gpu_cogvideox-5b_720x480x49.json").write_text(json.dumps({**r, "streams": streams}, indent=1))
    assert r["static"]["layout_armed"], r["static"]["layout_status"]
    assert streams["marked_uses"] > 0 and streams["deferred_frees"] > 0, streams  # the caches' blocks were held
    assert r["static"]["layout_misses"] == 0, r["device_allocs"]
    assert r["static_over_request_active"] <= 1.02
    assert r["outputs_equal"]
    assert r["step_ratio"] <= 1.01
    assert r["static"]["peak_reserved_bytes"] <= 48 * 10**9


def test_flux2_1024_offload_plan_under_48gb_with_the_layout_armed(tmp_path: Path) -> None:
    from xema_ray.plan import PlanTable

    table = PlanTable.load(str(REPO / "plans" / "flux2-1024-1gpu.json"))
    planned = table.entries["flux2/1024x1024x1"].config
    # the allocator is what is checked: stand-in embeddings instead of the 24 B encoder, batch 1
    config = planned.model_copy(update={"template": planned.template.with_(steps=1), "batch": 1,
                                        "text_encoder": None, "layout_ref": None})
    r = _armed_check("flux2_1024x1024", config, tmp_path)
    assert r["static"]["layout_armed"], r["static"]["layout_status"]
    assert r["static"]["peak_reserved_bytes"] <= 48 * 10**9
    assert r["outputs_equal"]


def test_install_refuses_after_cuda_initialized() -> None:
    code = ("import torch; torch.zeros(1, device='cuda')\n"
            "from xema_ray.allocator.cuda import install_cuda_allocator\n"
            "try:\n    install_cuda_allocator()\nexcept RuntimeError as e:\n    print('refused', e)")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert "refused" in proc.stdout, proc.stdout + proc.stderr


def test_static_region_resizes_and_teardown_with_live_tensors() -> None:
    """The static region follows the template (xema_ray/runtime/arena.py): grown and shrunk on the
    device around a live block of the dynamic region, which keeps its bytes; the device's free
    memory follows each resize; the seconds of each resize are recorded (arena-resize.json). Then
    tensors still alive at interpreter exit are freed after everything else is torn down."""
    code = ("from xema_ray.allocator.cuda import install_cuda_allocator\n"
            "import json, time, numpy as np, torch\n"
            "from xema_ray.allocator import solve_arrays\n"
            "alloc = install_cuda_allocator()\n"
            "layout = solve_arrays(np.array([4096, 4096]), np.array([0, 1]), np.array([3, 3]))\n"
            "alloc.reserve(layout.reserved_bytes, 1 << 20)\n"
            "d = torch.full((1024,), 7, dtype=torch.uint8, device='cuda')  # unarmed: the dynamic region\n"
            "free0 = torch.cuda.mem_get_info()[0]\n"
            "t = time.perf_counter(); alloc.resize_static(4 << 30); grow = time.perf_counter() - t\n"
            "free1 = torch.cuda.mem_get_info()[0]\n"
            "t = time.perf_counter(); alloc.resize_static(layout.reserved_bytes); shrink = time.perf_counter() - t\n"
            "free2 = torch.cuda.mem_get_info()[0]\n"
            "assert free0 - free1 >= (4 << 30) - layout.reserved_bytes - (64 << 20), (free0, free1)\n"
            "assert free2 - free1 >= (4 << 30) - layout.reserved_bytes - (64 << 20), (free1, free2)\n"
            "assert int(d.sum()) == 7 * 1024 and alloc.stats().static_region_bytes == layout.reserved_bytes\n"
            "print('resize', json.dumps({'grow_4gib_s': grow, 'shrink_s': shrink, 'free_bytes': [free0, free1, free2]}))\n"
            "with alloc.armed(layout.replay_plan()) as r:\n"
            "    keep = [torch.empty(4096, dtype=torch.uint8, device='cuda') for _ in range(2)]\n"
            "assert r.hits == 2, r\n"
            "print('ok', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("resize "))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "arena-resize.json").write_text(line.removeprefix("resize "))
