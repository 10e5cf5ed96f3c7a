"""Replica summaries, the replica choice and the scaling decision: pure functions, no Ray."""

from __future__ import annotations

import pytest

from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.serving.scale.replica_summary import (
    ArrivalMeter,
    PlanBrief,
    ReplicaSummary,
    RunningBatch,
    TemplateQueue,
    predict_attainment,
    predict_completion,
    predict_wait,
    schedule,
    summarize,
)
from xema_ray.serving.scale.scaling import (
    AutoscalingSpec,
    SloAutoscalingPolicy,
    choose_replica,
    decide_replicas,
    summary_from_metrics,
    summary_metrics,
)

PLANS = {"img": PlanBrief(batch=2, sp=1, latency_s=10.0, slo_s=30.0, steps=10),
         "vid": PlanBrief(batch=1, sp=2, latency_s=20.0, slo_s=60.0, steps=20)}


def replica(name: str, t: float = 100.0, workers: int = 2, queues=None, running=(), **kw) -> ReplicaSummary:
    return ReplicaSummary(replica=name, t=t, workers=workers, plans=PLANS, queues=queues or {}, running=list(running),
                          wait_window_s=0.0, **kw)


def q(n: int, slo: float = 30.0, rate: float = 0.0) -> TemplateQueue:
    return TemplateQueue(queued=n, deadlines_s=[slo] * n, arrival_rate=rate)


# ---------------------------------------------------------------------------- summaries
def test_summary_of_a_dispatcher_shows_its_queue_running_batches_and_free_groups() -> None:
    d: Dispatcher[None] = Dispatcher({k: DispatchPlan(batch=p.batch, sp=p.sp, slo_s=p.slo_s, latency_s=p.latency_s,
                                                      steps=p.steps) for k, p in PLANS.items()}, workers=2,
                                     wait_window_s=0.0)
    for i in range(3):
        d.submit("img", f"r{i}", now=0.0, key=BatchKey(steps=d.plans["img"].steps))
    started = d.dispatch(now=0.0)  # a batch of 2 on worker 0, the third alone on worker 1 (no wait window)
    assert [len(a.requests) for a in started] == [2, 1]
    d.submit("img", "r3", now=1.0, key=BatchKey(steps=d.plans["img"].steps))
    d.submit("vid", "v0", now=1.0, key=BatchKey(steps=d.plans["vid"].steps))
    s = summarize(d, "rep-a", now=4.0, wall=1000.0, rates={"img": 0.5})
    assert s.t == 1000.0 and s.workers == 2
    assert s.queues["img"].queued == 1 and s.queues["img"].deadlines_s == [27.0]  # 1 + 30 - 4
    assert s.queues["img"].open_slots == 1 and s.queues["img"].arrival_rate == 0.5
    assert s.queues["vid"].queued == 1 and s.queues["vid"].oldest_wait_s == 3.0
    assert sorted(b.remaining_s for b in s.running) == [6.0, 6.0]
    assert {b.remaining_steps for b in s.running} == {6}
    assert s.free_groups == {"img": 0, "vid": 0}
    assert ReplicaSummary.model_validate_json(s.model_dump_json()) == s  # crosses processes as JSON


def test_arrival_meter_counts_the_recent_window_only() -> None:
    m = ArrivalMeter(window_s=10.0)
    for t in (0.0, 1.0, 9.0, 12.0):
        m.add("img", t)
    assert m.rates(now=12.0) == {"img": pytest.approx(0.2)}  # 9 and 12 are within the last 10 s
    assert m.rates(now=30.0) == {"img": 0.0}


# ---------------------------------------------------------------------------- the replay
def test_replay_batches_by_plan_and_places_on_the_first_free_group() -> None:
    s = replica("a", queues={"img": q(4)}, running=[RunningBatch(template="img", workers=[0], requests=2,
                                                                 remaining_s=5.0, remaining_steps=5, deadline_s=25.0)])
    outs = [o for o in schedule(s) if o.arrival <= 0 and o.tag < 0]  # running and queued
    ends = sorted(o.completion for o in outs)
    # the running batch ends at 5; queued batch 1 on worker 1 at 0 -> 10; batch 2 on worker 0 at 5 -> 15
    assert ends == [5.0, 5.0, 10.0, 10.0, 15.0, 15.0]
    assert all(o.met for o in outs)


