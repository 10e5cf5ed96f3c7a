"""SLO-aware dispatch (``AdmissionPolicy``) and the partial-batch wake-up, in the shared Dispatcher."""

from __future__ import annotations

import pytest

from bench.scenarios.factories import plan_entry, plan_table
from xema_ray.plan import AdmissionPolicy
from xema_ray.scheduling.admission import Refused
from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.sim.simulate import Arrival, SimulationConfig, simulate
from xema_ray.templates import RequestTemplate

ONE = DispatchPlan(batch=1, sp=1, slo_s=12, latency_s=10)


def test_a_partial_batch_starts_at_the_wake_up_time_next_wakeup_gives() -> None:
    # 8280.27210522334 + 0.05 - 8280.27210522334 < 0.05 in floating point: the batch must still start
    d: Dispatcher[None] = Dispatcher({"a": DispatchPlan(batch=2, sp=1, slo_s=100, latency_s=10)}, workers=1)
    d.submit("a", "r1", now=8280.27210522334, key=BatchKey(steps=d.plans["a"].steps))
    wake = d.next_wakeup(8280.27210522334)
    assert wake is not None and wake - 8280.27210522334 < 0.05
    (a,) = d.dispatch(now=wake)
    assert [r.request_id for r in a.requests] == ["r1"]


def test_a_partial_batch_starts_at_once_when_waiting_would_make_it_miss() -> None:
    slow = {"a": DispatchPlan(batch=2, sp=1, slo_s=10, latency_s=8)}
    plain: Dispatcher[None] = Dispatcher(slow, workers=1, wait_window_s=5.0)
    plain.submit("a", "r1", now=0.0, key=BatchKey(steps=plain.plans["a"].steps))
    assert plain.dispatch(now=0.0) == []  # waits up to 5 s for a second request: 0 + 5 + 8 > 10
    aware: Dispatcher[None] = Dispatcher(slow, workers=1, wait_window_s=5.0, admission=AdmissionPolicy())
    aware.submit("a", "r1", now=0.0, key=BatchKey(steps=aware.plans["a"].steps))
    (a,) = aware.dispatch(now=0.0)
    assert len(a.requests) == 1


def _late_scenario(late: str) -> tuple[Dispatcher[None], list[str]]:
    """One worker: r1 runs 0-10; r2 (deadline 13) can no longer make it at 10; r3 (deadline 21.5) can."""
    d: Dispatcher[None] = Dispatcher({"a": ONE}, workers=1, admission=AdmissionPolicy(late=late))  # type: ignore[arg-type]
    d.submit("a", "r1", now=0.0, key=BatchKey(steps=d.plans["a"].steps))
    (first,) = d.dispatch(now=0.0)
    d.submit("a", "r2", now=1.0, key=BatchKey(steps=d.plans["a"].steps))
    d.submit("a", "r3", now=9.5, key=BatchKey(steps=d.plans["a"].steps))
    assert d.dispatch(now=9.5) == []
    d.complete(first.batch_id)
    order = []
    t = 10.0
    while started := d.dispatch(now=t):
        (a,) = started
        order += [r.request_id for r in a.requests]
        d.complete(a.batch_id)
        t += 10
    return d, order


def test_serve_keeps_deadline_order() -> None:
    d, order = _late_scenario("serve")
    assert order == ["r2", "r3"]  # r2 misses anyway and makes r3 miss too
    assert d.take_shed() == []


def test_deprioritise_serves_the_request_that_can_still_make_it_first() -> None:
    d, order = _late_scenario("deprioritise")
    assert order == ["r3", "r2"]
    assert d.take_shed() == [] and d.shed_total == 0


def test_shed_drops_the_late_request_when_another_waits() -> None:
    d, order = _late_scenario("shed")
    assert order == ["r3"]
    assert [r.request_id for r in d.take_shed()] == ["r2"] and d.take_shed() == []
    assert d.shed_total == 1 and d.queue_depth() == 0


