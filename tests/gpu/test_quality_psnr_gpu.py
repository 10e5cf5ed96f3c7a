"""GPU check of the ``fast`` quality tier (``docs/quality.md``): CogVideoX-5B at its real config
with seeded bf16 weights, 720x480x9, 20 steps, one seed, run lossless and with the default
fixed-budget step cache; records the PSNR of the fast frames against the lossless ones, both
runs' wall times, the steps computed and the cached outputs' bytes against the planner's figure
in $XEMA_GPU_OUT/quality_psnr.json (folded into gpu-check.json).

Seeded random weights are not trained weights: the PSNR says how far the step cache moves this
network's output, not how a trained model's video looks (the published figures are in
docs/quality.md)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from planner.tiers import cache_bytes
from xema_ray.mitigation.step_cache import StepCacheConfig, apply_step_cache
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import ExecutionConfig, PlanEntry, PlanPrediction
from xema_ray.tier_plan import StepCacheSchedule
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.gpu

T = RequestTemplate(model="cogvideox-5b", width=720, height=480, frames=9, steps=20)


def _run(pipe: Any, spec: Any) -> tuple[np.ndarray, float]:
    embeds = spec.prompt_embeddings(["a red fox running in the snow"], "cuda", torch.bfloat16)
    torch.cuda.synchronize()  # start the clock with an idle device
    t0 = time.perf_counter()
    with torch.no_grad():
        out = pipe(**spec.call_kwargs(T), **embeds, generator=torch.Generator("cpu").manual_seed(7), output_type="np")
    torch.cuda.synchronize()  # stop it when the decoder's kernels finished
    return np.asarray(out.frames[0], dtype=np.float64), time.perf_counter() - t0


def test_fast_tier_psnr_against_lossless_on_cogvideox_5b() -> None:
    spec = get_model_spec(T.model)
    pipe = spec.build_pipeline(BuildOptions(device="cuda", dtype=torch.bfloat16))
    _run(pipe, spec)  # warm-up: cuBLAS workspaces and the first kernels are not the tier's time
    lossless, lossless_s = _run(pipe, spec)
    schedule = StepCacheSchedule()
    handle, state = apply_step_cache([pipe.transformer], StepCacheConfig.for_request(schedule, T.steps))
    with handle:
        torch.cuda.reset_peak_memory_stats()
        fast, fast_s = _run(pipe, spec)
        kept = sum(t.numel() * t.element_size() for leaves, _ in state.cached.values() for t in leaves
                   if isinstance(t, torch.Tensor))
    mse = float(((fast - lossless) ** 2).mean())  # frames in [0, 1]
    psnr = float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)
    entry = PlanEntry(config=ExecutionConfig(template=T), prediction=PlanPrediction(
        peak_bytes=0, latency_s=1.0, goodput_rps=0.0, slo_s=1.0, latency_source="estimated"))
    record = {"template": T.key, "steps": T.steps, "computed": state.computed, "reused": state.reused,
              "psnr_db": psnr, "lossless_s": lossless_s, "fast_s": fast_s, "ratio": fast_s / lossless_s,
              "cached_bytes": kept, "planned_cached_bytes": cache_bytes(entry)}
    print(json.dumps(record))
    out = Path(os.environ.get("XEMA_GPU_OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality_psnr.json").write_text(json.dumps(record, indent=1))
    assert state.computed == schedule.computed_steps(T.steps) and state.reused == T.steps - state.computed
    assert kept == cache_bytes(entry)  # the planner's figure is what the hook holds
    assert np.isfinite(psnr) and psnr > 10 and fast_s < lossless_s
