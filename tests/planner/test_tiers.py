"""The planner's ``tiers`` pass (``planner.tiers``): each (template, tier) priced from the entry,
the cached outputs' bytes equal to what the analyzer traces, ``--quality`` making the entries the
tier's, a tier a model does not define refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.pipeline import PlanRefused, PlanRequest, plan
from planner.task_io import PlanOptions
from planner.tiers import TierNotServed, cache_bytes, price_tiers, tier_plan
from xema_ray.analyzer.mitigated import trace_with_mitigations
from xema_ray.memory.trace import MemoryTrace
from xema_ray.plan import ExecutionConfig, PlanEntry, PlanPrediction, PlanTable
from xema_ray.tier_plan import DEFAULT_TIERS, QualityTierSpec
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=50)
OPTS = PlanOptions(hardware="a6000", budget=2**30, gpus=1, measure="never")


def _entry(t: RequestTemplate, batch: int = 1) -> PlanEntry:
    return PlanEntry(config=ExecutionConfig(template=t, batch=batch), prediction=PlanPrediction(
        peak_bytes=10**7, latency_s=10.0, goodput_rps=0.1, slo_s=30.0, latency_source="estimated"))


def _held_to_the_end(trace: MemoryTrace) -> int:
    """Bytes of the allocations alive at the end of the traced call (the step cache's buffers)."""
    return int(trace.nbytes[trace.end == trace.n_events].sum())


@pytest.mark.parametrize(("model", "frames"), [("tiny-flux2", 1), ("tiny-cogvideox", 9)])
def test_cached_output_bytes_are_what_the_analyzer_traces(model: str, frames: int) -> None:
    """The analyzer traces the buffers the hook keeps: the bytes it holds beyond the lossless call
    are the planner's figure (a model whose every step is one transformer pass)."""
    t = RequestTemplate(model=model, height=64, width=64, frames=frames, steps=6)
    plain, cached = trace_with_mitigations(t, []), trace_with_mitigations(t, [], step_cache=True)
    assert _held_to_the_end(cached) - _held_to_the_end(plain) == cache_bytes(_entry(t)) > 0
    assert 0 < cached.peak() - plain.peak() <= cache_bytes(_entry(t)) + 512


def test_fast_is_priced_from_its_computed_steps_and_its_cache() -> None:
    e = _entry(FLUX, batch=2)
    fast = tier_plan(e, DEFAULT_TIERS["fast"], denoise_share=0.9)
    computed = DEFAULT_TIERS["fast"].cache.computed_steps(50)  # type: ignore[union-attr]
    assert fast.latency_s == pytest.approx(10.0 * (1 - 0.9 * (1 - computed / 50)))
    assert fast.cache_bytes == cache_bytes(e) == 2 * cache_bytes(_entry(FLUX)) > 0
    assert fast.peak_bytes == 10**7 + fast.cache_bytes
    lossless = tier_plan(e, DEFAULT_TIERS["lossless"], denoise_share=0.9)
    assert (lossless.latency_s, lossless.peak_bytes, lossless.cache) == (10.0, 10**7, None)


def test_price_tiers_lists_every_tier_or_makes_the_entries_one() -> None:
    table = PlanTable(hardware="cpu:test", gpus=1, budget_bytes=2**30, entries={FLUX.shape_key: _entry(FLUX)})
    every = price_tiers(table).entries[FLUX.shape_key]
    assert sorted(every.tiers) == ["balanced", "fast", "lossless"] and every.config.step_cache is None
    fast = price_tiers(table, only="fast").entries[FLUX.shape_key]
    assert list(fast.tiers) == ["fast"] and fast.config.step_cache == DEFAULT_TIERS["fast"].cache
    assert fast.prediction.latency_s == fast.tiers["fast"].latency_s < every.prediction.latency_s
    assert fast.config.layout_ref is None and fast.tier_config("fast") == fast.config
    with pytest.raises(TierNotServed, match="tiny-flux2 serves lossless"):
        price_tiers(table, {"tiny-flux2": {"lossless": QualityTierSpec()}}, only="fast")


def test_plan_with_quality_fast_predicts_the_tiers_latency(tmp_path: Path) -> None:
    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=20)
    lossless = plan(PlanRequest((t,), OPTS, layouts=False, use_ray=False)).table.entries[t.shape_key]
    fast = plan(PlanRequest((t,), OPTS, out=str(tmp_path / "f.json"), layouts=False, use_ray=False,
                            quality="fast")).table.entries[t.shape_key]
    assert lossless.tiers["fast"].latency_s == pytest.approx(fast.prediction.latency_s)
    assert fast.prediction.latency_s < 0.8 * lossless.prediction.latency_s
    assert fast.config.step_cache is not None and PlanTable.load(str(tmp_path / "f.json")).entries[t.shape_key] == fast
    with pytest.raises(PlanRefused, match="serves"):
        plan(PlanRequest((t,), OPTS, layouts=False, use_ray=False, quality="fast",
                         tiers={"tiny-flux2": {"lossless": QualityTierSpec()}}))


def test_verify_counts_the_cached_outputs() -> None:
    """``xema verify`` runs a step-cached entry's worker with the cache's buffers (meta device)."""
    from xema_ray.measure.verify import verify_config

    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=20)
    plain = verify_config(ExecutionConfig(template=t), budget_bytes=2**30)
    fast = verify_config(ExecutionConfig(template=t, step_cache=DEFAULT_TIERS["fast"].cache), budget_bytes=2**30)
    assert plain.error is None and fast.error is None
    assert 0 < fast.device_peak_bytes - plain.device_peak_bytes <= cache_bytes(_entry(t)) + 512
