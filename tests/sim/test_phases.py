"""What a preemption costs, the same for the live stack and the simulator (issue 25). One phase
split: the emulated worker sleeps through it, the model group's dispatcher takes it as its prior,
and the simulator parks a paused batch where it puts the next step boundary — never after the last
step (a worker pauses only between steps). An offloaded state moves out before the preemptor
starts and back on resume; the pause handshake the live group measures is charged too."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scenarios.factories import plan_entry, plan_table
from bench.scenarios.group_harness import entry, running_group
from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.profiling.phases import PhaseShares, phase_shares
from xema_ray.runtime.emulation import emulation_for, scale_table
from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.scheduling.preemption_policy import PreemptionPolicy
from xema_ray.sim.simulate import Arrival, SimulationConfig, simulate
from xema_ray.templates import RequestTemplate

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = PlanTable.load(str(ROOT / "plans" / "a6000x8.json"))
GB = 10**9


def test_shares_sum_to_one_and_are_the_same_on_the_emulated_clock() -> None:
    ref = phase_shares(REFERENCE)
    scaled = phase_shares(scale_table(REFERENCE, {"flux2": 100.0, "cogvideox-5b": 6000.0}))
    assert set(ref) == set(REFERENCE.entries) == set(scaled)
    for k, s in ref.items():
        assert s.text + s.denoise + s.decode_encode == pytest.approx(1.0)
        assert scaled[k].model_dump() == pytest.approx(s.model_dump(), rel=1e-9, abs=1e-12)
    # the emulated worker sleeps through the same split
    emu = emulation_for(REFERENCE, 100.0)
    for k, s in ref.items():
        ph = emu.templates[k]
        assert ph.text_s / ph.total_s == pytest.approx(s.text, abs=1e-9)
        assert ph.decode_s / ph.total_s == pytest.approx(s.decode_encode, abs=1e-9)
    # LTX-2's decode (audio and video VAEs) is a tenth of its time, CogVideoX-5B's about 1 %
    assert ref["ltx2/864x480x49"].decode_encode > 0.1 > ref["cogvideox-5b/1280x720x49"].decode_encode > 0.005


def test_a_table_scaled_twice_keeps_one_split() -> None:
    once = scale_table(REFERENCE, 100.0)
    twice = scale_table(once, 60.0)
    for k, s in phase_shares(REFERENCE).items():
        assert phase_shares(twice)[k].decode_encode == pytest.approx(s.decode_encode, rel=1e-9)


def test_the_model_groups_prior_is_the_simulators_split() -> None:
    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=8)
    shares = PhaseShares(text=0.1, denoise=0.6, decode_encode=0.3)
    with running_group("tiny-flux2", {t.shape_key: entry(t, latency_s=2.0)}, phases={t.shape_key: shares}) as h:
        live = h.group.dispatcher.plans[t.shape_key]
    sim = DispatchPlan.of_entry(entry(t, latency_s=2.0), shares=shares)
    assert (live.denoise_frac, live.decode_encode_frac) == pytest.approx((0.6, 0.3)) == (sim.denoise_frac, sim.decode_encode_frac)


LONG = RequestTemplate(model="tiny-cogvideox", width=128, height=96, frames=17, steps=4)
SHORT = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2)
# LONG: 10 s of text, 4 steps of 12.5 s (boundaries at 22.5, 35, 47.5; the last ends at 60), a 40 s tail
LONG_SHARES = PhaseShares(text=0.1, denoise=0.5, decode_encode=0.4)


def _table(budget: int = 48 * GB, pause_bytes: int = GB) -> PlanTable:
    def e(t: RequestTemplate, latency: float, slo: float) -> PlanEntry:
        return plan_entry(t, peak_bytes=10 * GB, pause_bytes=pause_bytes, latency_s=latency, slo_s=slo,
                          latency_source="estimated")
    return plan_table([e(LONG, 100.0, 1000.0), e(SHORT, 5.0, 12.0)], budget_bytes=budget)


def _sim(short_at: float, phases: dict[str, PhaseShares] | None, table: PlanTable | None = None,
         park_overhead_s: float = 0.0) -> dict[str, float]:
    arrivals = [Arrival(t=0.0, template=LONG.shape_key, request_id="L"),
                Arrival(t=short_at, template=SHORT.shape_key, request_id="S")]
    r = simulate(table or _table(), arrivals,
                 SimulationConfig(preemption=True, phases=phases, park_overhead_s=park_overhead_s))
    assert r.preemptions == (1 if r.latency_by_request["S"] < 20 else 0)
    return {k: v.latencies_s[0] for k, v in r.per_template.items()}


def test_a_paused_batch_parks_at_the_step_boundary_its_phases_put_it() -> None:
    got = _sim(30.0, {LONG.shape_key: LONG_SHARES})
    # S waits for L's boundary at 35, runs 35-40; L resumes with 65 s left (state kept on the device)
    assert got[SHORT.shape_key] == pytest.approx(10.0)
    assert got[LONG.shape_key] == pytest.approx(105.0)


def test_a_batch_in_its_last_step_finishes_instead_of_pausing() -> None:
    got = _sim(50.0, {LONG.shape_key: LONG_SHARES})  # L's last step runs 47.5-60, then its tail
    assert got[SHORT.shape_key] == pytest.approx(55.0) and got[LONG.shape_key] == pytest.approx(100.0)


def test_the_dispatcher_sees_no_boundary_after_the_last_step() -> None:
    d: Dispatcher[None] = Dispatcher({k: DispatchPlan.of_entry(e, shares=LONG_SHARES if k == LONG.shape_key else None)
                                      for k, e in _table().entries.items()},
                                     workers=1, wait_window_s=0, preemption=PreemptionPolicy(budget_bytes=48 * GB))
    d.submit(LONG.shape_key, "L", 0.0, key=BatchKey(steps=d.plans[LONG.shape_key].steps))
    d.dispatch(0.0)
    d.submit(SHORT.shape_key, "S", 50.0, key=BatchKey(steps=d.plans[SHORT.shape_key].steps))
    # at 50 L is 2.5 s into its last step: the end of that step is no boundary, so no pause is asked
    assert d.dispatch(50.0) == [] and not d.decisions


def test_an_offloaded_pause_moves_the_state_out_before_the_preemptor_starts_and_back_on_resume() -> None:
    # S's 10 GB and L's 6 GB paused state do not fit 15 GB: the state moves (0.3 s each way at 20 GB/s)
    table = _table(budget=15 * GB, pause_bytes=6 * GB)
    got = _sim(30.0, {LONG.shape_key: LONG_SHARES}, table)
    assert got[SHORT.shape_key] == pytest.approx(10.3)  # boundary at 35, the move out, then 5 s
    assert got[LONG.shape_key] == pytest.approx(105.6)  # resumed at 40.3, the move back, 65 s left
    # the measured pause handshake delays the preemptor (and so the resumed batch) by as much
    got = _sim(30.0, {LONG.shape_key: LONG_SHARES}, table, park_overhead_s=0.2)
    assert got[SHORT.shape_key] == pytest.approx(10.5) and got[LONG.shape_key] == pytest.approx(105.8)


def test_the_dispatcher_predicts_the_wait_for_its_victims_to_park() -> None:
    table = _table(budget=15 * GB, pause_bytes=6 * GB)
    d: Dispatcher[None] = Dispatcher({k: DispatchPlan.of_entry(e, shares=LONG_SHARES if k == LONG.shape_key else None)
                                      for k, e in table.entries.items()},
                                     workers=1, wait_window_s=0, preemption=PreemptionPolicy(budget_bytes=15 * GB))
    d.submit(LONG.shape_key, "L", 0.0, key=BatchKey(steps=d.plans[LONG.shape_key].steps))
    d.dispatch(0.0)
    d.submit(SHORT.shape_key, "S", 30.0, key=BatchKey(steps=d.plans[SHORT.shape_key].steps))
    (a,) = d.dispatch(30.0)
    assert a.preempts[0].offload and a.park_wait_s == pytest.approx(5.0 + 0.3)  # to the boundary at 35, the move out


def test_park_overhead_summary() -> None:
    from xema_ray.serving.group.preemption import ParkOverhead, PreemptionState

    st = PreemptionState()
    assert st.report(True, [], 0).park_overhead is None
    for x in (0.03, 0.01, 0.02, 0.5):
        st.observe_park(x)
    po = st.report(True, [], 0).park_overhead
    assert po is not None and po.total == 4 and po.recent_s == [0.03, 0.01, 0.02, 0.5]
    assert (po.p50_s, po.max_s) == (0.03, 0.5) and po.mean_s == pytest.approx(0.14)
    assert ParkOverhead.of([], 0) is None
