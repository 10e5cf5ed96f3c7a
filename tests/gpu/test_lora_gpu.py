"""GPU check of per-sample LoRA (run by `make gpu-check`; has not run on a GPU yet).

1. tiny-flux2 on CUDA, fp32: a batch of 4 with adapters {A, B, none, A+B} equals each request run
   alone with its adapters merged into the weights by diffusers (as the CPU test), and a request's
   bytes do not depend on its neighbours' adapters at the same batch size.
2. One real-width Flux.2 single block (dim 6144, bf16) with a 4-slot rank-64 pool: the measured
   step time of the block with 4 different adapters vs none, beside the cost model's figure
   (``xema_ray.profiling.lora_cost``), and the pool's bytes against ``torch.cuda``'s allocated bytes.
   Results go to $XEMA_GPU_OUT/lora_gpu.json.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from xema_ray.lora import AdapterPool, AdapterSource, LoraPoolConfig, LoraUse, MultiLoraConfig, apply_multi_lora
from xema_ray.lora.adapter import LoraAdapter, LoraLayer, read_adapter
from xema_ray.lora.pool import adapted_components
from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import ExecutionConfig
from xema_ray.platforms import get_platform
from xema_ray.runtime.engine import ExecutionEngine
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.gpu  # its row in gpu_check/gpu_plan.py: part 2, 40 s expected, lora_gpu.json


def _out() -> Path:
    out = Path(os.environ.get("XEMA_GPU_OUT", "gpu-results"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_batch_of_four_adapters_equals_diffusers_merge_on_cuda(tmp_path: Path) -> None:
    dev = torch.device("cuda")
    spec = get_model_spec("tiny-flux2")
    pipe = spec.build_pipeline(BuildOptions(device="cuda"))
    files = {n: write_adapter(tmp_path / f"{n}.safetensors", pipe.transformer, rank=4, seed=i + 1)
             for i, n in enumerate("AB")}
    comps = adapted_components(pipe)
    pool = AdapterPool(LoraPoolConfig(slots=4, max_rank=8), comps, dev, torch.float32,
                       synchronize=get_platform("cuda").synchronize)
    for n, f in files.items():
        pool.add(read_adapter(AdapterSource(name=n, model="tiny-flux2", path=f), type(pipe), comps, 8, dtype=torch.float32))
    engine = ExecutionEngine(pipe, spec, dev, torch.float32)
    engine.adapters = pool
    t = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)

    def run(prompts: list[str], seeds: list[int], adapters: list[tuple[LoraUse, ...]] | None) -> np.ndarray:
        out = engine.run_pipeline(ExecutionConfig(template=t, batch=len(prompts)), prompts, seeds, steps=t.steps,
                                  adapters=adapters)[0]
        return np.asarray(out.images, dtype=np.float64)

    asks = [[("A", 1.0)], [("B", 0.7)], [], [("A", 0.5), ("B", 1.0)]]
    uses = [tuple(LoraUse(name=n, scale=s) for n, s in a) for a in asks]
    handle = apply_multi_lora(pool, MultiLoraConfig())
    try:
        batched = run([f"p{i}" for i in range(4)], [1, 2, 3, 4], uses)
        other = run(["p0", "x", "y", "z"], [1, 9, 9, 9], [uses[0], (), uses[1], ()])
    finally:
        handle.remove()
    assert np.array_equal(batched[0], other[0])  # neighbours do not change a sample
    weights = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    for i, a in enumerate(asks):
        if a:
            for n, _ in a:
                pipe.load_lora_weights(str(files[n]), adapter_name=n)
            pipe.set_adapters([n for n, _ in a], [s for _, s in a])
            pipe.fuse_lora(adapter_names=[n for n, _ in a])
        try:
            alone = run([f"p{i}"], [i + 1], None)
        finally:
            if a:
                pipe.unfuse_lora()
                pipe.unload_lora_weights()
                pipe.transformer.load_state_dict(weights)
        assert float(np.abs(batched[i] - alone[0]).max()) <= 1e-3  # TF32 off by default in fp32 matmuls


def test_flux2_single_block_with_four_rank64_adapters_vs_none() -> None:
    from diffusers.models.transformers.transformer_flux2 import Flux2SingleTransformerBlock

    from xema_ray.profiling.hardware import get_hardware
    from xema_ray.profiling.lora_cost import lora_step_cost

    dev, dt = torch.device("cuda"), torch.bfloat16
    block = Flux2SingleTransformerBlock(dim=6144, num_attention_heads=48, attention_head_dim=128, mlp_ratio=3.0).to(dev, dt)
    comps = {"transformer": block}
    before = torch.cuda.memory_allocated()
    pool = AdapterPool(LoraPoolConfig(slots=4, max_rank=64), comps, dev, dt)
    pool_bytes = torch.cuda.memory_allocated() - before
    assert pool_bytes == pool.device_bytes
    for s in range(4):
        g = torch.Generator(device="cpu").manual_seed(s)
        pool.add(LoraAdapter(name=f"a{s}", model="flux2", layers={
            p: LoraLayer(torch.randn(64, m.in_features, generator=g).to(dt) * 0.01,
                         torch.randn(m.out_features, 64, generator=g).to(dt) * 0.01, 1.0)
            for p, m in pool.targets.items()}))
    handle = apply_multi_lora(pool, MultiLoraConfig())
    rows, tokens = 1, 4096 + 512
    x = torch.randn(4 * rows, tokens, 6144, device=dev, dtype=dt)
    temb = torch.randn(4 * rows, 6144 * 3, device=dev, dtype=dt)
    rope = (torch.randn(tokens, 128, device=dev), torch.randn(tokens, 128, device=dev))

    def step(uses: list[tuple[LoraUse, ...]] | None) -> float:
        ctx = pool.activate(uses) if uses else torch.no_grad()
        with torch.no_grad(), ctx:
            for _ in range(3):
                block(x, None, temb, rope)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                block(x, None, temb, rope)
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 10

    plain = step(None)
    mixed = step([(LoraUse(name=f"a{i}"),) for i in range(4)])
    handle.remove()
    model = lora_step_cost(block, get_hardware("h200"), rows=4, tokens=tokens, rank=64)
    (_out() / "lora_gpu.json").write_text(json.dumps({
        "gpu": torch.cuda.get_device_name(), "block_plain_s": plain, "block_4_adapters_s": mixed,
        "overhead": mixed / plain - 1, "cost_model_extra_s": model.seconds, "pool_bytes": pool_bytes}, indent=2))
    assert mixed < 2 * plain
