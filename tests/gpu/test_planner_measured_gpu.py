"""GPU check of measured planning (issue #16, run by `make gpu-check`): Flux.2 1024² and
CogVideoX-5B 720×480×49 planned on this GPU with latencies measured by the segment-reuse
profiler (each planning task builds the model at its real config with random bf16 weights).

Per template: planning wall time (the paper: 184 s of profiling per template), candidates
measured / estimated, the entry's ``latency_source``; per segment class (denoising step, VAE
decode) of the chosen configuration, measured against the roofline estimate. Results go to
$XEMA_GPU_OUT/planner_measured.json. Budget 48 GB (the A6000's), so stage 3 has mitigations to
measure; batches up to 2 keep the check within `make gpu-check`'s 8 minutes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from xema_ray.profiling import cost_model_estimate
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.gpu

TEMPLATES = [RequestTemplate(model="flux2", width=1024, height=1024),
             RequestTemplate(model="cogvideox-5b", width=720, height=480, frames=49)]


def _hardware() -> str:
    from xema_ray.platforms import get_platform

    name = get_platform("cuda").hardware_name().lower()
    return "h200" if "h200" in name else "a6000" if "a6000" in name else "local-gpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_planning_measures_candidates_on_the_gpu(tmp_path: Path) -> None:
    from planner.driver import PlanOptions, plan_one
    from planner.latency import LatencyModel

    hardware = _hardware()
    store = tmp_path / "profiles.json"
    opts = PlanOptions(hardware=hardware, budget=48 * 10**9, gpus=1, group_gpus={}, slo_scale=1.0, max_batch=2,
                       planner="xema", trace_cache=str(tmp_path / "traces"), time_limit_s=None,
                       profile_store=str(store), measure="always")
    rows = []
    for t in TEMPLATES:
        t0 = time.perf_counter()
        result = plan_one(t, opts)
        wall = time.perf_counter() - t0
        assert result.device == "cuda" and result.measured >= 1, result
        assert result.entry is not None, f"{t.key}: no plan"
        entry = result.entry
        assert entry.prediction.latency_source in ("measured", "measured+estimated")
        latency = LatencyModel(hardware, store_path=store)
        from xema_ray.platforms import get_platform

        latency.on_device(get_platform("cuda").hardware_fingerprint())
        measured = latency.estimate(entry.config)  # the store's record for the chosen config
        roofline = cost_model_estimate(entry.config, latency.hardware)
        steps = entry.config.template.steps
        classes = {
            "denoising step": (measured.per_phase.get("denoise", 0.0) / steps, roofline.per_phase["denoise"] / steps),
            "VAE decode": (measured.per_phase.get("decode", 0.0), roofline.per_phase["decode"]),
        }
        rows.append({
            "template": t.key, "plan": entry.config.describe(), "wall_s": wall, "measured": result.measured,
            "estimated": result.estimated, "latency_source": entry.prediction.latency_source,
            "latency_s": entry.prediction.latency_s, "not_measured": list(result.not_measured),
            "segment_classes": {k: {"measured_s": m, "roofline_s": r, "roofline_over_measured": r / m if m else None}
                                for k, (m, r) in classes.items()},
        })
    out = Path(os.environ.get("XEMA_GPU_OUT", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_measured.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1))