def test_shed_keeps_a_late_request_when_nothing_else_waits() -> None:
    d: Dispatcher[None] = Dispatcher({"a": ONE}, workers=1, admission=AdmissionPolicy(late="shed"))
    d.submit("a", "r1", now=0.0, key=BatchKey(steps=d.plans["a"].steps))
    (first,) = d.dispatch(now=0.0)
    d.submit("a", "r2", now=1.0, key=BatchKey(steps=d.plans["a"].steps))
    d.complete(first.batch_id)
    (a,) = d.dispatch(now=10.0)  # late, but it holds no one up
    assert [r.request_id for r in a.requests] == ["r2"] and d.take_shed() == []


def test_refused_templates_are_refused_at_submit_as_overflow() -> None:
    d: Dispatcher[None] = Dispatcher({"a": ONE, "b": ONE}, workers=1, admission=AdmissionPolicy(refused=("b",)))
    with pytest.raises(Refused, match="not admitted") as e:
        d.submit("b", "r1", now=0.0, key=BatchKey(steps=d.plans["b"].steps))
    assert isinstance(e.value, OverflowError)  # the live group answers it as a full queue: 503 + Retry-After
    d.submit("a", "r2", now=0.0, key=BatchKey(steps=d.plans["a"].steps))
    assert d.queue_depth() == 1


def test_the_simulator_counts_shed_and_refused_requests_as_missed() -> None:
    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=4)
    u = t.with_(height=128, width=128)
    table = plan_table([plan_entry(x, peak_bytes=1, latency_s=10, goodput_rps=0.1, slo_s=12, latency_source="estimated")
                        for x in (t, u)], hardware="cpu:1",
                       admission={"tiny-flux2": AdmissionPolicy(late="shed", refused=(u.shape_key,))})
    arrivals = [Arrival(t=0.0, template=t.shape_key, request_id="r1"), Arrival(t=1.0, template=t.shape_key, request_id="r2"),
                Arrival(t=9.5, template=t.shape_key, request_id="r3"), Arrival(t=2.0, template=u.shape_key, request_id="r4")]
    r = simulate(table, arrivals)
    assert (r.sent, r.met, r.shed) == (4, 2, 2)  # r2 shed, r4 refused; r1 and r3 meet their SLO
    assert r.attainment == 0.5
    plain = simulate(table, arrivals, SimulationConfig(admission=False))
    assert plain.shed == 0 and plain.met == 1  # r1 only: r2 runs late and makes r4 and r3 miss


# ---------------------------------------------------------------- the live group (in-process workers)
def test_the_live_group_refuses_and_sheds_with_503s_and_serves_the_rest() -> None:
    from bench.scenarios.group_harness import entry, request, running_group
    from xema_ray.serving.messages import QueueFull

    ok = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
    tight = RequestTemplate(model="tiny-flux2", width=128, height=128, steps=2)
    refused = RequestTemplate(model="tiny-flux2", width=96, height=96, steps=2)
    plans = {ok.shape_key: entry(ok, slo_s=300.0), tight.shape_key: entry(tight, slo_s=0.01),
             refused.shape_key: entry(refused)}
    policy = AdmissionPolicy(late="shed", refused=(refused.shape_key,))
    with running_group("tiny-flux2", plans, admission=policy) as h:
        with pytest.raises(QueueFull, match="not admitted") as e:
            h.call(lambda g: g.generate(request(refused.shape_key, "x", "a fox", 1, steps=refused.steps)))
        assert e.value.retry_after_s >= 1.0
        # t2 can no longer meet its 10 ms SLO once queued behind t1, while the 64² request can: shed
        futs = [h.submit(lambda g, rid=rid, t=t: g.generate(request(t.shape_key, rid, "a fox", 2, steps=t.steps)))
                for rid, t in (("t1", tight), ("t2", tight), ("a1", ok))]
        with pytest.raises(QueueFull, match="shed"):
            futs[1].result(120)
        assert futs[2].result(120).request_id == "a1"
        assert h.group.dispatcher.shed_total >= 1