def test_predicted_completion_joins_an_open_slot_and_ages_with_the_summary() -> None:
    s = replica("a", workers=1, queues={"img": TemplateQueue(queued=1, deadlines_s=[30.0], open_slots=1)},
                running=[RunningBatch(template="img", workers=[0], requests=2, remaining_s=8.0, remaining_steps=8,
                                      deadline_s=20.0)])
    assert predict_completion(s, "img", now=100.0) == pytest.approx(18.0)  # fills the waiting batch
    assert predict_completion(s, "img", now=103.0) == pytest.approx(15.0)  # 3 s later: 3 s less to wait
    # two requests sent since the summary fill that batch: the next one waits for another
    assert predict_completion(s, "img", now=100.0, sent_since={"img": 1}) == pytest.approx(28.0)
    assert predict_completion(s, "unknown", now=100.0) == float("inf")
    # the same probe's start: the running batch's end, less its own batch's run time (10 s)
    assert predict_wait(s, "img", now=100.0) == pytest.approx(8.0)
    assert predict_wait(s, "img", now=100.0, sent_since={"img": 1}) == pytest.approx(18.0)
    assert predict_wait(s, "unknown", now=100.0) == float("inf")


def test_predicted_attainment_counts_arrivals_over_the_window() -> None:
    idle = replica("a", workers=1)
    assert predict_attainment(idle, window_s=60.0).fraction == 1.0
    # 1 req/s of 10 s batches of 2 on one worker: 0.2 req/s of capacity, most of the window misses
    busy = replica("a", workers=1, queues={"img": q(0, rate=1.0)})
    att = predict_attainment(busy, window_s=60.0)
    assert att.total == 60 and att.fraction < 0.2
    assert att.work_gpu_s == pytest.approx(60 * 10.0 / 2)


FLUX = PlanBrief(batch=3, sp=2, latency_s=10.0, slo_s=12.0, steps=50, min_latency_s=5.0)


def test_a_partial_batch_is_replayed_at_its_own_latency() -> None:
    assert [FLUX.latency_for(n) for n in (1, 2, 3)] == [5.0, 7.5, 10.0]
    assert PLANS["img"].latency_for(1) == 10.0  # no batch-of-one latency known: the full batch's
    s = ReplicaSummary(replica="a", t=0.0, workers=4, wait_window_s=0.0, plans={"f": FLUX},
                       queues={"f": TemplateQueue(queued=1, deadlines_s=[12.0])})
    assert [o.completion for o in schedule(s)] == [5.0]  # alone: 5 s, not the full batch's 10


def test_summary_counts_a_partial_batch_against_its_own_latency() -> None:
    d: Dispatcher[None] = Dispatcher({"f": DispatchPlan(batch=3, sp=2, slo_s=12.0, latency_s=10.0, steps=50,
                                                        min_latency_s=5.0)}, workers=4, wait_window_s=0.0)
    d.submit("f", "r0", now=0.0, key=BatchKey(steps=d.plans["f"].steps))
    d.dispatch(now=0.0)
    s = summarize(d, "a", now=2.0, wall=2.0)
    assert [b.remaining_s for b in s.running] == [3.0]  # the dispatcher's own count says 8
    assert s.running[0].remaining_steps == 30


