"""One GPU process of the static-allocator check (tests/layout/test_allocator_gpu.py).

Runs one workload under one allocator and writes a JSON report:

* ``default``: PyTorch's caching allocator;
* ``expandable``: the caching allocator with ``expandable_segments:True`` (the parent sets
  ``PYTORCH_CUDA_ALLOC_CONF`` before this process starts, as torch reads it at CUDA init);
* ``static``: libxema_alloc installed before CUDA is initialized; one request to warm up, one
  recorded (the real allocation stream becomes the trace), the layout solved from it, and the
  measured request armed with that plan.

Every mode runs a warm-up request first and measures the next one, so per-step times compare
like with like. Usage:
    python tests/layout/gpu_alloc_worker.py --mode static --workload dit --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Workload:
    """A request to run: ``run(step_times)`` performs it and returns the output tensor,
    appending one wall time per denoising step to ``step_times``."""

    name: str
    run: Callable[[list[float]], torch.Tensor]


def _timed_step(step_times: list[float], start: list[float]) -> None:
    # A step's time needs its kernels finished; both allocators are measured the same way.
    torch.cuda.synchronize()
    now = time.perf_counter()
    step_times.append(now - start[0])
    start[0] = now


def dit_workload(steps: int = 8) -> Workload:
    """A self-contained DiT-like denoiser in bf16 (random weights): attention + MLP blocks over
    a CFG batch, a scheduler-like update per step. Needs no model code or weights."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    hidden, heads, tokens, blocks, batch = 2048, 16, 8192, 12, 2
    layers = []
    for _ in range(blocks):
        layers.append(
            torch.nn.ModuleDict(
                {
                    "norm1": torch.nn.LayerNorm(hidden),
                    "qkv": torch.nn.Linear(hidden, 3 * hidden),
                    "proj": torch.nn.Linear(hidden, hidden),
                    "norm2": torch.nn.LayerNorm(hidden),
                    "up": torch.nn.Linear(hidden, 4 * hidden),
                    "down": torch.nn.Linear(4 * hidden, hidden),
                }
            )
        )
    model = torch.nn.ModuleList(layers).to(dev, torch.bfloat16).eval()
    gen = torch.Generator(device="cpu").manual_seed(1)
    init = torch.randn(batch, tokens, hidden, generator=gen, dtype=torch.bfloat16)

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer in model:
            h = layer["norm1"](x)
            q, k, v = layer["qkv"](h).view(batch, tokens, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            x = x + layer["proj"](a.transpose(1, 2).reshape(batch, tokens, hidden))
            x = x + layer["down"](torch.nn.functional.gelu(layer["up"](layer["norm2"](x))))
        return x

    def run(step_times: list[float]) -> torch.Tensor:
        with torch.no_grad():
            x = init.to(dev)
            start = [time.perf_counter()]
            for _ in range(steps):
                x = x - 0.1 * forward(x)
                _timed_step(step_times, start)
            return x.float().cpu()

    return Workload("dit", run)


def pipeline_workload(model: str, height: int, width: int, frames: int, steps: int) -> Workload:
    """A real diffusers pipeline from the model registry, random bf16 weights."""
    from xema_ray.models import BuildOptions
    from xema_ray.templates import RequestTemplate

    template = RequestTemplate(model=model, height=height, width=width, frames=frames, steps=steps)
    spec = template.spec
    pipe = spec.build_pipeline(BuildOptions(device="cuda", dtype=torch.bfloat16))
    inputs = spec.prompt_embeddings(["a photo of a cat"] * template.batch, "cuda", torch.bfloat16)
    call = spec.call_kwargs(template)

    def run(step_times: list[float]) -> torch.Tensor:
        start = [time.perf_counter()]

        def on_step_end(_pipe: Any, _i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            _timed_step(step_times, start)
            return kwargs

        gen = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():
            out = pipe(**call, **inputs, generator=gen, output_type="pt", callback_on_step_end=on_step_end)
        frames_out = out.frames if hasattr(out, "frames") else out.images
        return torch.as_tensor(frames_out).float().cpu()

    return Workload(template.key, run)


def make_workload(spec: str) -> Workload:
    """``dit`` or ``model:HxWxF:steps`` (e.g. ``cogvideox-5b:720x480x49:4``)."""
    if spec == "dit":
        return dit_workload()
    model, shape, steps = spec.split(":")
    width, height, frames = (int(v) for v in shape.split("x"))
    return pipeline_workload(model, height, width, frames, int(steps))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["default", "expandable", "static"], required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", type=Path, required=True)
    # Every allocation of the measured request is planned (the test checks it), so the dynamic
    # region would only add unused reserved bytes; unplanned allocations go to the driver.
    ap.add_argument("--dynamic-mib", type=int, default=0, help="dynamic region of the static allocator")
    args = ap.parse_args()

    alloc = None
    if args.mode == "static":
        from xema_ray.runtime.allocator import install_cuda_allocator

        alloc = install_cuda_allocator()  # before anything initializes CUDA

    # Same kernels in every process: no cuDNN autotuning (it also breaks under a pluggable
    # allocator) and flash / memory-efficient attention only.
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_math_sdp(False)

    workload = make_workload(args.workload)
    report: dict[str, Any] = {"mode": args.mode, "workload": workload.name, "device": torch.cuda.get_device_name()}
    report["torch"] = torch.__version__

    warm_times: list[float] = []
    workload.run(warm_times)  # lazy inits, cuBLAS workspaces, autotuned kernels: once per process

    if alloc is None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times: list[float] = []
        output = workload.run(times)
        torch.cuda.synchronize()
        report["peak_active_bytes"] = torch.cuda.max_memory_allocated()
        report["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        from xema_ray.layout import solve_layout

        stream = int(torch.cuda.current_stream().cuda_stream)
        with alloc.record(device=0) as rec:
            workload.run([])
            torch.cuda.synchronize()
        trace = rec.trace(stream=stream, meta={"workload": workload.name})
        layout = solve_layout(trace)
        layout.verify()
        plan = layout.replay_plan()
        alloc.reserve(layout.reserved_bytes, args.dynamic_mib << 20, device=0)
        alloc.reset_peaks(device=0)
        times = []
        with alloc.armed(plan, device=0, stream=stream) as request:
            output = workload.run(times)
            torch.cuda.synchronize()
        stats = alloc.stats(device=0)
        report.update(
            {
                "peak_active_bytes": stats.peak_active_bytes,
                "peak_reserved_bytes": stats.peak_reserved_bytes,
                "plan_length": len(plan),
                "planned_hits": request.hits,
                "planned_misses": request.misses,
                "fell_back": request.fell_back,
                "unplanned_allocs": request.unplanned,
                "layout_reserved_bytes": layout.reserved_bytes,
                "layout_lower_bound_bytes": layout.lower_bound_bytes,
                "layout_solve_seconds": layout.solve_seconds,
                "trace_allocations": len(trace),
                "stats": stats.model_dump(),
            }
        )
        free, total = torch.cuda.mem_get_info()
        report["device_used_bytes"] = total - free  # independent of our own bookkeeping
    report["output_sha256"] = digest(output)
    report["step_seconds"] = times
    report["step_seconds_median"] = statistics.median(times)
    report["warm_step_seconds_median"] = statistics.median(warm_times) if warm_times else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("stats", "step_seconds")}))


if __name__ == "__main__":
    main()
