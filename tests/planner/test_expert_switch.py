"""The expert switch as a planned event: every way of holding two experts priced, one chosen."""

from __future__ import annotations

import pytest

from planner.expert_switch import expert_switch_plans, plan_expert_switch
from xema_ray.plan import ExecutionConfig
from xema_ray.profiling.hardware import get_hardware
from xema_ray.analyzer.run import trace_template
from xema_ray.templates import RequestTemplate

GB = 10**9
A6000 = get_hardware("a6000x8")


@pytest.fixture(scope="module")
def tiny() -> tuple[RequestTemplate, object]:
    t = RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=9, steps=6)
    return t, trace_template(t)


def test_both_experts_held_when_they_fit(tiny) -> None:  # type: ignore[no-untyped-def]
    t, trace = tiny
    p = plan_expert_switch(t, trace, 64 * 2**20, A6000)
    assert p.chosen == "hold_both" and p.cost("hold_both").stall_s == 0


def test_one_expert_swapped_in_with_prefetch_when_both_do_not_fit(tiny) -> None:  # type: ignore[no-untyped-def]
    t, trace = tiny
    both = plan_expert_switch(t, trace, 64 * 2**20, A6000).cost("hold_both").peak_bytes
    hi = plan_expert_switch(t, trace, 64 * 2**20, A6000).experts[0].weight_bytes
    p = plan_expert_switch(t, trace, both - hi // 2, A6000)  # room for half an expert more than one
    assert not p.cost("hold_both").fits
    swap = p.cost("swap_prefetched")
    assert swap.fits and swap.peak_bytes <= both - hi // 2
    assert 0 < swap.prefetch_bytes <= hi  # the low-noise expert (here all of it: the decode sets the peak) comes in before the switch
    assert swap.stall_s < p.cost("offload_whole_expert").stall_s


def test_error_raised_if_no_way_of_holding_the_experts_fits(tiny) -> None:  # type: ignore[no-untyped-def]
    t, trace = tiny
    with pytest.raises(ValueError, match="no way of holding the experts fits"):
        plan_expert_switch(t, trace, 2**20, A6000)


def test_error_raised_if_the_model_has_one_expert() -> None:
    t = RequestTemplate(model="tiny-cogvideox", height=64, width=64, frames=9, steps=4)
    with pytest.raises(ValueError, match="shows 0 experts"):
        plan_expert_switch(t, trace_template(t), GB, A6000)


def test_a14b_720p_on_one_48gb_a6000() -> None:
    t = RequestTemplate(model="wan2.2-t2v-a14b", height=720, width=1280, frames=81, steps=40)
    trace = trace_template(t)
    p = plan_expert_switch(t, trace, 48 * GB, A6000)
    assert not p.cost("hold_both").fits  # 57 GB of experts
    chosen = p.cost(p.chosen)
    assert p.chosen == "swap_prefetched" and chosen.peak_bytes <= 48 * GB
    # one expert and a part of the other fit: a partial prefetch, the rest streamed at the switch
    assert 0 < chosen.prefetch_bytes < p.experts[1].weight_bytes
    assert chosen.latency_s < p.cost("offload_whole_expert").latency_s
    # on 4 GPUs a split over all four runs a request in about a quarter of the time: with an SLO
    # only it meets, it is kept; without one, four replicas give more requests per hour
    (dp,) = expert_switch_plans([t], 48 * GB, A6000, {t.model: 4}, 1, traces={t.key: trace})
    (sp,) = expert_switch_plans([t], 48 * GB, A6000, {t.model: 4}, 1, traces={t.key: trace},
                                slo_of={t.shape_key: chosen.latency_s / 2})
    assert (dp.gpus, dp.replicas) == (1, 4) and (sp.gpus, sp.replicas) == (4, 1)
    assert sp.cost(sp.chosen).latency_s < chosen.latency_s / 3
    # the serving worker runs it (xema verify, meta device): the switch's peak is counted and fits
    from planner.expert_switch import switch_config
    from xema_ray.measure.verify import verify_config

    v = verify_config(switch_config(t, p), 48 * GB, predicted_peak_bytes=chosen.peak_bytes)
    assert v.error is None and v.fits and v.device_peak_bytes <= chosen.peak_bytes
    assert chosen.live_peak_bytes is not None and abs(v.device_peak_bytes - chosen.live_peak_bytes) < 0.01 * GB


def test_a_group_of_gpus_prices_every_split(tiny) -> None:  # type: ignore[no-untyped-def]
    """4 GPUs for tiny-wan2.2 (2 attention heads): SP1 x 4 replicas and SP2 x 2 are priced, the
    best goodput kept (at this size the all-to-alls cost more than the split saves)."""
    t, trace = tiny
    (p,) = expert_switch_plans([t], 64 * 2**20, A6000, {"tiny-wan2.2": 4}, 1, traces={t.key: trace})
    assert (p.gpus, p.replicas) == (1, 4) and [a.split(":")[0] for a in p.alternatives] == ["SP1 x 4", "SP2 x 2"]
    ExecutionConfig(template=t, ulysses=2)  # Wan has a sequence-parallel split


def _denoise_and_whole_peaks(config: ExecutionConfig) -> tuple[int, int]:
    """The serving worker's device bytes on meta (``xema verify``'s run): the most live in the last
    high-noise step, and over the whole request (the VAE decode included). Four steps, as
    verify runs them (the swap makes steps differ, so none are replicated)."""
    from xema_ray.analyzer.steps import steps_to_trace
    from xema_ray.measure.verify import trace_here

    spec = config.template.spec
    steps = steps_to_trace(spec.settling_steps, spec.step_lifetime)
    config = config.model_copy(update={"template": config.template.with_(steps=steps)})
    (tr,) = trace_here(config, (steps,), replay_blocks=False)
    curve = tr.active_curve()
    last_high = config.template.spec.expert_stages(config.template)[0].last_step
    start, end = tr.step_bounds[last_high - 1], tr.step_bounds[last_high]
    return tr.loaded_bytes + int(curve[start:end].max()), tr.loaded_bytes + int(curve.max())


def _allocated_block_bytes(t: RequestTemplate) -> list[int]:
    """Device bytes each DiT block's copy allocates (each tensor rounded as the tracer counts it)."""
    import torch

    from xema_ray.analyzer.tracer import round_size
    from xema_ray.models.loading import build_on_meta

    spec = t.spec
    dit = build_on_meta(spec.transformer_class(), spec.transformer_config, torch.float32)
    return [sum(round_size(x.numel() * x.element_size()) for x in [*b.parameters(), *b.buffers()])
            for _, b in spec.dit_blocks(dit)]


def test_the_worker_runs_the_chosen_switch_and_verify_counts_it(tiny) -> None:  # type: ignore[no-untyped-def]
    """Below the hold-both peak the planner swaps; the table's config for it runs in the serving
    worker (xema verify's meta run), whose counted peak agrees with the planner's and moves with
    the switch: the prefetched low-noise blocks sit on top of the high-noise expert in the last
    high-noise step, and the high-noise blocks that return under the decode go back into the
    slots the load placed (they add nothing to its peak)."""
    from planner.expert_switch import switch_config
    from xema_ray.measure.verify import verify_config
    t, trace = tiny
    budget = plan_expert_switch(t, trace, 64 * 2**20, A6000).cost("hold_both").peak_bytes - 1
    p = plan_expert_switch(t, trace, budget, A6000)
    chosen = p.cost(p.chosen)
    assert p.chosen == "swap_prefetched" and chosen.prefetch_blocks > 0 and chosen.decode_blocks > 0
    config = switch_config(t, p, text_encoder=None)
    v = verify_config(config, budget, predicted_peak_bytes=chosen.peak_bytes)
    assert v.error is None and v.fits and v.device_peak_bytes <= chosen.peak_bytes
    assert chosen.live_peak_bytes is not None
    assert abs(v.device_peak_bytes - chosen.live_peak_bytes) <= 0.03 * chosen.live_peak_bytes
    blocks = _allocated_block_bytes(t)
    assert config.experts is not None
    quiet = config.model_copy(update={"experts": config.experts.model_copy(
        update={"prefetch_blocks": 0, "prefetch_steps": 0, "decode_blocks": 0})})
    (den, whole), (den0, whole0) = _denoise_and_whole_peaks(config), _denoise_and_whole_peaks(quiet)
    assert den - den0 == sum(blocks[:chosen.prefetch_blocks])
    assert whole == whole0


def test_the_arriving_expert_reuses_the_departing_experts_memory_and_the_layout_is_kept(tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The serving worker's own load + execute (meta): the load places one expert's blocks, and
    the request allocates no expert block but the prefetch (the low-noise blocks are copied into
    the memory the high-noise ones leave at the switch, and back at the decode), so the static
    layout holds the activations and the prefetch only; with it the entry fits the budget the
    planner chose the swap for, keeps its layout, and ``xema verify`` replays the worker's stream
    against it with no miss and counts a peak within the budget."""
    from planner.expert_switch import switch_config
    from planner.layouts import attach_layouts
    from xema_ray.allocator.artifact import layouts_dir, load_artifact
    from xema_ray.measure.verify import trace_here, verify_config
    from xema_ray.plan import PlanEntry, PlanPrediction

    t, trace = tiny
    budget = plan_expert_switch(t, trace, 64 * 2**20, A6000).cost("hold_both").peak_bytes - 1
    p = plan_expert_switch(t, trace, budget, A6000)
    chosen = p.cost(p.chosen)
    config = switch_config(t, p, text_encoder=None)
    assert config.experts is not None and config.experts.prefetch_blocks > 0
    blocks = _allocated_block_bytes(t)
    (stream,) = trace_here(config, (t.steps,), replay_blocks=False)
    quiet = config.model_copy(update={"experts": config.experts.model_copy(
        update={"prefetch_blocks": 0, "prefetch_steps": 0})})
    (stream0,) = trace_here(quiet, (t.steps,), replay_blocks=False)
    assert stream.loaded_bytes == stream0.loaded_bytes >= sum(blocks)  # one expert, placed at load
    # the request's live bytes while it denoises: its activations, plus the prefetch alone (never
    # a second expert: the low-noise blocks go where the high-noise ones were)
    def denoise_peak(tr) -> int:  # type: ignore[no-untyped-def]
        return int(tr.active_curve()[:tr.step_bounds[-1]].max())

    assert denoise_peak(stream) - denoise_peak(stream0) == sum(blocks[:config.experts.prefetch_blocks])
    assert denoise_peak(stream0) < sum(blocks)
    entry = PlanEntry(config=config, prediction=PlanPrediction(peak_bytes=chosen.peak_bytes, latency_s=chosen.latency_s,
                                                               goodput_rps=1 / chosen.latency_s, slo_s=1e9,
                                                               latency_source="estimated"))
    table = tmp_path / "plan.json"
    kept = attach_layouts({"k": entry}, table, "any", use_ray=False, budget_bytes=budget)[0]["k"]
    assert kept.config.layout_ref is not None and kept.prediction.peak_bytes <= budget
    art = load_artifact(layouts_dir(table), kept.config.layout_ref)
    assert art.loaded_bytes + art.reserved_bytes <= budget
    v = verify_config(kept.config, budget, predicted_peak_bytes=kept.prediction.peak_bytes, layout=art,
                      layouts_dir=layouts_dir(table))
    assert v.error is None and v.fits and v.layout_misses == 0 and v.device_peak_bytes <= budget


def test_the_host_memory_of_a_swap_is_both_experts_as_the_worker_pins_them(tiny) -> None:  # type: ignore[no-untyped-def]
    """One function of the plan entry (``config_host_bytes``) counts the swap's pinned experts; the
    serving worker's load on meta (xema verify) pins exactly that; a plan that holds both pins none."""
    from planner.expert_switch import switch_config
    from xema_ray.measure.verify import verify_config
    from xema_ray.runtime.host_bytes import config_host_bytes
    from xema_ray.runtime.residency import Residency, block_sizes

    t, trace = tiny
    budget = plan_expert_switch(t, trace, 64 * 2**20, A6000).cost("hold_both").peak_bytes - 1
    swap = switch_config(t, plan_expert_switch(t, trace, budget, A6000), text_encoder=None)
    held = switch_config(t, plan_expert_switch(t, trace, 64 * 2**20, A6000), text_encoder=None)
    assert Residency.of_config(swap).expert_blocks == t.spec.num_dit_blocks and Residency.of_config(held).expert_blocks == 0
    planned = config_host_bytes(swap)
    assert planned.pinned_bytes >= 2 * sum(block_sizes(t.spec)) and config_host_bytes(held).pinned_bytes == 0
    v = verify_config(swap, budget)
    assert v.error is None and v.host is not None
    assert v.host.pinned_bytes == planned.pinned_bytes and v.host.resident_bytes == planned.resident_bytes


@pytest.mark.parametrize(("shift", "expected"), [(None, {4: 3, 16: 11, 40: 26}), (3.0, {4: 2, 16: 5, 40: 13})])
def test_the_switch_step_is_the_batchs_on_the_loaded_scheduler(shift: float | None, expected: dict[int, int]) -> None:
    """The swap places its switch (and the prefetch before it) at the batch's own step count on the
    scheduler the pipeline loaded: the spec's shift 12, or a checkpoint's (the published
    repository's ``flow_shift`` 3.0 switches a 40-step run at step 13, not 26)."""
    from types import SimpleNamespace

    from diffusers import UniPCMultistepScheduler

    from xema_ray.mitigation.expert_swap import high_noise_steps

    t = RequestTemplate(model="wan2.2-t2v-a14b", height=720, width=1280, frames=81, steps=8)
    config = dict(t.spec.scheduler_config) | ({"flow_shift": shift} if shift is not None else {})
    pipe = SimpleNamespace(scheduler=UniPCMultistepScheduler.from_config(config))
    assert {n: high_noise_steps(pipe, t.spec, t.with_(steps=n)) for n in expected} == expected


def test_a_batch_at_another_step_count_switches_at_its_own_step(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A plan made for 6 steps, run by the serving worker (meta) in batches of 4 and of 16 steps
    (the request's, as the API resolved them; the batch's config keeps the template's 6): the
    swap is placed on the batch's step count, not the template's."""
    import xema_ray.mitigation.expert_swap as es
    from planner.expert_switch import switch_config
    from xema_ray.runtime.engine import Batch, GenerationRequest
    from xema_ray.runtime.worker import ModelLoadConfig, Worker

    t, trace = tiny
    budget = plan_expert_switch(t, trace, 64 * 2**20, A6000).cost("hold_both").peak_bytes - 1
    config = switch_config(t, plan_expert_switch(t, trace, budget, A6000), text_encoder=None)
    seen: list[tuple[int, int]] = []
    real = es.high_noise_steps

    def spy(pipe, spec, template):  # type: ignore[no-untyped-def]
        seen.append((template.steps, real(pipe, spec, template)))
        return seen[-1][1]

    monkeypatch.setattr(es, "high_noise_steps", spy)
    worker = Worker(platform="meta")
    try:
        from xema_ray.parallel.groups import ParallelConfig

        worker.init_device(ParallelConfig(rank=0, world_size=1))
        worker.load_model(ModelLoadConfig(model=t.model, plans=(config,)))
        for steps in (4, 16):
            seen.clear()
            worker.execute(Batch(config=config, requests=(GenerationRequest(request_id="r", prompt="a cat", seed=0),),
                                 steps=steps))
            assert seen == [(steps, t.spec.expert_stages(t.with_(steps=steps))[0].steps)]
    finally:
        worker.shutdown()


def test_the_switch_is_priced_on_the_scheduler_of_the_groups_checkpoint(tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A group serving a checkpoint (its ``weights_dir``) runs that checkpoint's scheduler: here a
    ``flow_shift`` of 3.0 instead of the spec's 12, so the high-noise expert runs 2 of 6 steps, not
    4. ``xema plan --deployment`` reads it, and the expert switch is priced on that split (the
    experts' steps, the prefetch within the high-noise steps), not the spec's."""
    import json

    import yaml

    from planner.cli import deployment_scheduler_configs
    from planner.driver import PlanOptions
    from planner.expert_switch import ExpertSwitchFile
    from planner.pipeline import PlanRequest, plan

    t, trace = tiny
    own = dict(t.spec.scheduler_config) | {"flow_shift": 3.0}
    ckpt = tmp_path / "tiny-wan2.2"
    (ckpt / "scheduler").mkdir(parents=True)
    (ckpt / "scheduler" / "scheduler_config.json").write_text(json.dumps(own))
    deployment = tmp_path / "d.yaml"
    deployment.write_text(yaml.safe_dump({"applications": [{"name": "x", "import_path": "deployments.app:app", "args": {
        "models": [{"model": t.model, "workers": 1, "weights_dir": str(ckpt),
                    "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 6}]}]}}]}))
    assert deployment_scheduler_configs(deployment) == {t.model: own}
    assert [(s.first_step, s.last_step) for s in t.spec.expert_stages(t, own)] == [(0, 1), (2, 5)]

    budget = plan_expert_switch(t, trace, 64 * 2**20, A6000).cost("hold_both").peak_bytes - 1
    (spec_priced,) = expert_switch_plans([t], budget, A6000, {}, 1, traces={t.key: trace})
    (own_priced,) = expert_switch_plans([t], budget, A6000, {}, 1, scheduler_config=own)
    assert [(u.first_step, u.last_step) for u in spec_priced.experts] == [(0, 3), (4, 5)]
    assert [(u.first_step, u.last_step) for u in own_priced.experts] == [(0, 1), (2, 5)]
    swap = own_priced.cost("swap_prefetched")
    assert swap.prefetch_blocks > 0 and 1 <= swap.prefetch_steps <= 2
    # the planner's own run: the group's checkpoint scheduler reaches the expert-switch pass
    opts = PlanOptions(hardware="a6000", budget=budget, gpus=1, measure="never", scheduler_configs={t.model: own})
    result = plan(PlanRequest((t,), opts, out=str(tmp_path / "t.json"), layouts=False, use_ray=False))
    assert result.written.experts is not None
    (written,) = ExpertSwitchFile.model_validate_json(result.written.experts.read_text()).plans
    assert [(u.first_step, u.last_step) for u in written.experts] == [(0, 1), (2, 5)]
