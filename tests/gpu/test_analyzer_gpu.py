"""GPU check of the analyzer (run by `make gpu-check`): the meta-device prediction of the active
peak against ``torch.cuda.max_memory_allocated()`` for the same pipeline call on a real GPU,
real configs, random bf16 weights. Needs ~80 GB of GPU memory for Flux.2 (64.6 GB of weights)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.models import BuildOptions
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.gpu

CASES = [
    RequestTemplate(model="cogvideox-5b", height=480, width=720, frames=49, steps=2),
    RequestTemplate(model="flux2", height=1024, width=1024, steps=2),
    # reference images (issue #41): the VAE encode of each and the longer sequence
    RequestTemplate(model="flux2", height=1024, width=1024, steps=2, references=1),
    RequestTemplate(model="cogvideox-5b-i2v", height=480, width=720, frames=49, steps=2, references=1),
    # Wan2.2's first frames: I2V-A14B's whole-video encode and both experts (step 0 high-noise, step 1
    # low-noise); TI2V-5B's one-frame encode through the Wan2.2 VAE, replacing latent frame 0
    RequestTemplate(model="wan2.2-i2v-a14b", height=480, width=832, frames=49, steps=2, references=1),
    RequestTemplate(model="wan2.2-ti2v-5b", height=704, width=1280, frames=49, steps=2, references=1),
]


@pytest.mark.parametrize("template", CASES, ids=lambda t: t.key)
def test_predicted_active_peak_within_1pct_of_cuda(template: RequestTemplate) -> None:
    predicted = trace_template(template, TraceOptions(device="meta")).peak()

    spec = template.spec
    # same attention kernels the tracer models: flash / memory-efficient, never the math path
    math_sdp, cudnn_benchmark = torch.backends.cuda.math_sdp_enabled(), torch.backends.cudnn.benchmark
    torch.backends.cuda.enable_math_sdp(False)
    torch.backends.cudnn.benchmark = False
    try:
        pipe = spec.build_pipeline(BuildOptions(device="cuda", dtype=torch.bfloat16))
        inputs = spec.prompt_embeddings(["a photo of a cat"] * template.batch, "cuda", torch.bfloat16)
        call = {**spec.call_kwargs(template), **spec.reference_inputs().kwargs(template)}  # placeholders, as traced
        pipe = spec.pipeline_for(pipe, template)
        gen = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():
            # warm-up: cuBLAS workspaces and lazy imports allocate once per process, not per request
            pipe(**{**call, "num_inference_steps": 1}, **inputs, generator=gen, output_type="pt")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            pipe(**call, **inputs, generator=gen, output_type="pt")
            torch.cuda.synchronize()
    finally:
        torch.backends.cuda.enable_math_sdp(math_sdp)
        torch.backends.cudnn.benchmark = cudnn_benchmark
    measured = torch.cuda.max_memory_allocated()
    out = Path(os.environ.get("XEMA_GPU_OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    name = template.model + (f"_ref{template.references}" if template.references else "")
    (out / f"analyzer_gpu_{name}.json").write_text(json.dumps({
        "template": template.key, "predicted_peak": predicted, "measured_peak": measured,
        "rel_error": (predicted - measured) / measured, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }))
    assert predicted == pytest.approx(measured, rel=0.01)
