"""Quantized weights as a knob the planner prices (``docs/quality.md``, "The balanced tier"): the
analyzer traces each format's bytes (torchao's own tensors, scales included), the cost model prices
the dequantisation where the GPU does not compute the format, ``--quality balanced`` plans Flux.2
on one 48 GB A6000 with less offload and a lower latency than lossless, and ``xema verify`` (the
worker's own load on meta) holds the predicted peak."""

from __future__ import annotations

import pytest
import torch

from planner.pipeline import PlanRefused, PlanRequest, plan
from planner.task_io import PlanOptions
from planner.tiers import TierNotServed, price_tiers
from xema_ray.analyzer.run import TraceOptions, build_for_trace, trace_template
from xema_ray.memory.analysis import summarize
from xema_ray.mitigation.weight_quant import stored_bytes
from xema_ray.models import get_model_spec
from xema_ray.models.weight_formats import transformer_bytes
from xema_ray.plan import ExecutionConfig, Mitigation, PlanEntry, PlanPrediction, PlanTable
from xema_ray.profiling.costmodel import cost_model_estimate
from xema_ray.profiling.hardware import A6000_8X, H200
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="flux2", height=1024, width=1024, steps=50)
A6000 = PlanOptions(hardware="a6000", budget=48 * 10**9, gpus=1, measure="never")


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_format_bytes_are_torchaos_own(fmt: str) -> None:
    """The bytes the planner counts per format (no quantization run) are the tensors torchao makes."""
    spec = get_model_spec("tiny-flux2")
    model = build_for_trace(spec, TraceOptions(device="meta"), torch.float32).transformer
    quantized = build_for_trace(spec, TraceOptions(device="meta", weights=fmt), torch.float32).transformer  # type: ignore[arg-type]
    rule = spec.weight_quant
    assert rule is not None
    q, rest = transformer_bytes(model, rule, fmt)  # type: ignore[arg-type]
    assert stored_bytes(quantized) == q + rest < stored_bytes(model)


def test_analyze_fp8_peak_is_25_gb_below_bf16() -> None:
    """``xema analyze --model flux2 --height 1024 --width 1024 --weights fp8``: the whole request's
    peak (its text encoder on the device) at least 25 GB below bf16's."""
    t = FLUX.with_(steps=4)  # every step repeats the first's allocations: the peak is the 50-step one
    peaks = {w: summarize(trace_template(t, TraceOptions(text_encoder="device", weights=w)), None).peak_bytes
             for w in ("model", "fp8")}
    assert peaks["model"] - peaks["fp8"] >= 25 * 10**9


def test_cost_model_prices_dequantisation_where_the_gpu_stores_only() -> None:
    offload = (Mitigation(kind="block_offload", blocks=tuple(range(16)), intensity=16),)
    bf16 = ExecutionConfig(template=FLUX, mitigations=offload)
    fp8 = bf16.model_copy(update={"weights": "fp8"})
    plain, plain8 = ExecutionConfig(template=FLUX), ExecutionConfig(template=FLUX, weights="fp8")
    # the A6000 stores fp8 only: a dequantisation pass per block and step
    assert cost_model_estimate(plain8, A6000_8X).total_s > cost_model_estimate(plain, A6000_8X).total_s
    # the H200 computes fp8: no pass (and no faster GEMM credited)
    assert cost_model_estimate(plain8, H200).total_s == pytest.approx(cost_model_estimate(plain, H200).total_s)
    # offloaded blocks copy half the bytes: an offloading plan is faster quantized even on the A6000
    assert cost_model_estimate(fp8, A6000_8X).total_s < cost_model_estimate(bf16, A6000_8X).total_s
    assert A6000_8X.weight_format("fp8") == "fp8" and H200.weight_format("int8") == "int8"


def _offloaded(e: PlanEntry) -> int:
    return sum(m.intensity for m in e.config.mitigations if m.kind == "block_offload")


def test_balanced_plans_flux2_on_an_a6000_with_less_offload_and_lower_latency() -> None:
    from xema_ray.measure.verify import verify_config

    lossless = plan(PlanRequest((FLUX,), A6000, layouts=False, use_ray=False)).table.entries[FLUX.shape_key]
    balanced = plan(PlanRequest((FLUX,), A6000, layouts=False, use_ray=False, quality="balanced")
                    ).table.entries[FLUX.shape_key]
    assert lossless.config.weights == "model" and balanced.config.weights == "fp8"
    assert list(balanced.tiers) == ["balanced"] and balanced.tiers["balanced"].weights == "fp8"
    assert _offloaded(balanced) < _offloaded(lossless)
    assert balanced.prediction.latency_s < lossless.prediction.latency_s
    assert balanced.prediction.peak_bytes <= A6000.budget
    # the lossless plan's tiers price balanced by arithmetic on its own configuration
    assert lossless.tiers["balanced"].weights == "fp8"
    checked = verify_config(balanced.config, budget_bytes=A6000.budget)
    assert checked.error is None and checked.device_peak_bytes <= A6000.budget
    assert checked.device_peak_bytes == pytest.approx(balanced.prediction.peak_bytes, rel=0.05)


def _entry(t: RequestTemplate) -> PlanEntry:
    return PlanEntry(config=ExecutionConfig(template=t), prediction=PlanPrediction(
        peak_bytes=10**7, latency_s=10.0, goodput_rps=0.1, slo_s=30.0, latency_source="estimated"))


def test_balanced_is_priced_where_the_spec_quantizes_and_refused_elsewhere() -> None:
    flux = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=8)
    ltx = RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=8)
    cpu = PlanTable(hardware="cpu:test", gpus=1, budget_bytes=2**30, entries={
        flux.shape_key: _entry(flux), ltx.shape_key: _entry(ltx)})
    priced = price_tiers(cpu).entries
    tier = priced[flux.shape_key].tiers["balanced"]
    assert tier.weights == "int8" and tier.cache is None  # the CPU stores int8
    assert tier.peak_bytes < 10**7 and priced[flux.shape_key].tier_config("balanced").weights == "int8"
    assert "balanced" not in priced[ltx.shape_key].tiers
    gpu = cpu.model_copy(update={"hardware": A6000_8X.name, "entries": {flux.shape_key: _entry(flux)}})
    assert price_tiers(gpu).entries[flux.shape_key].tiers["balanced"].weights == "fp8"
    with pytest.raises(TierNotServed, match="tiny-ltx2 serves fast, lossless"):
        price_tiers(cpu, only="balanced")
    with pytest.raises(PlanRefused, match="serves"):
        plan(PlanRequest((ltx,), PlanOptions(hardware="a6000", budget=2**30, gpus=1, measure="never"),
                         layouts=False, use_ray=False, quality="balanced"))
