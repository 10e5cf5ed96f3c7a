from __future__ import annotations

import pytest

from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher


def plans(**kw) -> dict[str, DispatchPlan]:  # type: ignore[no-untyped-def]
    return {k: DispatchPlan(**v) for k, v in kw.items()}


def test_batches_fill_up_to_the_plan_batch() -> None:
    d: Dispatcher[None] = Dispatcher(plans(a={"batch": 2, "sp": 1, "slo_s": 10, "latency_s": 1}), workers=1, wait_window_s=1.0)
    d.submit("a", "r1", now=0.0, key=BatchKey(steps=d.plans["a"].steps))
    assert d.dispatch(now=0.1) == []  # waits for a second request within the window
    d.submit("a", "r2", now=0.2, key=BatchKey(steps=d.plans["a"].steps))
    (a,) = d.dispatch(now=0.2)
    assert [r.request_id for r in a.requests] == ["r1", "r2"] and a.workers == (0,)


def test_partial_batch_runs_after_the_wait_window() -> None:
    d: Dispatcher[None] = Dispatcher(plans(a={"batch": 4, "sp": 1, "slo_s": 10, "latency_s": 1}), workers=1, wait_window_s=0.5)
    d.submit("a", "r1", now=0.0, key=BatchKey(steps=d.plans["a"].steps))
    assert d.next_wakeup(0.0) == 0.5
    assert d.dispatch(now=0.4) == []
    (a,) = d.dispatch(now=0.5)
    assert len(a.requests) == 1


def test_a_ready_batch_waiting_for_workers_gets_no_wake_up_time() -> None:
    # it starts on the next event (a batch ends): a wake-up time in the past had the live
    # dispatch loop asking again at once, spinning on the replica's event loop while it waited
    d: Dispatcher[None] = Dispatcher(plans(a={"batch": 4, "sp": 1, "slo_s": 10, "latency_s": 1}), workers=1, wait_window_s=0.5)
    d.submit("a", "r1", now=0.0, key=BatchKey(steps=d.plans["a"].steps))
    (first,) = d.dispatch(now=0.5)
    d.submit("a", "r2", now=0.6, key=BatchKey(steps=d.plans["a"].steps))
    assert d.next_wakeup(0.6) == 1.1  # still inside its window: woken when the window ends
    assert d.dispatch(now=1.1) == [] and d.next_wakeup(1.1) is None  # ready, no free worker
    d.complete(first.batch_id)
    (a,) = d.dispatch(now=1.5)
    assert [r.request_id for r in a.requests] == ["r2"]


def test_sp_groups_are_aligned_and_dp_runs_groups_concurrently() -> None:
    d: Dispatcher[None] = Dispatcher(plans(a={"batch": 1, "sp": 2, "slo_s": 10, "latency_s": 1}), workers=4, wait_window_s=0)
    for i in range(3):
        d.submit("a", f"r{i}", now=0.0, key=BatchKey(steps=d.plans["a"].steps))
    started = d.dispatch(now=0.0)
    assert [s.workers for s in started] == [(0, 1), (2, 3)]  # DP = 2 groups of SP 2
    assert d.queue_depth("a") == 1
    d.complete(started[1].batch_id)
    (nxt,) = d.dispatch(now=1.0)
    assert nxt.workers == (2, 3)


def test_earliest_deadline_first_across_templates() -> None:
    d: Dispatcher[None] = Dispatcher(
        plans(slow={"batch": 1, "sp": 1, "slo_s": 100, "latency_s": 1}, fast={"batch": 1, "sp": 1, "slo_s": 5, "latency_s": 1}),
        workers=1, wait_window_s=0)
    d.submit("slow", "s", now=0.0, key=BatchKey(steps=d.plans["slow"].steps))
    d.submit("fast", "f", now=1.0, key=BatchKey(steps=d.plans["fast"].steps))  # arrives later but its deadline (6) is earlier than 100
    (a,) = d.dispatch(now=1.0)
    assert a.requests[0].request_id == "f"


