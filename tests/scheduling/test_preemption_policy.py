"""The step-level preemption policy of the shared Dispatcher, and the simulator that runs it:
when it preempts, when it must not (memory, the victim's own deadline, unknown state size), the
bound per request, no starvation, and the attainment it buys on a CogVideoX-like mix."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.scenarios.factories import plan_entry, plan_table
from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.scheduling.preemption_policy import PreemptionPolicy
from xema_ray.sim.simulate import Arrival, SimulationConfig, simulate
from xema_ray.templates import RequestTemplate

GB = 10**9
LONG = DispatchPlan(batch=1, sp=1, slo_s=1000, latency_s=100, steps=10, peak_bytes=40 * GB, pause_bytes=2 * GB)
SHORT = DispatchPlan(batch=1, sp=1, slo_s=20, latency_s=5, steps=5, peak_bytes=40 * GB, pause_bytes=1 * GB)


def _dispatcher(budget: int = 48 * GB, host: int | None = None, long: DispatchPlan = LONG, workers: int = 1,
                max_preemptions: int = 2) -> Dispatcher[None]:
    return Dispatcher({"long": long, "short": SHORT}, workers=workers, wait_window_s=0,
                      preemption=PreemptionPolicy(budget_bytes=budget, host_bytes=host, max_preemptions=max_preemptions))


def _long_then_short(d: Dispatcher[None], short_at: float = 10.0) -> list:
    d.submit("long", "L", 0.0, key=BatchKey(steps=d.plans["long"].steps))
    assert [a.template for a in d.dispatch(0.0)] == ["long"]
    d.submit("short", "S", short_at, key=BatchKey(steps=d.plans["short"].steps))
    return d.dispatch(short_at)


def test_a_short_batch_that_would_miss_by_waiting_preempts_the_long_one() -> None:
    d = _dispatcher()
    (a,) = _long_then_short(d)
    assert a.template == "short" and a.workers == (0,)
    assert [(p.batch_id, p.offload) for p in a.preempts] == [(0, False)]  # 40 + 2 GB fits 48 GB: state stays
    assert [x.kind for x in d.decisions] == ["preempt"] and d.paused[0].template == "long"
    d.complete(a.batch_id)
    (r,) = d.dispatch(16.0)
    assert r.resume and r.batch_id == 0 and r.workers == (0,)  # the paused batch gets its workers back first


def test_no_preemption_when_waiting_still_meets_the_deadline() -> None:
    d = _dispatcher()
    assert _long_then_short(d, short_at=90.0) == []  # the long one ends at 100; 100 + 5 <= 110
    assert not d.decisions


def test_memory_decides_device_or_host_or_no_preemption() -> None:
    (a,) = _long_then_short(_dispatcher(budget=41 * GB))  # 40 + 2 > 41: the state moves to the host
    assert a.preempts[0].offload is True
    d = _dispatcher(budget=41 * GB, host=1 * GB)  # ... and the host has 1 GB for it: no preemption
    assert _long_then_short(d) == [] and not d.decisions


def test_a_batch_with_a_static_layout_moves_its_state_to_the_host() -> None:
    armed = DispatchPlan(batch=1, sp=1, slo_s=1000, latency_s=100, steps=10, peak_bytes=40 * GB, pause_bytes=2 * GB,
                         static_layout=True)
    (a,) = _long_then_short(_dispatcher(long=armed))  # it would fit on the device, but not outside the arena
    assert a.preempts[0].offload is True
    assert _long_then_short(_dispatcher(long=armed, host=GB)) == []


def test_a_victim_that_would_then_miss_its_own_deadline_is_not_paused() -> None:
    tight = DispatchPlan(batch=1, sp=1, slo_s=102, latency_s=100, steps=10, peak_bytes=40 * GB, pause_bytes=2 * GB)
    assert _long_then_short(_dispatcher(long=tight)) == []
    # one that has lost its deadline already may be paused: waiting does it no further harm
    lost = DispatchPlan(batch=1, sp=1, slo_s=50, latency_s=100, steps=10, peak_bytes=40 * GB, pause_bytes=2 * GB)
    (a,) = _long_then_short(_dispatcher(long=lost))
    assert a.preempts


def test_unknown_state_size_is_never_preempted() -> None:
    unknown = DispatchPlan(batch=1, sp=1, slo_s=1000, latency_s=100, steps=10, peak_bytes=40 * GB, pause_bytes=None)
    assert _long_then_short(_dispatcher(long=unknown)) == []


def test_a_paused_state_measured_larger_raises_the_plan_figure_the_memory_check_uses() -> None:
    d = _dispatcher(budget=43 * GB, host=GB)  # 40 + 2 GB fits on the device
    d.observe_pause_bytes("long", GB)  # smaller than planned: the plan's figure stays
    assert d.plans["long"].pause_bytes == 2 * GB
    d.observe_pause_bytes("long", 4 * GB)  # what the workers measured: 40 + 4 GB no longer fits, nor the host
    assert d.plans["long"].pause_bytes == 4 * GB
    assert _long_then_short(d) == []
    never = _dispatcher(long=DispatchPlan(batch=1, sp=1, slo_s=1000, latency_s=100, steps=10, peak_bytes=40 * GB))
    never.observe_pause_bytes("long", GB)  # a plan that never pauses stays so
    assert never.plans["long"].pause_bytes is None


def test_a_worker_holding_a_paused_batch_takes_no_other_batch_meanwhile() -> None:
    d = _dispatcher(workers=1)
    (a,) = _long_then_short(d)
    d.submit("short", "S2", 11.0, key=BatchKey(steps=d.plans["short"].steps))  # the worker runs S and holds L: S2 waits (no second pause)
    assert d.dispatch(11.0) == []
    d.complete(a.batch_id)
    started = d.dispatch(15.0)  # L resumes first; S2 then preempts it again (its 2nd pause of 2)
    assert [(x.template, x.resume, bool(x.preempts)) for x in started] == [("long", True, False), ("short", False, True)]
    assert d.preempted_count("L") == 2


def _table() -> PlanTable:
    long_t = RequestTemplate(model="cogvideox-5b", width=1920, height=1088, frames=81, steps=50)
    short_t = RequestTemplate(model="cogvideox-5b", width=1280, height=720, frames=49, steps=50)

    def entry(t: RequestTemplate, latency: float, slo: float, pause: int | None) -> PlanEntry:
        return plan_entry(t, peak_bytes=40 * GB, latency_s=latency, goodput_rps=1 / latency, slo_s=slo,
                          latency_source="estimated", pause_bytes=pause)
    return plan_table([entry(long_t, 1000.0, 5000.0, 2 * GB), entry(short_t, 60.0, 180.0, 1 * GB)],
                      hardware="sim", budget_bytes=48 * GB)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3000), st.booleans()), min_size=1, max_size=25), st.integers(1, 3))
def test_simulated_runs_respect_the_bound_and_finish_every_request(reqs: list[tuple[float, bool]], bound: int) -> None:
    table = _table()
    long_k, short_k = sorted(table.entries, key=lambda k: -table.entries[k].prediction.latency_s)
    arrivals = [Arrival(t=t, template=short_k if short else long_k, request_id=f"r{i}") for i, (t, short) in enumerate(reqs)]
    res = simulate(table, arrivals, SimulationConfig(preemption=True, max_preemptions=bound))
    counts: dict[str, int] = {}
    for d in res.decisions:
        if d.kind == "preempt":
            for r in d.requests:
                counts[r] = counts.get(r, 0) + 1
            assert table.entries[d.template].prediction.latency_s == 1000.0  # only the long one is ever paused
    assert max(counts.values(), default=0) <= bound
    assert sum(len(s.latencies_s) for s in res.per_template.values()) == len(arrivals)  # no one starves
    resumes = sum(d.kind == "resume" for d in res.decisions)
    assert resumes <= res.preemptions


def test_preemption_raises_attainment_on_a_short_behind_long_mix() -> None:
    table = _table()
    long_k, short_k = sorted(table.entries, key=lambda k: -table.entries[k].prediction.latency_s)
    arrivals = [Arrival(t=0.0, template=long_k, request_id="L")] + [
        Arrival(t=100.0 + 300 * i, template=short_k, request_id=f"s{i}") for i in range(3)]
    without = simulate(table, arrivals)
    with_p = simulate(table, arrivals, SimulationConfig(preemption=True, max_preemptions=3))
    assert without.attainment == 0.25 and with_p.attainment == 1.0  # every short one missed waiting
    assert with_p.preemptions == 3


def test_an_sp2_batch_pauses_on_all_its_ranks_and_resumes_on_the_same_group() -> None:
    long_sp2 = DispatchPlan(batch=1, sp=2, slo_s=1000, latency_s=100, steps=10, peak_bytes=40 * GB, pause_bytes=2 * GB)
    d = _dispatcher(long=long_sp2, workers=2)
    (a,) = _long_then_short(d)
    assert a.workers == (0,) and [p.batch_id for p in a.preempts] == [0]
    d.submit("short", "S2", 11.0, key=BatchKey(steps=d.plans["short"].steps))  # worker 1 is idle but holds the paused batch's state: not taken
    assert d.dispatch(11.0) == []
    d.complete(a.batch_id)
    started = d.dispatch(15.0)
    assert (started[0].resume, started[0].workers) == (True, (0, 1))
