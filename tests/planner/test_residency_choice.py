"""The group residency pass: per-template switching vs one shared residency, and the simulator
charging the switches the planner costed."""

from __future__ import annotations

from bench.scenarios.factories import plan_entry
from xema_ray.plan import Mitigation, PlanEntry, PlanTable
from xema_ray.runtime.residency import block_sizes
from xema_ray.sim.simulate import Arrival, simulate
from xema_ray.templates import RequestTemplate

from planner.residency_choice import choose_group_residency

A = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
B = RequestTemplate(model="tiny-flux2", width=128, height=128, steps=2)


def _entry(t: RequestTemplate, blocks: tuple[int, ...], latency: float = 1.0, slo: float = 100.0) -> PlanEntry:
    return plan_entry(t, mitigations=(Mitigation(kind="block_offload", blocks=blocks, intensity=len(blocks)),),
                      peak_bytes=1, latency_s=latency, goodput_rps=1 / latency, slo_s=slo, latency_source="estimated")


def test_slow_link_prefers_shared_residency() -> None:
    entries = {A.shape_key: _entry(A, (0,)), B.shape_key: _entry(B, (2,))}
    # streaming one more block costs 0.01 s; switching at 1e-6 GB/s costs far more
    choice, served = choose_group_residency(entries, lambda c: 1.01, h2d_gbps=1e-6)
    assert choice.policy == "shared" and choice.host_blocks == (0, 2)
    assert all(e.config.mitigations[0].blocks == (0, 2) for e in served.values())
    assert served[A.shape_key].prediction.latency_s == 1.01
    assert choice.goodput_rps["shared"] > choice.goodput_rps["per_template"]


def test_fast_link_keeps_per_template_and_costs_switches() -> None:
    entries = {A.shape_key: _entry(A, (0,)), B.shape_key: _entry(B, (2,))}
    choice, served = choose_group_residency(entries, lambda c: 5.0, h2d_gbps=1.0)
    assert choice.policy == "per_template" and served == entries
    sizes = block_sizes(A.spec)
    assert choice.switch_s[A.shape_key][B.shape_key] == (sizes[0] + sizes[2]) / 1e9


def test_simulator_charges_residency_switches() -> None:
    entries = {A.shape_key: _entry(A, (0,)), B.shape_key: _entry(B, (2,))}
    choice, _ = choose_group_residency(entries, lambda c: 5.0, h2d_gbps=1.0)
    choice = choice.model_copy(update={"switch_s": {A.shape_key: {B.shape_key: 2.0}, B.shape_key: {A.shape_key: 2.0}}})
    table = PlanTable(hardware="x", gpus=1, budget_bytes=1, entries=entries)
    arrivals = [Arrival(t=10.0 * i, template=(A, B)[i % 2].shape_key, request_id=f"r{i}") for i in range(4)]
    plain = simulate(table, arrivals)
    switched = simulate(table.model_copy(update={"residency": {"tiny-flux2": choice}}), arrivals)
    lat_plain = [x for s in plain.per_template.values() for x in s.latencies_s]
    lat_switch = [x for s in switched.per_template.values() for x in s.latencies_s]
    # the first batch finds nothing to switch from; the three after it each pay 2 s
    assert abs(sum(lat_switch) - sum(lat_plain) - 3 * 2.0) < 1e-6
