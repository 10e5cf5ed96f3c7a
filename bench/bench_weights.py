"""Quantized weights, the ``balanced`` tier (``docs/quality.md``): plan against run.

1. ``xema analyze``'s figure: Flux.2 1024x1024's whole-request peak (text encoder on the device)
   with the transformer in bf16, fp8 and int8 (meta device, torchao's own tensors).
2. ``xema plan --quality lossless|balanced`` for Flux.2 1024x1024 on one 48 GB A6000 (cost model)
   and ``xema verify`` of each plan (the worker's own load and execute on meta): offload, predicted
   latency, predicted and verified peak.
3. tiny-flux2 64x64 on this CPU, loaded int8 weight-only by the worker: the quantized layers' bytes
   and the transformer's against fp32, the image's mean difference from lossless (8-bit levels),
   its PSNR, the transformer output's relative error on one call, and the median batch seconds.

    python -m bench.bench_weights [--out bench/results/weights.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.bench_quality import psnr
from planner.pipeline import PlanRequest, plan
from planner.task_io import PlanOptions
from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.memory.analysis import summarize
from xema_ray.mitigation.weight_quant import WeightQuantConfig, quantized_copy, stored_bytes
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime import Batch, GenerationRequest
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="flux2", height=1024, width=1024, steps=50)
TINY = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=8)


def mean_abs_difference(a: bytes, b: bytes) -> float:
    """Mean absolute difference of two 8-bit images' pixels, in levels."""
    x, y = (np.asarray(Image.open(io.BytesIO(d)), dtype=np.float64) for d in (a, b))
    return float(np.abs(x - y).mean())


def analyzed() -> dict[str, float]:
    """Flux.2 1024x1024's peak (GB) per weight format, as ``xema analyze`` reports it."""
    out = {}
    for fmt in ("model", "fp8", "int8"):
        trace = trace_template(FLUX.with_(steps=4), TraceOptions(text_encoder="device", weights=fmt))  # type: ignore[arg-type]
        out["bf16" if fmt == "model" else fmt] = summarize(trace, None).peak_bytes / 1e9
    return out


def planned() -> dict[str, Any]:
    """Flux.2 1024x1024 on one 48 GB A6000, lossless and balanced: plan and verify."""
    from xema_ray.measure.verify import verify_config

    opts = PlanOptions(hardware="a6000", budget=48 * 10**9, gpus=1, measure="never")
    out: dict[str, Any] = {}
    for quality in ("lossless", "balanced"):
        e = plan(PlanRequest((FLUX,), opts, layouts=False, use_ray=False, quality=quality)).table.entries[FLUX.shape_key]
        v = verify_config(e.config, budget_bytes=opts.budget)
        out[quality] = {"plan": e.config.describe(), "latency_s": round(e.prediction.latency_s, 2),
                        "offloaded_blocks": sum(m.intensity for m in e.config.mitigations if m.kind == "block_offload"),
                        "predicted_peak_gb": round(e.prediction.peak_bytes / 1e9, 2),
                        "verified_peak_gb": round(v.device_peak_bytes / 1e9, 2), "fits": v.fits}
    return out


def _worker(weights: str) -> Worker:
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model=TINY.model, plans=(ExecutionConfig(template=TINY, weights=weights),)))  # type: ignore[arg-type]
    return w


def _run(w: Worker, weights: str, seed: int) -> tuple[bytes, float]:
    config = ExecutionConfig(template=TINY, weights=weights)  # type: ignore[arg-type]
    batch = Batch(config=config, requests=(GenerationRequest(request_id="r", prompt="a red fox", seed=seed),),
                  steps=TINY.steps)
    t0 = time.perf_counter()
    data = w.execute(batch).outputs[0].data
    return data, time.perf_counter() - t0


def relative_output_error(fmt: str) -> float:
    """|quantized - fp32| / |fp32| of tiny-flux2's transformer output on one seeded call."""
    spec = get_model_spec(TINY.model)
    pipe = spec.build_pipeline(BuildOptions())
    q = quantized_copy(pipe.transformer, spec, WeightQuantConfig(format=fmt))  # type: ignore[arg-type]
    outs = []
    for t in (pipe.transformer, q):
        pipe.transformer = t
        gen = torch.Generator().manual_seed(0)
        latents = pipe(**spec.call_kwargs(TINY.with_(steps=1)), **spec.prompt_embeddings(["a fox"], "cpu", torch.float32),
                       generator=gen, output_type="latent").images
        outs.append(latents.float())
    return float((outs[1] - outs[0]).norm() / outs[0].norm())


def tiny(rounds: int = 3) -> dict[str, Any]:
    lossless, balanced = _worker("model"), _worker("int8")
    rule = get_model_spec(TINY.model).weight_quant
    assert rule is not None
    layers = [(n, m) for n, m in lossless.engine.pipe.transformer.named_modules() if rule.quantizes(n, m)]  # type: ignore[union-attr]
    qt = balanced.engine.pipe.transformer  # type: ignore[union-attr]
    q_layers = [m for n, m in qt.named_modules() if rule.quantizes(n, m)]
    times: dict[str, list[float]] = {"model": [], "int8": []}
    images: dict[str, bytes] = {}
    for _ in range(rounds):
        for fmt, w in (("model", lossless), ("int8", balanced)):
            images[fmt], s = _run(w, fmt, seed=5)
            times[fmt].append(s)
    return {"quantized_layers_ratio": round(sum(stored_bytes(m) for m in q_layers)
                                            / sum(stored_bytes(m) for _, m in layers), 3),
            "transformer_ratio": round(stored_bytes(qt) / stored_bytes(lossless.engine.pipe.transformer), 3),  # type: ignore[union-attr]
            "image_mean_abs_levels": round(mean_abs_difference(images["model"], images["int8"]), 3),
            "psnr_db": round(psnr(images["model"], images["int8"]), 1),
            "relative_output_error": {f: round(relative_output_error(f), 5) for f in ("int8", "fp8")},
            "batch_s_median": {f: round(statistics.median(v), 3) for f, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/weights.json"))
    args = ap.parse_args()
    result = {"analyze_flux2_1024_peak_gb": analyzed(), "plan_flux2_1024_a6000": planned(), "tiny_flux2_int8": tiny(),
              "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