def test_an_old_summary_keeps_the_outcomes_it_predicted() -> None:
    # at t=100: a batch ends at 101 (deadline 102); one request queued (deadline 109) waits for
    # its workers and runs 101 -> 106; everything met
    s = ReplicaSummary(replica="a", t=100.0, workers=2, wait_window_s=0.0, plans={"f": FLUX},
                       queues={"f": TemplateQueue(queued=1, deadlines_s=[9.0], oldest_wait_s=3.0)},
                       running=[RunningBatch(template="f", workers=[0, 1], requests=1, remaining_s=1.0,
                                             remaining_steps=5, deadline_s=2.0)])
    assert predict_attainment(s, window_s=10.0, rates={}).fraction == 1.0
    # read 4 s later the same state is 4 s older: the batch ended at -3 (in time), the queued one
    # started then and ends at +2, 3 s before its deadline; still all met
    old = predict_attainment(s, window_s=10.0, now=104.0, rates={})
    assert old.fraction == 1.0 and old.total == 2
    assert sorted(o.completion for o in schedule(s, now=104.0)) == [-3.0, 2.0]


def test_replicas_still_starting_count_towards_a_scale_up() -> None:
    # one running replica below the target whose window needs two: a second asked for and still
    # starting is enough, however often the policy asks (Serve: every 0.1 s)
    live = [ReplicaSummary(replica="r0", t=100.0, workers=4, wait_window_s=0.0, plans={"f": FLUX},
                           queues={"f": TemplateQueue(queued=6, deadlines_s=[12.0] * 6, arrival_rate=0.6)})]
    first = decide_replicas(live, current=1, spec=SPEC, now=100.0)
    assert first.action == "up" and first.replicas == 2
    current = first.replicas
    for _ in range(20):
        d = decide_replicas(live, current=current, spec=SPEC, now=100.0)
        current = d.replicas
    assert current == 2 and d.action == "hold" and "starting" in d.reason


# ---------------------------------------------------------------------------- replica choice
def test_choice_prefers_the_earliest_completion_within_the_slo() -> None:
    now = 100.0
    busy = replica("busy", queues={"img": q(6)})
    idle = replica("idle")
    half = replica("half", queues={"img": q(2)})
    c = choose_replica({"busy": busy, "idle": idle, "half": half}, "img", now)
    assert c.order == ["idle", "half", "busy"] and c.within_slo
    assert c.completion_s["idle"] == pytest.approx(10.0)
    # requests sent to idle since its summary move it back
    c = choose_replica({"idle": idle, "half": half}, "img", now, sent_since={"idle": {"img": 6}})
    assert c.order == ["half", "idle"]


def test_choice_ranks_stale_and_missing_summaries_last() -> None:
    fresh = replica("fresh", t=100.0, queues={"img": q(6)})
    stale = replica("stale", t=50.0)
    c = choose_replica({"stale": stale, "none": None, "fresh": fresh}, "img", now=100.0, max_age_s=10.0)
    assert c.order == ["fresh", "stale", "none"]


def test_choice_ranks_replicas_that_miss_the_slo_after_those_that_meet_it() -> None:
    late = replica("late", queues={"img": q(12)})  # 12 queued on 2 workers: 30 s of work before it
    draining = replica("draining", draining=True)
    c = choose_replica({"late": late, "draining": draining}, "img", now=100.0)
    assert c.order == ["late", "draining"] and not c.within_slo


# ---------------------------------------------------------------------------- scaling
SPEC = AutoscalingSpec(min_replicas=1, max_replicas=6, target_attainment=0.9, window_s=60.0, scale_down_margin=0.05)


def test_scale_up_when_predicted_attainment_falls_below_the_target() -> None:
    over = [replica(f"r{i}", queues={"img": q(4, rate=1.0)}) for i in range(2)]
    d = decide_replicas(over, current=2, spec=SPEC.model_copy(update={"max_replicas": 10}), now=100.0)
    assert d.action == "up" and d.attainment < 0.9
    # the window's work: 2 replicas x (4 queued + 60 arriving) x 5 GPU-s = 640 GPU-s over 60 s on
    # two-GPU replicas -> 5.3 -> 6 replicas
    assert d.replicas == 6


def test_scale_up_is_bounded_by_max_replicas() -> None:
    over = [replica(f"r{i}", queues={"img": q(4, rate=5.0)}) for i in range(2)]
    assert decide_replicas(over, current=2, spec=SPEC, now=100.0).replicas == SPEC.max_replicas


