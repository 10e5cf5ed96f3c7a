"""The fixed-budget step cache (``xema_ray.mitigation.step_cache``): the schedule scales with the
step count, a mask of all ones is bitwise lossless, a reused step skips the transformer, removing
the primitive restores the pipeline, and a two-expert model's cache resets at the switch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.mitigation.conftest import run_pipeline
from xema_ray.mitigation.step_cache import DENOISERS, StepCacheConfig, apply, apply_step_cache, cached_output_bytes
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.tier_plan import StepCacheSchedule

pytestmark = pytest.mark.usefixtures("no_onednn")  # tests/mitigation/conftest.py


def _pipe(model: str) -> Any:
    torch.manual_seed(0)
    return get_model_spec(model).build_pipeline(BuildOptions())


def _counted(pipe: Any) -> list[int]:
    """Runs of the first DiT block of each denoiser (a reused step runs none)."""
    calls: list[int] = []
    spec_blocks = get_model_spec("tiny-flux2").dit_blocks
    for name in DENOISERS:
        if getattr(pipe, name, None) is not None:
            spec_blocks(getattr(pipe, name))[0][1].register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize(("steps", "computed"), [(2, 2), (3, 3), (4, 3), (10, 4), (28, 8), (50, 14), (100, 28)])
def test_schedule_is_a_fraction_of_the_steps(steps: int, computed: int) -> None:
    s = StepCacheSchedule()
    mask = s.mask(steps)
    assert len(mask) == steps and sum(mask) == computed
    assert mask[0] == 1 and mask[-1] == 1  # warm-up first, the final step computed


def test_schedule_restarts_its_warmup_at_each_reset() -> None:
    s = StepCacheSchedule(warmup=0.0, min_warmup=2, compute_every=3, final=1)
    assert s.mask(10, resets=(5,)) == (1, 1, 0, 0, 1) + (1, 1, 0, 0, 1)
    assert s.mask(10, resets=(0, 10, 5, 5)) == s.mask(10, resets=(5,))  # out-of-range and repeated ignored


def test_error_raised_if_mask_does_not_compute_its_first_step() -> None:
    with pytest.raises(ValidationError, match="first step"):
        StepCacheConfig(mask=(0, 1))
    with pytest.raises(ValidationError, match="0 and 1"):
        StepCacheConfig(mask=(1, 2))


def test_all_ones_mask_is_bitwise_lossless_and_removable() -> None:
    pipe = _pipe("tiny-flux2")
    ref = run_pipeline(pipe, "tiny-flux2")
    with apply(pipe, get_model_spec("tiny-flux2"), StepCacheConfig(mask=(1, 1))):
        same = run_pipeline(pipe, "tiny-flux2")
    assert torch.equal(ref, same)
    assert torch.equal(ref, run_pipeline(pipe, "tiny-flux2"))


def test_reused_step_skips_the_transformer_and_removal_restores() -> None:
    model = "tiny-flux2"
    pipe = _pipe(model)
    ref = run_pipeline(pipe, model)  # 2 steps
    calls = _counted(pipe)
    handle, state = apply_step_cache([pipe.transformer], StepCacheConfig(mask=(1, 0)))
    try:
        cached = run_pipeline(pipe, model)
    finally:
        handle.remove()
    assert len(calls) == 1 and (state.computed, state.reused) == (1, 1)
    assert not torch.equal(ref, cached) and torch.isfinite(cached).all()
    assert state.cached == {}  # removed: the cached outputs are dropped
    assert torch.equal(ref, run_pipeline(pipe, model))


class _Expert(torch.nn.Module):
    """A stand-in denoiser that takes ``timestep`` as the pipelines' transformers do."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.calls = 0

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.scale + timestep


def test_passes_of_a_step_are_cached_per_pass() -> None:
    """A CFG pair run as two calls (Wan, Qwen-Image): each pass reuses its own output."""
    m = _Expert(2.0)
    handle, state = apply_step_cache([m], StepCacheConfig(mask=(1, 0)))
    with handle:
        x_cond, x_uncond = torch.ones(1), torch.zeros(1)
        t0, t1 = torch.tensor([0.0]), torch.tensor([1.0])
        first = (m(x_cond, timestep=t0), m(x_uncond, timestep=t0))
        second = (m(x_cond, timestep=t1), m(x_uncond, timestep=t1))
    assert m.calls == 2 and (state.computed, state.reused) == (2, 2)
    assert torch.equal(second[0], first[0]) and torch.equal(second[1], first[1])
    assert not torch.equal(first[0], first[1])


def test_expert_switch_resets_the_cache() -> None:
    """Two experts share one state: the second expert's first step computes and the first
    expert's outputs are dropped."""
    a, b = _Expert(2.0), _Expert(3.0)
    handle, state = apply_step_cache([a, b], StepCacheConfig(mask=StepCacheSchedule(
        warmup=0.0, min_warmup=1, compute_every=2, final=0).mask(4, resets=(2,))))
    assert state.mask == (1, 0, 1, 0)
    x = torch.ones(1)
    with handle:
        outs = [m(x, timestep=torch.tensor([float(i)])) for i, m in enumerate((a, a, b, b))]
    assert (a.calls, b.calls) == (1, 1)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[3], outs[2]) and not torch.equal(outs[2], outs[0])


def test_cached_output_bytes_counts_every_pass() -> None:
    spec = get_model_spec("tiny-flux2")
    assert cached_output_bytes(spec, latent_elements=1000, rows=2, itemsize=4) == 2 * 1000 * 4 * sum(
        spec.transformer_passes_per_step())


@pytest.mark.parametrize(("model", "frames", "computed"), [
    ("tiny-flux2", 1, 4), ("tiny-qwen-image", 1, 4), ("tiny-cogvideox", 9, 4),
    ("tiny-ltx2", 9, 4),  # CFG, STG and modality passes of different batches in one step
    ("tiny-wan2.2", 9, None),  # two experts: the warm-up restarts at the switch
])
def test_every_family_runs_the_fast_tier_through_the_engine(model: str, frames: int, computed: int | None) -> None:
    from xema_ray.plan import ExecutionConfig
    from xema_ray.runtime.engine import Batch, ExecutionEngine, GenerationRequest
    from xema_ray.templates import RequestTemplate

    spec = get_model_spec(model)
    engine = ExecutionEngine(_pipe(model), spec, torch.device("cpu"), torch.float32)
    t = RequestTemplate(model=model, height=64, width=64, frames=frames, steps=8)
    req = (GenerationRequest(request_id="r", prompt="a cat", seed=1),)
    lossless = engine.execute(Batch(config=ExecutionConfig(template=t), requests=req, steps=8))
    fast = engine.execute(Batch(config=ExecutionConfig(template=t, step_cache=StepCacheSchedule()), requests=req,
                                steps=8))
    if computed is None:  # each expert stage computes its own warm-up: more than one stage of 8 would
        stages = spec.expert_stages(t, engine.pipe.scheduler.config)
        assert len(stages) == 2
        computed = StepCacheSchedule().computed_steps(8, (stages[1].first_step,))
        assert computed > StepCacheSchedule().computed_steps(8)
    assert (lossless.steps_computed, fast.steps_computed) == (8, computed)
    assert fast.outputs[0].data != lossless.outputs[0].data
    again = engine.execute(Batch(config=ExecutionConfig(template=t), requests=req, steps=8))
    assert again.outputs[0].data == lossless.outputs[0].data  # the cache left nothing behind
