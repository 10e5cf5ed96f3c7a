"""The two defects that kept step-level preemption from firing (issue 30, item 8), pinned on the
Dispatcher: a running batch that has lost its deadline already may be paused for one that can
still meet its own, and the wait for a victim's next step boundary comes from its step time, not
from its whole latency (decode tail included) spread over its steps; a victim in its decode tail
has no boundary left and is not paused."""

from __future__ import annotations

from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.scheduling.preemption_policy import PreemptionPolicy

GB = 10**9
SHORT = DispatchPlan(batch=1, sp=1, slo_s=20, latency_s=5, steps=5, peak_bytes=10 * GB, pause_bytes=1 * GB)


def _run(long: DispatchPlan, short_at: float, short: DispatchPlan = SHORT,
         phases: tuple[float, float] | None = None) -> tuple[Dispatcher[None], list]:
    d: Dispatcher[None] = Dispatcher({"long": long, "short": short}, workers=1, wait_window_s=0,
                                     preemption=PreemptionPolicy(budget_bytes=48 * GB))
    if phases is not None:
        d.set_phases("long", *phases)
    d.submit("long", "L", 0.0, key=BatchKey(steps=d.plans["long"].steps))
    assert [a.template for a in d.dispatch(0.0)] == ["long"]
    d.submit("short", "S", short_at, key=BatchKey(steps=d.plans["short"].steps))
    return d, d.dispatch(short_at)


def test_a_batch_that_lost_its_deadline_already_is_paused_for_one_that_can_still_meet_its_own() -> None:
    late = DispatchPlan(batch=1, sp=1, slo_s=20, latency_s=100, steps=10, peak_bytes=10 * GB, pause_bytes=2 * GB)
    d, started = _run(late, short_at=30.0)  # L's deadline (20) passed; S's is 50, waiting ends at 105
    assert [a.template for a in started] == ["short"] and started[0].preempts[0].batch_id == 0
    assert [x.kind for x in d.decisions] == ["preempt"]


def test_a_batch_still_on_time_and_more_urgent_is_not_paused() -> None:
    urgent = DispatchPlan(batch=1, sp=1, slo_s=40, latency_s=30, steps=10, peak_bytes=10 * GB, pause_bytes=2 * GB)
    d, started = _run(urgent, short_at=10.0, short=DispatchPlan(batch=1, sp=1, slo_s=31, latency_s=5, steps=5,
                                                              peak_bytes=10 * GB, pause_bytes=GB))
    assert started == [] and not d.decisions  # L ends at 30 <= 40, S's deadline 41 > L's: EDF keeps L


def test_the_wait_for_a_step_boundary_leaves_out_the_decode_tail() -> None:
    # 4 steps of 5 s, then an 80 s decode: at t=2 the next boundary is 3 s away (not 100/4 = 25 s),
    # so a short request due at 14 (2 + 3 + 5 <= 14) meets its deadline only by preempting
    long = DispatchPlan(batch=1, sp=1, slo_s=1000, latency_s=100, steps=4, peak_bytes=10 * GB, pause_bytes=2 * GB)
    short = DispatchPlan(batch=1, sp=1, slo_s=12, latency_s=5, steps=5, peak_bytes=10 * GB, pause_bytes=GB)
    d, started = _run(long, short_at=2.0, short=short, phases=(0.2, 0.8))
    assert [a.template for a in started] == ["short"] and [x.kind for x in d.decisions] == ["preempt"]
    d, started = _run(long, short_at=2.0, short=short)  # phases unknown: the old even spread, which misses
    assert started == [] and not d.decisions


def test_a_batch_in_its_decode_tail_is_not_paused() -> None:
    long = DispatchPlan(batch=1, sp=1, slo_s=1000, latency_s=100, steps=4, peak_bytes=10 * GB, pause_bytes=2 * GB)
    d, started = _run(long, short_at=25.0, phases=(0.2, 0.8))  # its 4 steps ended at 20
    assert started == [] and not d.decisions
