"""The four planner stages on the synthetic model (tests/planner/synthetic.py), with known answers."""

from __future__ import annotations

import json

import pytest

from planner.stages import (
    CountingModel,
    StageLog,
    factors,
    goodput,
    plan_template,
    resolve,
    sp_split,
    stage1,
    stage4,
    with_actions,
)
from planner.model import Rejection
from tests.planner.synthetic import GB, Synthetic
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.templates import RequestTemplate

T = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=4)


def cfg(**kw) -> ExecutionConfig:  # type: ignore[no-untyped-def]
    return ExecutionConfig(template=T, **kw)


def test_factors_and_sp_split() -> None:
    assert factors(8) == [1, 2, 4, 8]
    assert sp_split(4, heads=48) == (4, 1)
    assert sp_split(4, heads=2) == (2, 2)  # tiny models have 2 heads: the rest goes to ring
    with pytest.raises(ValueError):
        factors(0)


def test_memory_rule_prunes_and_stops_the_batch() -> None:
    # weights 43 GB, 3 offloadable -> 40 GB; the DiT needs 6·bs/4 GB with full chunking, so with
    # a 44 GB budget BS <= 2 fits and BS3 (44.5 GB) is pruned; BS4 is never tried
    m = CountingModel(Synthetic(W=43 * GB, V=1 * GB))
    log = StageLog()
    out = stage1(m, T, gpus=1, budget=44 * GB, slo_s=None, max_batch=8, log=log)
    assert [c.batch for c in out] == [1, 2]
    assert log.pruned_memory == ["SP1 DP1 BS3"]
    assert not any('"batch":4' in k for k in m.counter.analysed)


def test_slo_rule_prunes_and_stops_the_batch() -> None:
    m = CountingModel(Synthetic(W=1 * GB))
    log = StageLog()
    out = stage1(m, T, gpus=1, budget=100 * GB, slo_s=25.0, max_batch=8, log=log)
    assert [c.batch for c in out] == [1, 2, 3]  # BS4 takes 10·4^0.7 = 26.4 s > 25 s
    assert log.pruned_slo == ["SP1 DP1 BS4"]
    # the SLO rule runs first: a batch too slow for the SLO is never analysed (never traced)
    assert not any('"batch":4' in k for k in m.counter.analysed)


def test_stage3_prefers_zero_overhead_offload() -> None:
    # 41 GB weights + 6 GB DiT > 46.5: offloading one block (free) is enough
    m = CountingModel(Synthetic(W=41 * GB, V=1 * GB))
    out = resolve(m, cfg(), budget=int(46.5 * GB), log=StageLog())
    assert out is not None and out.mitigations == (Mitigation(kind="block_offload", blocks=(0,), intensity=1),)


def test_stage3_picks_lowest_latency_feasible_option() -> None:
    # need 3 GB off the DiT interval: offload 3 blocks costs 4 s, dit chunking x2 costs 1 s -> chunking
    m = CountingModel(Synthetic(W=40 * GB, V=1 * GB, offload_free=0))
    out = resolve(m, cfg(), budget=43 * GB, log=StageLog())
    assert out is not None
    assert [x.kind for x in out.mitigations] == ["dit_chunking"] and out.mitigations[0].intensity == 2


def test_stage3_handles_each_interval_and_reports_infeasible() -> None:
    m = CountingModel(Synthetic(W=40 * GB, offload_free=0))
    out = resolve(m, cfg(batch=2), budget=46 * GB, log=StageLog())
    assert out is not None
    kinds = sorted(x.kind for x in out.mitigations)
    assert kinds == ["dit_chunking", "vae_chunking"] or "temporary_serialization" in kinds
    log = StageLog()
    assert resolve(m, cfg(), budget=30 * GB, log=log) is None
    assert log.infeasible == ["SP1 DP1 BS1"]


def test_with_actions_replaces_offload_of_the_same_kind() -> None:
    c = with_actions(cfg(), (Mitigation(kind="block_offload", blocks=(0,), intensity=1),))
    c = with_actions(c, (Mitigation(kind="block_offload", blocks=(0, 1), intensity=2),))
    assert [m.intensity for m in c.mitigations] == [2]


def test_goodput_and_stage4_ranking() -> None:
    c = cfg(dp=2, batch=2)
    assert goodput(c, latency=20.0, slo_s=30.0) == pytest.approx(0.2)
    assert goodput(c, latency=40.0, slo_s=30.0) == 0.0
    m = CountingModel(Synthetic(W=1 * GB))
    ranked = stage4(m, [cfg(batch=1), cfg(batch=2), cfg(batch=4)], budget=100 * GB, slo_s=25.0)
    assert [s.config.batch for s in ranked] == [2, 1, 4]  # BS4 misses the SLO; BS2 has the best goodput


def test_plan_template_uses_2_5x_best_latency_as_slo() -> None:
    plan = plan_template(Synthetic(W=1 * GB, comm=100.0), T, gpus=1, budget=100 * GB, max_batch=4)
    assert plan.slo_s == pytest.approx(25.0)  # best feasible latency 10 s at BS1
    assert plan.entry is not None and plan.entry.config.batch == 3  # BS4 misses the SLO
    assert plan.entry.prediction.goodput_rps == pytest.approx(3 / (10 * 3**0.7))
    assert plan.entry.runner_up and "SLO" not in plan.entry.runner_up


class _UnderPredicting(Synthetic):
    """A model whose analytic memory is 1 GB optimistic: the traced confirmation sees the truth."""

    def confirm(self, config: ExecutionConfig, budget: int) -> Rejection | None:
        if not config.mitigations:
            return None
        true_peak = self.memory(config, budget).peak_bytes + GB
        return Rejection("over", overshoot_bytes=true_peak - budget) if true_peak > budget else None


