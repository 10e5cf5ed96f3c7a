"""Attention chunking (DiT chunking's ``attention`` part, issue #16): the DiT peak it saves,
traced at real size on the meta device, and its kernel overhead, timed on this machine.

1. Peak: CogVideoX-5B (bf16, meta device, CUDA-like attention accounting) with every DiT block
   chunked over feed-forward, norms and rotary, with and without the attention part, on top of
   CFG serialization x2 (the Figure 11 plans' DiT side); ``--steps`` denoising steps traced
   (every step allocates the same pattern).
2. Overhead: the tiny models on this CPU, whole pipeline with every block's attention chunked
   vs unchunked (median of ``--repeats``), so the number is the query-slicing cost alone.

Writes ``--out`` (JSON) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from xema_ray.memory.analysis import phase_peaks
from xema_ray.analyzer.run import TraceOptions, default_dtype_for, trace_template
from xema_ray.mitigation.dit_chunking import DitChunkingConfig, apply_dit_chunking
from xema_ray.mitigation.serialization import SerializationConfig, apply_serialization
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import Phase, phase_of_trace

WITHOUT = ("ff", "qk_norm", "rotary")
WITH = ("ff", "qk_norm", "rotary", "attention")


def dit_peak(t: RequestTemplate, parts: tuple[str, ...], chunks: int, serialize: int) -> int:
    spec = t.spec
    pipe = spec.build_pipeline(BuildOptions(device="meta", dtype=default_dtype_for(spec)))
    blocks = spec.dit_blocks(pipe.transformer)
    handles = [apply_dit_chunking(blocks, DitChunkingConfig(blocks=tuple(range(len(blocks))), chunks=chunks,
                                                            parts=parts))]  # type: ignore[arg-type]
    if serialize > 1:
        handles.append(apply_serialization(pipe, SerializationConfig(modules=("transformer",), sub_batches=serialize)))
    try:
        trace = trace_template(t, TraceOptions(device="meta", dtype=default_dtype_for(spec)), pipeline=pipe)
    finally:
        for h in reversed(handles):
            h.remove()
    return max(p.peak_bytes for p in phase_peaks(trace) if phase_of_trace(p.phase) == Phase.DENOISE)


def cpu_overhead(model: str, chunks: int, repeats: int) -> dict[str, Any]:
    spec = get_model_spec(model)
    pipe = spec.build_pipeline(BuildOptions())
    frames = 1 if spec.kind == "image" else 9
    t = RequestTemplate(model=model, height=128, width=128, frames=frames, steps=4)
    kwargs = {**spec.call_kwargs(t), **spec.prompt_embeddings(["bench"], "cpu", torch.float32), "output_type": "pt"}

    def run() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0))
        return time.perf_counter() - t0

    run()  # warm-up
    base = [run() for _ in range(repeats)]
    blocks = spec.dit_blocks(pipe.transformer)
    h = apply_dit_chunking(blocks, DitChunkingConfig(blocks=tuple(range(len(blocks))), chunks=chunks, parts=("attention",)))
    try:
        chunked = [run() for _ in range(repeats)]
    finally:
        h.remove()
    b, c = statistics.median(base), statistics.median(chunked)
    return {"model": model, "chunks": chunks, "unchunked_s": b, "chunked_s": c, "overhead": c / b - 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/attention_chunking.json"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-peak", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    peaks = []
    if not args.skip_peak:
        t = RequestTemplate(model="cogvideox-5b", width=1920, height=1088, frames=289, steps=args.steps)
        for serialize in (2,):
            t0 = time.perf_counter()
            row = {"template": t.key, "serialize": serialize, "chunks": args.chunks,
                   "dit_peak_without": dit_peak(t, WITHOUT, args.chunks, serialize),
                   "dit_peak_with": dit_peak(t, WITH, args.chunks, serialize)}
            row["seconds"] = time.perf_counter() - t0
            peaks.append(row)
            print(row, flush=True)
    overhead = [cpu_overhead(m, args.chunks, args.repeats) for m in ("tiny-flux2", "tiny-cogvideox", "tiny-ltx2")]
    machine = f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "peaks": peaks, "cpu_overhead": overhead}, indent=1))
    for r in peaks:
        print(f"| {r['template']} | serialization ×{r['serialize']}, DiT chunking ×{r['chunks']} | "
              f"{r['dit_peak_without'] / 1e9:.2f} | {r['dit_peak_with'] / 1e9:.2f} | "
              f"{(r['dit_peak_without'] - r['dit_peak_with']) / 1e9:.2f} |")
    for r in overhead:
        print(f"| {r['model']} 128² | ×{r['chunks']} | {r['unchunked_s']:.3f} | {r['chunked_s']:.3f} | {r['overhead'] * 100:+.1f} % |")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
