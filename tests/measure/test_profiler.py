"""The segment-reuse latency profiler on a tiny model (CPU): it measures only a short calibration
request, reuses measurements by operator pattern and from its on-disk store, and its estimate
tracks the measured latency (tightly in bench/bench_profiler.py; loosely here, CI is noisy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import ExecutionConfig
from xema_ray.profiling import H200, ProfileStore, estimate_latency
from xema_ray.measure.profiler import LatencyProfiler
from xema_ray.runtime import ExecutionEngine
from xema_ray.templates import RequestTemplate

TEMPLATE = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=12)


@pytest.fixture(scope="module")
def engine() -> ExecutionEngine:
    spec = get_model_spec("tiny-flux2")
    return ExecutionEngine(spec.build_pipeline(BuildOptions()), spec, torch.device("cpu"), torch.float32)


def test_profile_reuses_patterns_and_store(engine: ExecutionEngine, tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    store = ProfileStore(path)
    profiler = LatencyProfiler(engine, store)
    config = ExecutionConfig(template=TEMPLATE)
    first = profiler.profile(config)
    assert first.calibration_steps == 3 and first.signatures_measured == first.signatures > 0
    # identical blocks and steady steps share patterns: far fewer segments run than estimated
    assert first.segments_profiled * 2 < first.segments_estimated
    assert first.signatures < first.segments_estimated / 5
    store.save()

    # a fresh store from the same file: same shape with more steps profiles nothing new
    again = LatencyProfiler(engine, ProfileStore(path)).profile(ExecutionConfig(template=TEMPLATE.with_(steps=24)))
    assert again.calibration_steps == 0 and again.segments_profiled == 0 and again.signatures_measured == 0
    assert again.signatures_reused == again.signatures
    assert again.per_phase["denoise"] > first.per_phase["denoise"] * 1.5

    # another batch size is another execution shape: measured anew
    batched = profiler.profile(ExecutionConfig(template=TEMPLATE, batch=2))
    assert batched.signatures_measured > 0


def test_estimate_tracks_measurement(engine: ExecutionEngine) -> None:
    # one intra-op thread: on a shared 2-core box, a descheduled worker thread stalls whole
    # parallel regions and makes any single timing meaningless
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _estimate_tracks_measurement(engine)
    finally:
        torch.set_num_threads(threads)


def _estimate_tracks_measurement(engine: ExecutionEngine) -> None:
    store = ProfileStore()
    profiler = LatencyProfiler(engine, store)
    config = ExecutionConfig(template=TEMPLATE)
    profiler.measure(config)  # warm-up
    report = profiler.profile(config)
    measured = profiler.measure(config, repeats=3)
    # a smoke bound: CI shares its cores; bench/bench_profiler.py shows the 15% agreement
    assert report.estimate_s == pytest.approx(measured.total_s, rel=1.0)

    hw = H200.model_copy(update={"fingerprint": profiler.fingerprint})
    assert estimate_latency(config, hw, store).source == "measured"
    other = ExecutionConfig(template=TEMPLATE.with_(steps=20))
    profiler.profile(other)
    est = estimate_latency(other, hw, store)
    assert est.source == "profiled" and est.total_s == pytest.approx(sum(est.per_phase.values()))


def test_error_raised_if_store_schema_differs(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text('{"schema_version": 0, "segments": [], "requests": []}')
    with pytest.raises(ValueError, match="schema version 0"):
        ProfileStore(path)


def test_measure_reuse_records_what_a_reused_step_costs(engine: ExecutionEngine) -> None:
    """The lossless request and the same with every step after the first reused, interleaved: the
    reused step is cheaper than a computed one but not free (the scheduler and the loop still run),
    and the planner's ``LatencyModel`` reads the same share from the store."""
    from planner.latency import LatencyModel
    from xema_ray.measure.profiler import REUSE_ALL, reused_step_share

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as test_estimate_tracks_measurement: one thread on a shared box
    try:
        store = ProfileStore()
        profiler = LatencyProfiler(engine, store)
        config = ExecutionConfig(template=TEMPLATE)
        lossless, reused = profiler.measure_reuse(config, repeats=3)
    finally:
        torch.set_num_threads(threads)
    assert reused.config is not None and reused.config.step_cache == REUSE_ALL
    assert lossless.config == config and reused.config_hash != lossless.config_hash
    assert reused.per_phase["denoise"] < lossless.per_phase["denoise"]
    share = reused_step_share(lossless, reused, computed=1)
    assert 0.0 < share < 0.9
    latency = LatencyModel("cpu", store=store)
    latency.hardware = latency.hardware.model_copy(update={"fingerprint": profiler.fingerprint})
    assert latency.reused_step_share(ExecutionConfig(template=TEMPLATE, batch=2)) == share