def test_a_rejected_choice_is_resolved_again_with_the_overshoot_not_dropped() -> None:
    # 41 GB weights, budget 46.5 GB: the search offloads 1 block (free) but the trace says that
    # peaks 0.5 GB over; the same SP/batch is resolved again with ~1 GB less budget
    model = _UnderPredicting(W=41 * GB, V=1 * GB)
    plan = plan_template(model, T, gpus=1, budget=int(46.5 * GB), max_batch=1, slo_s=1e6)
    assert plan.entry is not None
    chosen = plan.entry.config
    assert chosen.sp == 1 and chosen.batch == 1
    first_choice = (Mitigation(kind="block_offload", blocks=(0,), intensity=1),)
    assert chosen.mitigations and chosen.mitigations != first_choice
    assert model.confirm(chosen, int(46.5 * GB)) is None
    assert any("over" in line for line in plan.log.infeasible)


def test_stage3_combines_options_when_no_single_one_clears_an_interval() -> None:
    # VAE interval: 44 + 12 GB over a 46.5 GB budget; offloading all 3 blocks leaves 53 GB and
    # VAE chunking x4 leaves 47 GB: only the two together fit (41 + 3 GB)
    m = CountingModel(Synthetic(W=44 * GB, A=1 * GB, V=12 * GB))
    out = resolve(m, cfg(), budget=int(46.5 * GB), log=StageLog())
    assert out is not None
    assert {x.kind for x in out.mitigations} == {"block_offload", "vae_chunking"}
    assert m.memory(out, int(46.5 * GB)).fits


def test_stage3_profiles_only_the_mildest_clearing_option_of_each_family() -> None:
    # DiT interval 44 + 6 = 50 GB over 46.5: offload needs 4 of 8 blocks (memory falls, latency
    # rises with the count), so offloading 5..8 is never worth a profile
    m = CountingModel(Synthetic(W=44 * GB, A=6 * GB, V=1 * GB, n_blocks=8, offload_free=0))
    out = resolve(m, cfg(), budget=int(46.5 * GB), log=StageLog())
    assert out is not None and m.memory(out, int(46.5 * GB)).fits
    # (the synthetic model has more blocks than the tiny template, so read the raw JSON)
    profiled = [json.loads(k)["mitigations"] for k in m.counter.profiled]
    offload_alone = [ms for ms in profiled if [x["kind"] for x in ms] == ["block_offload"]]
    assert [ms[0]["intensity"] for ms in offload_alone] == [4]


def test_stage3_pairs_a_weak_activation_option_with_fewer_offloaded_blocks() -> None:
    # alone: offload 6 blocks (cost 12) or chunk x4 (cost 12); chunk x2 leaves 48 GB, and then
    # 2 offloaded blocks suffice: 6 + 4 = 10 beats both
    m = CountingModel(Synthetic(W=44 * GB, A=8 * GB, V=1 * GB, n_blocks=8, offload_free=0, chunk_cost=3.0))
    out = resolve(m, cfg(), budget=int(46.5 * GB), log=StageLog())
    assert out is not None
    assert sorted((x.kind, x.intensity) for x in out.mitigations) == [("block_offload", 2), ("dit_chunking", 2)]
    assert m.latency(out) == pytest.approx(10.0 + 10.0)  # base 10 s + 6 + 4


class CoarseLadder(Synthetic):
    """Offers offload of 2, 5 or 8 blocks only, and refines a choice block by block."""

    def options(self, cfg, interval):  # type: ignore[no-untyped-def]
        return [o for o in super().options(cfg, interval)
                if o.actions[0].kind != "block_offload" or o.actions[0].intensity in (2, 5, 8)]

    def milder(self, cfg: ExecutionConfig, action: Mitigation) -> list[Mitigation]:
        return [Mitigation(kind=action.kind, blocks=tuple(range(k)), intensity=k)
                for k in range(action.intensity - 1, 0, -1)]


def test_stage3_takes_a_coarse_rung_down_to_the_blocks_needed() -> None:
    # 4 offloaded blocks are needed; the ladder's first rung that clears is 5
    m = CountingModel(CoarseLadder(W=44 * GB, A=6 * GB, V=1 * GB, n_blocks=8, offload_free=0, chunk_cost=9.0))
    out = resolve(m, cfg(), budget=int(46.5 * GB), log=StageLog())
    assert out is not None
    assert [(x.kind, x.intensity) for x in out.mitigations] == [("block_offload", 4)]


def test_stage3_prefers_one_option_that_clears_every_interval_to_a_costlier_sum_of_local_ones() -> None:
    # DiT interval 44 + 5 GB, VAE interval 44 + 4 GB, budget 46.5. Greedy per interval: chunk the
    # DiT x2 (cost 2, cheaper than offloading 3 blocks: 2.4), then offload 2 blocks for the VAE
    # (1.6): 3.6 in all. Offloading 3 blocks clears both intervals alone for 2.4.
    m = CountingModel(Synthetic(W=44 * GB, A=5 * GB, V=4 * GB, n_blocks=8, offload_free=0,
                                offload_cost=0.8, chunk_cost=1.0))
    out = resolve(m, cfg(), budget=int(46.5 * GB), log=StageLog())
    assert out is not None and m.memory(out, int(46.5 * GB)).fits
    assert [(x.kind, x.intensity) for x in out.mitigations] == [("block_offload", 3)]
