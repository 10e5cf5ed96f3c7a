"""Latency profiler benchmark (paper §7.2) and cost-model comparison.

Part 1, CPU, tiny models: for each template, profile with segment reuse (one 3-step calibration
request; identical blocks and steady steps share measurements), then measure the full request
end to end (median of --repeats runs); report the estimate's error and how many segments were
executed to profile versus how many the estimate covers. A second template of the same shape
with more steps shows reuse from the store (nothing executed).

Part 2: the roofline cost model's per-step and VAE estimates for CogVideoX-5B and Flux.2 on the
H200 next to the calibration measurements of docs/measured-facts.md (uncalibrated, then calibrated
with one measured point per model in a profile store and evaluated on the other points), plus
the same configs on the paper's 8x A6000 box.

    python bench/bench_profiler.py --out bench/results/profiler.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import ExecutionConfig
from xema_ray.profiling import A6000_8X, H200, ProfileStore, RequestRecord, estimate_latency
from xema_ray.profiling.costmodel import block_compute_s, transformer_blocks
from xema_ray.measure.profiler import LatencyProfiler
from xema_ray.runtime import ExecutionEngine
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import LatencySource, Phase

TINY = {
    "tiny-flux2": RequestTemplate(model="tiny-flux2", height=256, width=256, steps=50),
    "tiny-cogvideox": RequestTemplate(model="tiny-cogvideox", height=128, width=128, frames=9, steps=50),
    "tiny-ltx2": RequestTemplate(model="tiny-ltx2", height=128, width=128, frames=9, steps=30),
}

# measured on the H200 (torch 2.11, diffusers 0.42.1, bf16, random weights):
# docs/measured-facts.md, "Calibration points"
H200_POINTS = [
    ("Flux.2 1024² step", RequestTemplate(model="flux2", height=1024, width=1024), "step", 0.56),
    ("Flux.2 1024² VAE decode", RequestTemplate(model="flux2", height=1024, width=1024), "decode", 0.23),
    ("CogVideoX-5B 720p×49 step (CFG)", RequestTemplate(model="cogvideox-5b", height=720, width=1280, frames=49), "step", 7.98),
    ("CogVideoX-5B 720p×49 VAE decode", RequestTemplate(model="cogvideox-5b", height=720, width=1280, frames=49), "decode", 6.0),
    ("CogVideoX-5B 480p×49 step (CFG)", RequestTemplate(model="cogvideox-5b", height=480, width=720, frames=49), "step", 1.74),
    ("CogVideoX-5B 480p×49 VAE decode", RequestTemplate(model="cogvideox-5b", height=480, width=720, frames=49), "decode", 2.2),
]


def bench_tiny(models: list[str], repeats: int) -> list[dict[str, object]]:
    rows = []
    for name in models:
        template = TINY[name]
        spec = get_model_spec(name)
        engine = ExecutionEngine(spec.build_pipeline(BuildOptions()), spec, torch.device("cpu"), torch.float32)
        store = ProfileStore()
        profiler = LatencyProfiler(engine, store)
        config = ExecutionConfig(template=template)
        engine.run_pipeline(config.model_copy(update={"template": template.with_(steps=2)}), ["warm-up"], [0], steps=2)
        t0 = time.perf_counter()
        report = profiler.profile(config)
        profile_s = time.perf_counter() - t0
        measured = profiler.measure(config, repeats=repeats)
        longer = profiler.profile(ExecutionConfig(template=template.with_(steps=template.steps * 2)))
        rows.append(
            {
                "template": template.key,
                "estimate_s": report.estimate_s,
                "measured_s": measured.total_s,
                "error": report.estimate_s / measured.total_s - 1,
                "segments_estimated": report.segments_estimated,
                "segments_profiled": report.segments_profiled,
                "ratio": report.segments_estimated / max(1, report.segments_profiled),
                "signatures": report.signatures,
                "profiling_s": profile_s,
                "estimate_per_phase": report.per_phase,
                "measured_per_phase": measured.per_phase,
                "reuse_template": longer.template,
                "reuse_segments_profiled": longer.segments_profiled,
                "reuse_signatures_reused": longer.signatures_reused,
                "reuse_estimate_s": longer.estimate_s,
            }
        )
    return rows


def bench_costmodel() -> dict[str, object]:
    uncal = []
    for label, template, kind, measured in H200_POINTS:
        est = estimate_latency(ExecutionConfig(template=template), H200)
        value = est.per_step_s if kind == "step" else est.per_phase[Phase.DECODE]
        assert value is not None
        uncal.append({"point": label, "measured_s": measured, "estimate_s": value, "error": value / measured - 1,
                      "a6000_estimate_s": (estimate_latency(ExecutionConfig(template=template), A6000_8X).per_step_s if kind == "step"
                                           else estimate_latency(ExecutionConfig(template=template), A6000_8X).per_phase[Phase.DECODE])})
    blocks = transformer_blocks(get_model_spec("flux2"), H200_POINTS[0][1], rows=1)
    flux_blocks = {
        "double_block_ms": block_compute_s(blocks[0], H200) * 1e3, "double_block_measured_ms": 9.1,
        "single_block_ms": block_compute_s(blocks[-1], H200) * 1e3, "single_block_measured_ms": 8.8,
        "double_block_gb": blocks[0].weight_bytes / 1e9, "single_block_gb": blocks[-1].weight_bytes / 1e9,
    }
    # calibrated: one measured point per model (720p CogVideoX, Flux.2 1024²) in a store, the rest predicted
    hw = H200.model_copy(update={"fingerprint": "h200-reference"})
    store = ProfileStore()
    for template, step, decode in [(H200_POINTS[0][1], 0.56, 0.23), (H200_POINTS[2][1], 7.98, 6.0)]:
        cfg = ExecutionConfig(template=template)
        store.put_request(RequestRecord(
            fingerprint="h200-reference", model=template.model, template=template.key, config_hash=cfg.config_hash(),
            source=LatencySource.MEASURED, total_s=step * template.steps + decode, per_phase={Phase.DENOISE: step * template.steps, Phase.DECODE: decode},
            steps=template.steps, measured_at=0.0, config=cfg,
        ))
    held_out = []
    for label, template, kind, measured in H200_POINTS[4:]:
        est = estimate_latency(ExecutionConfig(template=template), hw, store)
        value = est.per_step_s if kind == "step" else est.per_phase[Phase.DECODE]
        assert value is not None
        held_out.append({"point": label, "measured_s": measured, "calibrated_estimate_s": value, "error": value / measured - 1})
    return {"uncalibrated": uncal, "flux2_blocks": flux_blocks, "calibrated_held_out": held_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(TINY), choices=list(TINY))
    ap.add_argument("--repeats", type=int, default=3, help="full-request measurements (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 keeps a shared CI box's noise down)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tiny = bench_tiny(args.models, args.repeats)
    print("## Segment-reuse profiler vs measured full request (CPU, tiny models)\n")
    print("| template | estimate (s) | measured (s) | error | segments estimated | segments executed to profile | ratio | operator combinations | profiling (s) | 2x steps: segments executed | 2x steps: reused |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in tiny:
        print(f"| {r['template']} | {r['estimate_s']:.3f} | {r['measured_s']:.3f} | {r['error']:+.1%} | {r['segments_estimated']} | "
              f"{r['segments_profiled']} | {r['ratio']:.1f}x | {r['signatures']} | {r['profiling_s']:.2f} | "
              f"{r['reuse_segments_profiled']} | {r['reuse_signatures_reused']} |")
    cm = bench_costmodel()
    print("\n## Roofline cost model vs H200 calibration points (docs/measured-facts.md) — estimates, uncalibrated\n")
    print("| point | measured H200 (s) | estimate H200 (s) | error | estimate 8x A6000 box, 1 GPU (s) |")
    print("|---|---|---|---|---|")
    for r in cm["uncalibrated"]:  # type: ignore[union-attr]
        print(f"| {r['point']} | {r['measured_s']:.2f} | {r['estimate_s']:.2f} | {r['error']:+.0%} | {r['a6000_estimate_s']:.2f} |")
    fb = cm["flux2_blocks"]
    print(f"\nFlux.2 blocks on H200: double {fb['double_block_ms']:.1f} ms (measured 9.1, {fb['double_block_gb']:.2f} GB), "  # type: ignore[index]
          f"single {fb['single_block_ms']:.1f} ms (measured 8.8, {fb['single_block_gb']:.2f} GB)")  # type: ignore[index]
    print("\n## Calibrated on Flux.2 1024² and CogVideoX 720p, predicting the 480p points\n")
    print("| point | measured H200 (s) | calibrated estimate (s) | error |")
    print("|---|---|---|---|")
    for r in cm["calibrated_held_out"]:  # type: ignore[union-attr]
        print(f"| {r['point']} | {r['measured_s']:.2f} | {r['calibrated_estimate_s']:.2f} | {r['error']:+.0%} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"tiny": tiny, "cost_model": cm, "threads": args.threads}, indent=1))


if __name__ == "__main__":
    main()