def test_requeue_keeps_deadlines_and_overflow_refuses() -> None:
    d: Dispatcher[None] = Dispatcher(plans(a={"batch": 1, "sp": 1, "slo_s": 10, "latency_s": 1}), workers=1, wait_window_s=0, max_queue=1)
    d.submit("a", "r1", now=0.0, key=BatchKey(steps=d.plans["a"].steps))
    (a,) = d.dispatch(now=0.0)
    d.complete(a.batch_id)
    d.requeue(a)
    assert d.queue_depth() == 1
    with pytest.raises(OverflowError):
        d.submit("a", "r2", now=0.0, key=BatchKey(steps=d.plans["a"].steps))
    with pytest.raises(KeyError):
        d.submit("nope", "r3", now=0.0, key=BatchKey(steps=1))


def test_error_raised_if_plan_needs_more_workers_than_the_group() -> None:
    with pytest.raises(ValueError, match="SP 4"):
        Dispatcher(plans(a={"batch": 1, "sp": 4, "slo_s": 1, "latency_s": 1}), workers=2)


def test_cancel_removes_only_a_queued_request() -> None:
    d: Dispatcher[None] = Dispatcher({"t": DispatchPlan(batch=1, sp=1, slo_s=10, latency_s=1)}, workers=1)
    for r in ("r1", "r2", "r3"):
        d.submit("t", r, now=0.0, key=BatchKey(steps=d.plans["t"].steps))
    [running] = d.dispatch(now=0.0)
    assert not d.cancel(running.requests[0].request_id)  # running: the step hook stops it, not the queue
    assert d.cancel("r2") and not d.cancel("r2")
    d.complete(running.batch_id)
    assert [a.requests[0].request_id for a in d.dispatch(now=0.0)] == ["r3"]


def test_requests_of_different_step_counts_batch_apart_with_scaled_latency_and_deadline() -> None:
    """Steps are a request option: one batch runs one step count (the dispatcher's rule, live and
    in the simulator), its predicted latency and SLO scaled by the steps (memory is not)."""
    plan = DispatchPlan(batch=4, sp=1, slo_s=20.0, latency_s=10.0, steps=10, denoise_frac=0.8, decode_encode_frac=0.2)
    d: Dispatcher[None] = Dispatcher({"t": plan}, workers=2, wait_window_s=0.0)
    for i, steps in enumerate([10, 50, 10, 50, 10]):
        d.submit("t", f"r{i}", now=0.0, key=BatchKey(steps=steps))
    a, b = d.dispatch(now=0.0)
    assert [r.request_id for r in a.requests] == ["r0", "r2", "r4"]  # the plan's own 10 steps
    assert [r.request_id for r in b.requests] == ["r1", "r3"] and b.plan.steps == 50
    assert b.plan.latency_s == pytest.approx(10.0 * (0.2 + 0.8 * 5)) and b.plan.slo_s == pytest.approx(20.0 * 4.2)
    assert b.requests[0].deadline == pytest.approx(20.0 * 4.2) and a.plan is plan
    assert b.plan.peak_bytes == plan.peak_bytes


def test_late_requests_start_in_batches_of_one_step_count() -> None:
    from xema_ray.plan import AdmissionPolicy

    plan = DispatchPlan(batch=4, sp=1, slo_s=1.0, latency_s=10.0, steps=10)  # every request is late at once
    d: Dispatcher[None] = Dispatcher({"t": plan}, workers=2, wait_window_s=0.0,
                                     admission=AdmissionPolicy(late="deprioritise"))
    for i, steps in enumerate([10, 20, 10, 20]):
        d.submit("t", f"r{i}", now=0.0, key=BatchKey(steps=steps))
    batches = {tuple(r.request_id for r in a.requests): a.plan.steps for a in d.dispatch(now=0.5)}
    assert batches == {("r0", "r2"): 10, ("r1", "r3"): 20}
