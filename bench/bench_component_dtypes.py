"""What keeping CogVideoX-5b's VAE in fp32, as its repository stores it, costs on the device: the
analyzer's trace of the reference template (1280x720x49, 50 steps, batch 1) with every component
in bf16 (the VAE cast on load) against the VAE kept in fp32 (``component_dtypes: {vae: float32}``).
Counted on the meta device (no weights, no GPU): resident weights, the request's peak and the
peak of the VAE decode, where the fp32 weights meet fp32 activations.

Example:
    python bench/bench_component_dtypes.py --out bench/results/component_dtypes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.memory.trace import MemoryTrace
from xema_ray.models.base import model_dtypes
from xema_ray.templates import RequestTemplate


def decode_peak(trace: MemoryTrace) -> int:
    """The largest live bytes between the VAE decode's first and last allocation."""
    in_decode = trace.phase == trace.phases.index("decode.vae")
    first, last = int(trace.begin[in_decode].min()), int(trace.begin[in_decode].max())
    return int(trace.active_curve()[first:last + 1].max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/component_dtypes.json"))
    p.add_argument("--frames", type=int, default=49)
    args = p.parse_args(argv)
    t = RequestTemplate(model="cogvideox-5b", width=1280, height=720, frames=args.frames, steps=50)
    rows = {}
    for name, components in (("vae cast to bf16", {}), ("vae kept fp32", {"vae": "float32"})):
        base, kept = model_dtypes(t.spec, None, components)
        t0 = time.perf_counter()
        trace = trace_template(t, TraceOptions(dtype=base, component_dtypes=kept, replay_blocks=True))
        rows[name] = {"resident_bytes": trace.resident_bytes(), "peak_bytes": trace.peak(),
                      "decode_peak_bytes": decode_peak(trace), "trace_s": round(time.perf_counter() - t0, 1)}
        print(name, rows[name], flush=True)
    cast, kept_row = rows["vae cast to bf16"], rows["vae kept fp32"]
    result = {
        "template": t.key, "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), torch {torch.__version__}",
        "rows": rows,
        "fp32_vae_extra": {k: kept_row[k] - cast[k] for k in ("resident_bytes", "peak_bytes", "decode_peak_bytes")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["fp32_vae_extra"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
