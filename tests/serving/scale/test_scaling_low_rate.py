"""The autoscaling decision over a replica's own dispatcher at a steady rate: pure functions, no Ray.

A ``Dispatcher`` with the bench's plan (Flux.2 256x256 on 4 GPUs, SP 2 x DP 2, batches of up
to 3, on the emulated clock at time_scale 4) is fed Poisson arrivals; its batches take what the
emulated workers take (the plan's latency for the batch's size); every half second its summary
crosses Serve's metrics (``summary_metrics`` -> ``summary_from_metrics``), a second old as the
controller sees it, and ``decide_replicas`` answers with the count fed back as Serve's target.
The replicas asked for never start here: the worst case for a ratchet, and what the running one
sees for the tens of seconds a real replica takes to start.

This is the bench's spurious scale-up (``make bench-scale``: 1 -> 8 replicas within 2.5 s at
0.25 req/s): the replay charged every batch the full batch's time (a batch of one takes half),
so a quiet replica looked backlogged, and each tick added one more replica on top of those still
starting.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from xema_ray.plan import PlanTable
from xema_ray.runtime.emulation import scale_table
from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.serving.scale.replica_summary import ArrivalMeter, PlanBrief, predict_attainment, summarize
from xema_ray.serving.scale.scaling import AutoscalingSpec, decide_replicas, summary_from_metrics, summary_metrics

ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = "flux2/256x256x1"
TIME_SCALE = 4.0
#: the bench's autoscaling (bench/bench_scale.py app_args): 4 nodes x 8 GPUs / 4 per replica
SPEC = AutoscalingSpec(min_replicas=1, max_replicas=8, target_attainment=0.9, window_s=20.0,
                       scale_down_margin=0.05, downscale_delay_s=8.0, metrics_interval_s=0.5)


@dataclass
class Run:
    predicted: float  # mean predicted attainment over the ticks
    actual: float  # fraction of completed requests that met their deadline
    peak: int  # most replicas asked for
    end: int  # replicas asked for at the end
    completed: int


@pytest.fixture(scope="module")
def flux() -> tuple[DispatchPlan, dict[int, float]]:
    table = scale_table(PlanTable.load(str(ROOT / "plans" / "a6000x8.json")), TIME_SCALE)
    entry = table.entries[TEMPLATE]
    work = dict(entry.prediction.latency_by_batch)
    work[entry.config.batch] = entry.prediction.latency_s
    return DispatchPlan.of_entry(entry), work


def run(plan: DispatchPlan, work: dict[int, float], rate: float, seconds: float = 300.0, seed: int = 7,
        lag_s: float = 1.0) -> Run:
    d: Dispatcher[None] = Dispatcher({TEMPLATE: plan}, workers=4, wait_window_s=0.02, max_queue=24)
    briefs = {TEMPLATE: PlanBrief.of(plan)}
    meter = ArrivalMeter(30.0)
    rng = random.Random(seed)
    now, arrival, tick, n = 0.0, rng.expovariate(rate), 0.0, 0
    ends: list[tuple[float, int]] = []
    met = done = 0
    predicted: list[float] = []
    target = peak = 1
    while now < seconds:
        now = min(arrival, tick, ends[0][0] if ends else float("inf"))
        if ends and ends[0][0] == now:
            a = d.complete(heapq.heappop(ends)[1])
            done += len(a.requests)
            met += sum(now <= r.deadline + 1e-9 for r in a.requests)
        elif arrival == now:
            if d.queue_depth(TEMPLATE) < d.max_queue:
                d.submit(TEMPLATE, f"r{n}", now, key=BatchKey(steps=d.plans[TEMPLATE].steps))
                meter.add(TEMPLATE, now)
            n += 1
            arrival = now + rng.expovariate(rate)
        else:
            tick += SPEC.metrics_interval_s
            if now >= 30.0:  # the arrival meter's window is full
                s = summarize(d, "r0", now, wall=now, rates=meter.rates(now))
                seen = summary_from_metrics("r0", summary_metrics(s), briefs)
                predicted.append(predict_attainment(seen, SPEC.window_s, now + lag_s).fraction)
                target = decide_replicas([seen], target, SPEC, now + lag_s).replicas
                peak = max(peak, target)
        for a in d.dispatch(now):
            heapq.heappush(ends, (now + work[len(a.requests)], a.batch_id))
    return Run(predicted=sum(predicted) / len(predicted), actual=met / max(1, done), peak=peak, end=target,
               completed=done)


def test_a_quiet_replica_asks_for_no_more_replicas(flux) -> None:  # type: ignore[no-untyped-def]
    r = run(*flux, rate=0.1)
    assert r.actual == 1.0 and r.completed > 20
    # before the fix: predicted 0.88 and max_replicas asked for; now a burst may ask for one more
    # for a moment (Serve's upscale_delay_s holds such a blip back), and it is given back
    assert r.predicted >= 0.99
    assert r.peak <= 2 and r.end == 1


def test_the_base_rate_of_the_bench_does_not_ratchet_to_max_replicas(flux) -> None:  # type: ignore[no-untyped-def]
    r = run(*flux, rate=0.25)
    # bursts of a Poisson stream make a batch of three wait: one replica is near the target here
    # (this stream meets 0.87 of its SLOs on it), so more may be asked for; before the fix:
    # predicted 0.57 and all 8 asked for
    assert r.predicted >= 0.9
    assert r.peak <= 3


def test_an_overloaded_replica_still_asks_for_what_the_load_needs(flux) -> None:  # type: ignore[no-untyped-def]
    r = run(*flux, rate=2.0, seconds=90.0)
    # 2 req/s of Flux.2 at 3 per 10.3 s batch on two SP groups: about 3.5 replicas' worth
    assert r.actual < 0.5 and r.predicted < 0.5
    assert 4 <= r.peak <= SPEC.max_replicas


@pytest.mark.parametrize("rate", [0.25, 0.4])
def test_predicted_attainment_matches_what_the_dispatcher_meets(flux, rate: float) -> None:  # type: ignore[no-untyped-def]
    # the replay's arrivals bunch as a Poisson stream's do (replica_summary.expected_arrivals):
    # evenly spaced, the prediction was 0.03-0.09 above what the live dispatcher met
    r = run(*flux, rate=rate, seconds=1500.0, seed=3)
    assert abs(r.predicted - r.actual) < 0.05, r
