"""Step-level preemption in a live ModelGroup on CPU, its one worker in this process (no Ray: the
pause and resume at step boundaries are the group's and the worker's, not Ray's): a short
tiny-cogvideox request arriving while a long one runs preempts it (outputs staying bitwise equal
is tests/runtime/test_pause.py's part); the live group makes the simulator's decisions on
the same arrivals; a paused video job reports itself in progress; the group's static-layout
counters (what /v1/stats shows) say the worker loaded and validated the short template's layout
and why it cannot arm it. ``make bench-preemption`` runs the same scenario through the Serve app."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.planning import machine_fingerprint
from bench.scenarios import preemption as sc
from xema_ray.serving.config import ServeConfig


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> tuple[sc.PlanTable, list[sc.Arrival], sc.LiveRun]:
    latency = sc.measure_latencies()
    cfg = ServeConfig.model_validate(sc.serve_args(2))
    table = sc.plan_table(latency, machine_fingerprint(cfg, 1))
    trace = sc.arrivals(latency)
    live = sc.run_group(table, trace, Path(tmp_path_factory.mktemp("plans")), max_preemptions=2)
    return table, trace, live


def test_the_short_request_preempts_the_long_one(scenario: tuple[sc.PlanTable, list[sc.Arrival], sc.LiveRun]) -> None:
    table, trace, live = scenario
    assert live.decisions[:2] == [("preempt", sc.LONG.shape_key, 1), ("resume", sc.LONG.shape_key, 0)]
    st = live.stats["per_template"][sc.LONG.shape_key]
    assert st["preemptions"] >= 1 and st["paused_s"] > 0 and st["paused_now"] == 0
    # the short one did not wait for the long one to finish (as it does without preemption)
    waited = sc.simulate(table, trace, sc.SimulationConfig(preemption=False)).per_template[sc.SHORT.shape_key].latencies_s[0]
    assert live.latencies_s["3"] < 0.6 * waited


def test_live_and_simulated_decisions_are_the_same(scenario: tuple[sc.PlanTable, list[sc.Arrival], sc.LiveRun]) -> None:
    table, trace, live = scenario
    assert live.decisions == sc.simulated_decisions(table, trace)


def test_a_paused_video_job_is_in_progress(scenario: tuple[sc.PlanTable, list[sc.Arrival], sc.LiveRun]) -> None:
    _, _, live = scenario
    while_paused = {status for paused, status in live.job_samples if paused}
    assert while_paused == {"in_progress"}  # sampled while the job's batch was parked
    assert live.job_samples[-1][1] == "completed"


def test_layout_counters_per_template_say_why_not_armed(
        scenario: tuple[sc.PlanTable, list[sc.Arrival], sc.LiveRun]) -> None:
    from xema_ray.serving.messages import GroupLayoutStats

    table, _, live = scenario
    group = GroupLayoutStats.model_validate(live.all_stats["static_layouts"]["tiny-cogvideox"])
    assert "1 layout(s) loaded and validated; not armed" in group.status and "cpu" in group.status
    short, long = group.templates[sc.SHORT.shape_key], group.templates[sc.LONG.shape_key]
    assert short.layout_ref == table.entries[sc.SHORT.shape_key].config.layout_ref and long.layout_ref is None
    # on CPU nothing is armed: the counters are honest zeros
    assert (short.batches, short.armed_batches, short.hits, short.fallbacks, short.reserved_bytes) == (2, 0, 0, 0, 0)
