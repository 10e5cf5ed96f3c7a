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


def test_a_reused_step_is_priced_at_the_share_the_entry_carries() -> None:
    """A reused step still pays the loop's work outside the denoiser: with a known share the fast
    tier saves ``(1 - share)`` of a step per skipped step, and the steps it lists carry the
    pricing (``/v1/templates`` hands them to a client that carries the ratio to other step counts)."""
    e = _entry(FLUX)  # 10 s, 50 steps
    computed = DEFAULT_TIERS["fast"].cache.computed_steps(50)  # type: ignore[union-attr]
    with_share = e.model_copy(update={"prediction": e.prediction.model_copy(update={"reused_step_share": 0.25})})
    table = PlanTable(hardware="cpu:test", gpus=1, budget_bytes=2**30, entries={FLUX.shape_key: with_share})
    fast = price_tiers(table).entries[FLUX.shape_key].tiers["fast"]
    step = 10.0 * 0.95 / 50  # no profile for "cpu:test": 5 % decode for an image
    assert fast.step_s == pytest.approx(step) and fast.reused_step_s == pytest.approx(0.25 * step)
    assert fast.latency_s == pytest.approx(10.0 - (50 - computed) * 0.75 * step)
    # a table planned before the share was recorded, on hardware without a profile: priced as then
    old = price_tiers(table.model_copy(update={"entries": {FLUX.shape_key: e}})).entries[FLUX.shape_key]
    assert old.tiers["fast"].latency_s == pytest.approx(10.0 - (50 - computed) * step)
    assert old.tiers["fast"].latency_s < fast.latency_s


def test_an_old_table_on_hardware_with_a_profile_takes_the_cost_models_share() -> None:
    """No recorded share, a table for the A6000 box: the cost model's reused step (scheduler update,
    copy of the cached outputs, their launches) — a sliver of a real model's step, more of a tiny one's."""
    from xema_ray.profiling import A6000_8X
    from xema_ray.profiling.costmodel import reused_step_share

    real = RequestTemplate(model="flux2", height=1024, width=1024, steps=50)
    table = PlanTable(hardware=f"1x {A6000_8X.name}", gpus=1, budget_bytes=2**30,
                      entries={k.shape_key: _entry(k) for k in (real, FLUX)})
    priced = price_tiers(table).entries
    for t in (real, FLUX):
        share = reused_step_share(ExecutionConfig(template=t), A6000_8X)
        fast = priced[t.shape_key].tiers["fast"]
        assert fast.reused_step_s == pytest.approx(share * fast.step_s)
    assert reused_step_share(ExecutionConfig(template=real), A6000_8X) < 1e-3
    assert 1e-3 < reused_step_share(ExecutionConfig(template=FLUX), A6000_8X) < 1.0
