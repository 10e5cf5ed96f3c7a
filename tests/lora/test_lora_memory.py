"""The adapter pool in the plan's memory: the analyzer's trace, the planner's trace cache and
``xema verify`` count the pool's stacks (exactly the closed form) and the deltas' intermediates."""

from __future__ import annotations

import pytest
import torch

from planner.traces import TraceCache
from xema_ray.analyzer.lora import trace_with_adapters
from xema_ray.analyzer.run import trace_template
from xema_ray.lora.memory import lora_cost
from xema_ray.measure.verify import verify_config
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import ExecutionConfig, LoraPoolConfig
from xema_ray.templates import RequestTemplate

T = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2)
POOL = LoraPoolConfig(slots=4, max_rank=16, max_per_request=2)


def _pool_bytes() -> int:
    pipe = get_model_spec("tiny-flux2").build_pipeline(BuildOptions(device="meta"))
    return lora_cost("tiny-flux2", pipe.transformer, POOL.max_rank, POOL.slots, dtype=torch.float32).pool_bytes


def test_the_trace_holds_the_pool_and_the_deltas_intermediates() -> None:
    t = T.with_(batch=2)
    plain, adapted = trace_template(t), trace_with_adapters(t, POOL)
    assert adapted.resident_bytes() - plain.resident_bytes() == _pool_bytes()
    assert adapted.peak() >= plain.peak() + _pool_bytes()
    assert len(adapted.size) > len(plain.size)  # the gathers and h of every adapted layer, every step
    cache = TraceCache(adapters={"tiny-flux2": POOL})
    assert cache.get(t).resident_bytes() == adapted.resident_bytes()
    assert TraceCache().get(t).resident_bytes() == plain.resident_bytes()


def test_verify_loads_the_pool_and_runs_every_sample_with_adapters() -> None:
    c = ExecutionConfig(template=T, batch=2)
    plain, adapted = verify_config(c, 10**9), verify_config(c, 10**9, adapters=POOL)
    assert plain.error is None and adapted.error is None
    # the stacks are placed at load (with one 512-byte scalar the worst-case adapters are views of)
    assert adapted.load_peak_bytes - plain.load_peak_bytes == _pool_bytes() + 512
    assert adapted.device_peak_bytes >= plain.device_peak_bytes + _pool_bytes()


@pytest.mark.parametrize("model", ["tiny-cogvideox", "tiny-ltx2", "tiny-wan2.2"])
def test_every_linear_layer_of_the_video_models_takes_per_sample_deltas(model: str) -> None:
    """CFG rows (CogVideoX), audio and video streams (LTX-2), two experts (Wan2.2): every linear
    layer's input holds whole samples (rows a multiple of the batch), so the deltas run at batch 2."""
    t = RequestTemplate(model=model, width=64, height=64, frames=9, steps=2, batch=2)
    adapted = trace_with_adapters(t, POOL)
    assert adapted.resident_bytes() > trace_template(t).resident_bytes()


def test_a_two_expert_models_pool_is_planned_per_expert() -> None:
    """Wan2.2 A14B: the pool holds stacks on both experts (as the worker allocates them); one file
    of a pair counts toward its own expert only."""
    from xema_ray.lora.pool import AdapterPool, adapted_components

    pipe = get_model_spec("tiny-wan2.2").build_pipeline(BuildOptions(device="meta"))
    c = lora_cost("tiny-wan2.2", pipe.transformer, POOL.max_rank, POOL.slots, dtype=torch.float32,
                  transformer_2=pipe.transformer_2)
    pool = AdapterPool(POOL, adapted_components(pipe), torch.device("meta"), torch.float32)
    assert c.pool_bytes == pool.device_bytes == sum(c.expert_pool_bytes.values())
    assert set(c.expert_pool_bytes) == {"transformer", "transformer_2"}
    one = lora_cost("tiny-wan2.2", pipe.transformer, POOL.max_rank, POOL.slots, dtype=torch.float32)
    assert one.adapter_bytes == c.expert_adapter_bytes["transformer"] < c.adapter_bytes
    assert one.flop_ratio == c.flop_ratio  # a step runs one expert's deltas
