"""One batch key, one price (``xema_ray.scheduling.batch_key``): what a batch may mix under each
policy, and what the dispatcher, the simulator and a replica's replay charge for it."""

from __future__ import annotations

import pytest

from bench.scenarios.factories import plan_entry, plan_table
from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.serving.scale.replica_summary import predict_wait, summarize
from xema_ray.sim.simulate import Arrival, SimulationConfig, simulate
from xema_ray.templates import RequestTemplate

PLAN = DispatchPlan(batch=4, sp=1, slo_s=100.0, latency_s=4.0, steps=10, min_latency_s=1.5,
                    latency_by_batch=((1, 1.5), (2, 2.5), (3, 3.2)))
GUIDANCE = (None, 2.5, 3.5, 5.0)


def _key(g: float | None, steps: int = 10, quality: str = "lossless") -> BatchKey:
    return BatchKey(steps=steps, guidance=(g, None), quality=quality)


def _dispatcher(batching: str, workers: int = 1) -> Dispatcher[None]:
    return Dispatcher({"t": PLAN}, workers=workers, wait_window_s=0.0, batching=batching)  # type: ignore[arg-type]


def test_the_key_keeps_the_quality_field_the_tiers_fill() -> None:
    assert BatchKey(steps=1).quality == "lossless"
    assert _key(None, quality="fast") != _key(None)


@pytest.mark.parametrize(("other", "by_key", "mixed"), [
    (_key(None), True, True), (_key(3.5), False, True), (_key(None, steps=20), False, False),
    (_key(None, quality="fast"), False, False)])
def test_what_joins_a_batch_under_each_policy(other: BatchKey, by_key: bool, mixed: bool) -> None:
    assert (_key(None).joins(other, "by_key"), _key(None).joins(other, "mixed")) == (by_key, mixed)


def test_a_batch_is_priced_as_its_sub_batches_run_from_the_plans_latency_by_batch() -> None:
    assert PLAN.batch_seconds([_key(g) for g in GUIDANCE]) == pytest.approx(4 * 1.5)  # four calls of one
    assert PLAN.batch_seconds([_key(None)] * 4) == pytest.approx(4.0)  # one call of four
    assert PLAN.batch_seconds([_key(None), _key(None), _key(3.5)]) == pytest.approx(2.5 + 1.5)
    # at another step count each call scales as the plan's does (DispatchPlan.for_steps)
    assert PLAN.batch_seconds([_key(None, steps=20)]) == pytest.approx(PLAN.for_steps(20).latency_for(1))


def test_mixed_takes_every_guidance_into_one_batch_and_counts_its_sub_batches() -> None:
    d = _dispatcher("mixed")
    for i, g in enumerate(GUIDANCE):
        d.submit("t", f"r{i}", now=0.0, key=_key(g))
    (a,) = d.dispatch(now=0.0)
    assert len(a.requests) == 4 and a.run_s == pytest.approx(6.0)
    assert d.remaining_s(a.batch_id, now=1.0) == pytest.approx(5.0)  # the four calls, less what it ran


def test_by_key_batches_one_key_and_leaves_the_others_queued() -> None:
    d = _dispatcher("by_key", workers=2)
    for i, g in enumerate((None, 3.5, None, None, 3.5)):
        d.submit("t", f"r{i}", now=0.0, key=_key(g))
    first, second = d.dispatch(now=0.0)
    assert [r.request_id for r in first.requests] == ["r0", "r2", "r3"]
    assert [r.request_id for r in second.requests] == ["r1", "r4"]
    assert first.run_s == pytest.approx(3.2) and second.run_s == pytest.approx(2.5)


def test_a_dispatcher_refuses_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="batching"):
        _dispatcher("sometimes")


@pytest.mark.parametrize(("batching", "done_at"), [("mixed", 6.0), ("by_key", 6.0)])
def test_the_simulator_runs_a_mixed_batch_as_its_sub_batches(batching: str, done_at: float) -> None:
    t = RequestTemplate(model="flux2", width=256, height=256, steps=10)
    e = plan_entry(t, batch=4, latency_s=4.0, slo_s=100.0, latency_by_batch={1: 1.5, 2: 2.5, 3: 3.2})
    arrivals = [Arrival(t=0.0, template=t.shape_key, request_id=f"r{i}", guidance_scale=g) for i, g in enumerate(GUIDANCE)]
    res = simulate(plan_table([e]), arrivals, SimulationConfig(batching=batching, wait_window_s=0.0))  # type: ignore[arg-type]
    # one worker: four calls of one, one after the other, in one batch (mixed) or four (by_key)
    assert max(res.latency_by_request.values()) == pytest.approx(done_at)


def test_the_replay_batches_and_prices_queued_keys_as_the_dispatcher() -> None:
    for batching, want in (("mixed", 6.0 + 6.0), ("by_key", 1.5 + 3 * 1.5)):
        d = _dispatcher(batching)
        for i, g in enumerate(GUIDANCE):  # a running batch (mixed: one of four calls; by_key: one call of one)
            d.submit("t", f"a{i}", now=0.0, key=_key(g))
        d.dispatch(now=0.0)
        if batching == "mixed":
            for i, g in enumerate(GUIDANCE):  # four more queued behind it
                d.submit("t", f"b{i}", now=0.0, key=_key(g))
        s = summarize(d, "r", now=0.0, wall=0.0)
        assert s.batching == batching
        # mixed: the running batch (4 calls, 6 s) then the queued one (4 calls, 6 s); by_key: the
        # running call of one (1.5 s) then the three queued keys, one call each
        assert predict_wait(s, "t", now=0.0) == pytest.approx(want)


@pytest.mark.parametrize(("batching", "members", "held"), [("mixed", 4, 4.0 + 6.0 - 4.0), ("by_key", 1, 4.0)])
def test_the_next_batch_is_priced_before_it_starts(batching: str, members: int, held: float) -> None:
    """What preemption and a late partial batch weigh: the batch the queue would start now, priced."""
    d = _dispatcher(batching)
    for i, g in enumerate(GUIDANCE):
        d.submit("t", f"r{i}", now=0.0, key=_key(g))
    nxt = d.state.next_batch("t")
    assert len(nxt) == members and d.queue_depth("t") == 4  # nothing popped
    assert PLAN.held_s([r.key for r in nxt]) == pytest.approx(held)