def test_scale_down_when_the_others_absorb_the_load_within_the_slo() -> None:
    quiet = [replica(f"r{i}", queues={"img": q(0, rate=0.05)}) for i in range(3)]
    d = decide_replicas(quiet, current=3, spec=SPEC, now=100.0)
    assert d.action == "down" and d.replicas == 2 and d.attainment_without is not None


def test_hold_when_removing_one_would_miss_the_target() -> None:
    # a replica serves 0.4 req/s (2 workers, batches of 2 in 10 s): 0.3 each is fine, 0.6 on one is not
    full = [replica(f"r{i}", queues={"img": q(0, rate=0.3)}) for i in range(2)]
    d = decide_replicas(full, current=2, spec=SPEC, now=100.0)
    assert d.action == "hold" and d.attainment >= 0.9 and d.attainment_without < 0.95


def test_replicas_not_running_are_dropped_when_the_running_ones_meet_the_target() -> None:
    # 3 asked for, 2 running (no node has room for the third, or it is still starting)
    quiet = [replica(f"r{i}") for i in range(2)]
    d = decide_replicas(quiet, current=3, spec=SPEC, now=100.0)
    assert d.action == "down" and d.replicas == 2
    # while the running ones miss the target, the starting one is still wanted (and more)
    busy = [replica(f"r{i}", queues={"img": q(4, rate=1.0)}) for i in range(2)]
    assert decide_replicas(busy, current=3, spec=SPEC, now=100.0).replicas >= 3


def test_min_replicas_is_kept() -> None:
    quiet = [replica("r0")]
    assert decide_replicas(quiet, current=1, spec=SPEC, now=100.0).replicas == 1
    assert decide_replicas(quiet, current=1, spec=SPEC.model_copy(update={"min_replicas": 2}), now=100.0).replicas == 2


def test_an_idle_group_that_scales_to_zero_gives_its_last_replica_back() -> None:
    zero = AutoscalingSpec(min_replicas=0, max_replicas=2)
    assert zero.scales_to_zero and not SPEC.scales_to_zero
    d = decide_replicas([replica("r0")], current=1, spec=zero, now=100.0)
    assert d.action == "down" and d.replicas == 0 and "idle" in d.reason
    # anything queued, running or arrived over the window keeps it
    for busy in (replica("r0", queues={"img": q(1)}), replica("r0", queues={"img": q(0, rate=0.05)}),
                 replica("r0", running=[RunningBatch(template="img", workers=[0], requests=1, remaining_s=5.0,
                                                     remaining_steps=5, deadline_s=30.0)])):
        assert decide_replicas([busy], current=1, spec=zero, now=100.0).replicas == 1
    # at zero (no summary: no replica) it stays there; Serve wakes it for the first request
    assert decide_replicas([], current=0, spec=zero, now=100.0).replicas == 0
    # min_replicas 1 never drops the last one
    assert decide_replicas([replica("r0")], current=1, spec=SPEC, now=100.0).replicas == 1


def test_error_raised_if_max_replicas_is_below_min_replicas() -> None:
    with pytest.raises(ValueError, match="max_replicas"):
        AutoscalingSpec(min_replicas=3, max_replicas=2)


# ---------------------------------------------------------------------------- as Serve metrics
def test_summary_survives_the_metrics_round_trip() -> None:
    s = replica("a", workers=4, queues={"img": TemplateQueue(queued=3, deadlines_s=[5.0, 6.0, 7.0], arrival_rate=0.5,
                                                             open_slots=1)},
                running=[RunningBatch(template="vid", workers=[2, 3], requests=1, remaining_s=4.0, remaining_steps=4,
                                      deadline_s=40.0),
                         RunningBatch(template="img", workers=[0], requests=2, remaining_s=1.0, remaining_steps=1,
                                      deadline_s=9.0),
                         RunningBatch(template="img", workers=[0], requests=1, remaining_s=3.0, remaining_steps=3,
                                      deadline_s=12.0, paused=True)])
    m = summary_metrics(s)
    assert all(isinstance(v, float) for v in m.values())
    back = summary_from_metrics("a", m, PLANS)
    assert back.queues == s.queues
    key = lambda b: (b.workers, b.paused)  # noqa: E731
    assert [(b.template, b.workers, b.requests, b.remaining_s, b.paused) for b in sorted(back.running, key=key)] == \
        [(b.template, b.workers, b.requests, b.remaining_s, b.paused) for b in sorted(s.running, key=key)]
    # the keys never change with the state (Serve keeps every key's last value)
    assert set(summary_metrics(replica("a", workers=4))) == set(m)


