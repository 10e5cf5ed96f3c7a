"""The load metrics a router or an autoscaler reads (``load_metrics.py``), without Ray: the
predicted queue wait from the dispatcher's own replay, the attainment window, per-worker memory
headroom, seconds per step and the video realtime factor. The figures on the live Prometheus
endpoint: tests/serving/test_app.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.scenarios.factories import plan_entry
from xema_ray.platforms.base import MemoryStats
from xema_ray.runtime.engine import BatchResult, PhaseTimings
from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.serving.frame_rate import video_fps
from xema_ray.serving.group.load_metrics import GroupLoad, LoadMetrics, SloWindow, realtime_factor
from xema_ray.serving.group.load_metrics import KeptGauge
from xema_ray.serving.scale.replica_summary import summarize
from xema_ray.templates import RequestTemplate

IMG = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=4)
VID = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=4)
BUDGET = 96 * 10**6


class _Recorded:
    """Stands in for one Ray gauge: every value set, by its tags."""

    def __init__(self) -> None:
        self.values: dict[tuple[tuple[str, str], ...], list[float]] = {}

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values.setdefault(tuple(sorted((tags or {}).items())), []).append(value)

    def last(self, **tags: str) -> float:
        return self.values[tuple(sorted(tags.items()))][-1]


@pytest.fixture
def load() -> Iterator[LoadMetrics]:
    entries = {IMG.shape_key: plan_entry(IMG, batch=2, latency_s=2.0, peak_bytes=60 * 10**6),
               VID.shape_key: plan_entry(VID, ulysses=2, latency_s=4.0, peak_bytes=80 * 10**6)}
    m = LoadMetrics("tiny-flux2", lambda: (entries, BUDGET), window_s=10.0, window_requests=4)
    for name, value in vars(m).items():
        if isinstance(value, KeptGauge):
            setattr(m, name, _Recorded())
    m.set_plans(entries, BUDGET)
    yield m


def _dispatcher(load: LoadMetrics) -> Dispatcher:
    plans = {k: DispatchPlan.of_entry(e) for k, e in load._entries.items()}
    return Dispatcher(plans, workers=2, wait_window_s=0.5, max_queue=64)


def test_predicted_wait_is_the_replay_of_the_queue_and_rises_with_it(load: LoadMetrics) -> None:
    d = _dispatcher(load)
    waits = []
    for queued in (0, 2, 6, 12):
        while d.queue_depth(IMG.shape_key) < queued:
            d.submit(IMG.shape_key, f"r{d.queue_depth()}", now=90.0, key=BatchKey(steps=d.plans[IMG.shape_key].steps))  # earlier deadlines than a new request's
        load.refresh(summarize(d, "replica", now=100.0, wall=5000.0), now=100.0)
        waits.append(load.queue_wait.last(template=IMG.shape_key))
    # idle: a lone request waits the window for its batch of 2 to fill; then a batch of 2 s per
    # two requests ahead on each of the two workers (the dispatcher's replay, not a count)
    assert waits[0] == pytest.approx(0.5)
    assert waits[1] < waits[2] < waits[3]
    assert waits[3] == pytest.approx(2.0 * 12 / 2 / 2, rel=0.15)
    assert load.completion.last(template=IMG.shape_key) > waits[3]
    # a video arriving now (its deadline after theirs) needs both workers: it waits for the whole queue
    assert load.queue_wait.last(template=VID.shape_key) == pytest.approx(waits[3])
    assert 0 <= load.predicted_attainment.last() <= 1


def test_attainment_is_over_the_window_not_since_start(load: LoadMetrics) -> None:
    d = _dispatcher(load)
    for i, met in enumerate([False, False, True, True, True, True]):
        load.observe_request(IMG.shape_key, met, now=float(i))
    load.refresh(summarize(d, "r", now=6.0, wall=0.0), now=6.0)
    assert load.attainment.last(template=IMG.shape_key) == 1.0  # the last 4 requests (window_requests)
    assert load.window_requests.last(template=IMG.shape_key) == 4
    load.observe_request(IMG.shape_key, False, now=7.0)
    load.refresh(summarize(d, "r", now=7.0, wall=0.0), now=7.0)
    assert load.attainment.last(template=IMG.shape_key) == 0.75
    load.refresh(summarize(d, "r", now=30.0, wall=0.0), now=30.0)  # all aged out of the 10 s window
    assert load.window_requests.last(template=IMG.shape_key) == 0
    assert load.attainment.last(template=VID.shape_key) == 1.0  # nothing finished: nothing missed


def _result(rank: int, peak: int, current: int, denoise_s: float, total_s: float) -> BatchResult:
    return BatchResult(template="x", config_hash="h", sp_rank=rank, outputs=[],
                       timings=PhaseTimings(text_s=0.0, denoise_s=denoise_s, decode_s=0.5, encode_s=0.1, total_s=total_s),
                       memory=MemoryStats(source="test", peak_bytes=peak, current_bytes=current),
                       mitigations=0, layout_armed=False)


def test_memory_headroom_per_worker_step_seconds_and_realtime_factor(load: LoadMetrics) -> None:
    results = [_result(0, 70 * 10**6, 20 * 10**6, 2.0, 3.0), _result(1, 100 * 10**6, 30 * 10**6, 2.0, 3.0)]
    load.observe_batch(VID.shape_key, (2, 3), results, requests=1, batch_seconds=4.0,
                       steps=VID.steps)  # ranks 0, 1 on workers 2, 3
    assert load.peak.last(worker="3") == 100 * 10**6 and load.in_use.last(worker="2") == 20 * 10**6
    assert load.headroom.last(worker="2") == BUDGET - 70 * 10**6
    assert load.headroom.last(worker="3") == BUDGET - 100 * 10**6 < 0  # over the budget: said, not hidden
    assert load.budget.last() == BUDGET and load.plan_peak.last(template=VID.shape_key) == 80 * 10**6
    assert load.step_seconds.last(template=VID.shape_key) == pytest.approx(2.0 / VID.steps)
    assert load.realtime.last(template=VID.shape_key) == pytest.approx((VID.frames - 1) / video_fps(VID) / 4.0)
    load.observe_batch(IMG.shape_key, (0,), [_result(0, 50 * 10**6, 10**6, 1.0, 1.5)], requests=2, batch_seconds=1.5,
                       steps=IMG.steps)
    assert IMG.shape_key not in {dict(k).get("template") for k in load.realtime.values}  # images have none
    load.set_plans(load._entries, 200 * 10**6)  # a new plan table with a larger budget: headroom follows
    assert load.headroom.last(worker="3") == 100 * 10**6


def test_the_snapshot_carries_the_gauges_figures(load: LoadMetrics) -> None:
    entries = load._entries
    kept = LoadMetrics("tiny-cogvideox", lambda: (entries, BUDGET))  # real gauges: the snapshot reads what they hold
    kept.observe_batch(VID.shape_key, (0, 1), [_result(0, 70 * 10**6, 10**6, 2.0, 3.0),
                                               _result(1, 80 * 10**6, 10**6, 2.0, 3.0)], requests=1, batch_seconds=4.0,
                       steps=VID.steps)
    d = _dispatcher(kept)
    d.submit(VID.shape_key, "v1", now=0.0, key=BatchKey(steps=d.plans[VID.shape_key].steps))
    kept.refresh(summarize(d, "r", now=0.0, wall=0.0), now=0.0)
    snap = GroupLoad.model_validate_json(kept.snapshot().model_dump_json())  # crosses to the Router as JSON
    assert snap.budget_bytes == BUDGET and snap.workers[1].headroom_bytes == BUDGET - 80 * 10**6
    v = snap.templates[VID.shape_key]
    assert v.predicted_queue_wait_s == 4.0  # one video ahead, 4 s planned, both workers
    assert v.step_seconds == pytest.approx(0.5) and v.plan_peak_bytes == 80 * 10**6 and v.video_realtime_factor
    assert snap.templates[IMG.shape_key].video_realtime_factor is None and 0 <= (snap.predicted_attainment or 0) <= 1


def test_error_raised_if_window_or_batch_seconds_are_not_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        SloWindow(window_s=0)
    with pytest.raises(ValueError, match="batch_seconds"):
        realtime_factor(1.0, 1, 0.0)


def test_a_kept_gauge_sends_its_last_values_again() -> None:
    g = KeptGauge("xema_test_kept", "a test gauge", ("template", "model"), {"model": "m"})
    sent = _Recorded()
    g._gauge = sent  # type: ignore[assignment]  # what reaches Ray's gauge
    g.set(1.0, tags={"template": "a"})
    g.set(2.0, tags={"template": "b"})
    g.set(3.0, tags={"template": "a"})
    g.republish()
    assert sent.values == {(("template", "a"),): [1.0, 3.0, 3.0], (("template", "b"),): [2.0, 2.0]}
