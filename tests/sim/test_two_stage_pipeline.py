"""The two-stage pipeline in the simulator (``ExecutionConfig.decode``): a pooled template's batch
holds the DiT workers until its last step, then each request queues for a decode worker with the
same ``Dispatcher`` code, keeping its deadline; the DiT workers take the next batch meanwhile."""

from __future__ import annotations

from bench.scenarios.factories import plan_entry, plan_table
from xema_ray.plan import DecodeStage, PlanTable
from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.decode_stage import decode_plan, dit_stage_latency, pool_size
from xema_ray.sim.simulate import Arrival, SimulationConfig, simulate
from xema_ray.templates import RequestTemplate

V = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=4)


def joint(gpus: int = 1) -> PlanTable:
    return plan_table([plan_entry(V, dp=gpus, latency_s=10.0, slo_s=30.0, latency_source="estimated")], gpus=gpus)


def split(workers: int = 1, fraction: float = 1.0, decode_s: float = 4.0, slo: float = 30.0) -> PlanTable:
    e = plan_entry(V, latency_s=10.0, slo_s=slo, latency_source="estimated",
                   decode=DecodeStage(workers=workers, gpus_per_worker=fraction))
    e = e.model_copy(update={"prediction": e.prediction.model_copy(update={"decode_s": decode_s})})
    return plan_table([e], gpus=1 + e.config.decode.gpus)  # type: ignore[union-attr]


def at(*times: float) -> list[Arrival]:
    return [Arrival(t=t, template=V.shape_key, request_id=f"r{i}") for i, t in enumerate(times)]


def test_a_pooled_plan_is_dispatched_as_two_stages() -> None:
    e = split().entries[V.shape_key]
    assert dit_stage_latency(e) == 6.0 and pool_size(split().entries) == (1, 1)
    dit = DispatchPlan.of_entry(e)
    assert (dit.latency_s, dit.slo_s, dit.decode_encode_frac) == (6.0, 26.0, 0.0)
    assert (decode_plan(e).batch, decode_plan(e).sp, decode_plan(e).latency_s) == (1, 1, 4.0)


def test_the_dit_worker_takes_the_next_batch_while_the_pool_decodes() -> None:
    # decode in place on one worker: the second request waits for the first's decode (10 s)
    inplace = simulate(joint(), at(0.0, 6.5), SimulationConfig(wait_window_s=0))
    assert inplace.latency_by_request == {"r0": 10.0, "r1": 13.5}
    # a pool beside it: the DiT worker is free at 6 s, the decode worker at 10 s
    pooled = simulate(split(), at(0.0, 6.5), SimulationConfig(wait_window_s=0))
    assert pooled.latency_by_request == {"r0": 10.0, "r1": 10.0}
    assert pooled.met == 2 and set(pooled.per_template) == {V.shape_key}


def test_a_busy_pool_queues_decodes_by_deadline_and_counts_them_against_the_request_slo() -> None:
    # three requests at once, 10 s each of which 9 s decode: the DiT worker ends them at 1, 2, 3;
    # one decode worker ends them at 10, 19, 28; the SLO of 25 s misses the third only
    r = simulate(split(decode_s=9.0, slo=25.0), at(0.0, 0.0, 0.0), SimulationConfig(wait_window_s=0))
    assert sorted(r.latency_by_request.values()) == [10.0, 19.0, 28.0] and r.met == 2
    # two decode workers: 10, 11, 19
    r = simulate(split(workers=2, decode_s=9.0, slo=25.0), at(0.0, 0.0, 0.0), SimulationConfig(wait_window_s=0))
    assert sorted(r.latency_by_request.values()) == [10.0, 11.0, 19.0] and r.met == 3