class _Point:
    def __init__(self, value: float) -> None:
        self.value = value


class _Ctx:
    def __init__(self, metrics: dict[str, dict[str, float]], target: int) -> None:
        self.raw_metrics = {name: {rid: [_Point(0.0), _Point(v)] for rid, v in by.items()} for name, by in metrics.items()}
        self.aggregated_metrics = None
        self.running_replicas = sorted({rid for by in metrics.values() for rid in by})
        self.target_num_replicas = target
        self.policy_state: dict = {}


def test_serve_policy_decides_from_the_latest_published_summaries() -> None:
    import time

    now = time.time()
    reps = {f"r{i}": summary_metrics(replica(f"r{i}", t=now, queues={"img": q(4, rate=1.0)})) for i in range(2)}
    by_name: dict[str, dict[str, float]] = {}
    for rid, m in reps.items():
        for k, v in m.items():
            by_name.setdefault(k, {})[rid] = v
    spec = SPEC.model_copy(update={"max_replicas": 10})
    policy = SloAutoscalingPolicy(spec.model_dump(), {k: p.model_dump() for k, p in PLANS.items()})
    n, state = policy(_Ctx(by_name, target=2))
    assert n == 6 and state["xema_decision"]["action"] == "up"


def test_the_wake_timeout_is_the_specs_else_three_plan_warm_starts() -> None:
    from xema_ray.plan import ReplicaStart
    from xema_ray.profiling.replica_start import MEASURED_CPU, predict_start

    start = predict_start(2_150_000_000, MEASURED_CPU)  # the benchmark's model: its measured phases back
    assert start.warm_s == pytest.approx(MEASURED_CPU.process_s + 3.3, abs=0.05)
    assert start.cold_s == pytest.approx(MEASURED_CPU.process_s + 8.4 + 3.3, abs=0.05)
    zero = AutoscalingSpec(min_replicas=0)
    assert zero.wake_timeout(start) == pytest.approx(3 * start.warm_s)
    assert zero.wake_timeout(ReplicaStart(weight_bytes=1, cold_s=1.0, warm_s=1.0, basis="b")) == 30.0
    assert zero.wake_timeout(None) == 120.0
    assert AutoscalingSpec(min_replicas=0, wake_timeout_s=5.0).wake_timeout(start) == 5.0


def test_a_table_without_a_start_prediction_gets_one_at_start_up() -> None:
    from deployments.app import wake_policy
    from xema_ray.plan import PlanTable
    from xema_ray.profiling.replica_start import MEASURED_CPU, predict_start
    from xema_ray.runtime.host_bytes import model_weight_bytes
    from xema_ray.serving.group.settings import ModelGroupConfig

    g = ModelGroupConfig(model="tiny-flux2", templates=[{"width": 64, "height": 64}], max_queue=5,
                         autoscaling={"min_replicas": 0, "max_replicas": 2})
    assert g.scales_to_zero and g.wants_host_copy()  # its wake maps the node's host copy
    table = PlanTable(hardware="cpu", gpus=1, budget_bytes=10**9)
    warm = predict_start(model_weight_bytes("tiny-flux2"), MEASURED_CPU).warm_s
    assert wake_policy(g, table).timeout_s == pytest.approx(max(30.0, 3 * warm)) and wake_policy(g, table).max_queue == 5
    planned = table.model_copy(update={"replica_start": {"tiny-flux2": predict_start(10**11, MEASURED_CPU)}})
    assert wake_policy(g, planned).timeout_s == pytest.approx(3 * planned.replica_start["tiny-flux2"].warm_s)
