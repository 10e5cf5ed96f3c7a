"""Per-sample LoRA: one batch of 4 with adapters {A, B, none, A+B} equals each request run alone
with its adapters merged into the weights by diffusers (``load_lora_weights`` + ``fuse_lora``),
fp32 on CPU; the base weights are never touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from xema_ray.lora import AdapterPool, AdapterSource, LoraPoolConfig, LoraUse, MultiLoraConfig, apply_multi_lora
from xema_ray.lora.adapter import read_adapter
from xema_ray.lora.layers import lora_delta_
from xema_ray.lora.pool import adapted_components
from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.engine import Batch, ExecutionEngine, GenerationRequest
from xema_ray.templates import RequestTemplate

#: fp32 on CPU: the batched delta ((x A^T) B^T, per row) and the merged weight (W + B A) round
#: differently; over 2 steps and the VAE the images (in [0, 1]) agree to this
ATOL = 2e-4


@pytest.fixture(scope="module")
def flux() -> dict[str, Any]:
    spec = get_model_spec("tiny-flux2")
    pipe = spec.build_pipeline(BuildOptions())
    return {"spec": spec, "pipe": pipe}


def _run(pipe: Any, spec: Any, prompts: list[str], seeds: list[int], adapters: Any = None,
         pool: AdapterPool | None = None) -> np.ndarray:
    engine = ExecutionEngine(pipe, spec, torch.device("cpu"), torch.float32)
    engine.adapters = pool
    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2)
    out = engine.run_pipeline(ExecutionConfig(template=t, batch=len(prompts)), prompts, seeds, steps=t.steps,
                              adapters=adapters)[0]
    return np.asarray(out.images, dtype=np.float64)


def test_batch_of_four_with_different_adapters_equals_each_merged(flux: dict[str, Any], tmp_path: Path) -> None:
    pipe, spec = flux["pipe"], flux["spec"]
    files = {"A": write_adapter(tmp_path / "a.safetensors", pipe.transformer, rank=4, seed=1, alpha=8.0),
             "B": write_adapter(tmp_path / "b.safetensors", pipe.transformer, rank=8, seed=2, layout="peft")}
    weights = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    pool = AdapterPool(LoraPoolConfig(slots=4, max_rank=8), adapted_components(pipe), torch.device("cpu"), torch.float32)
    for name, f in files.items():
        pool.add(read_adapter(AdapterSource(name=name, model="tiny-flux2", path=f), type(pipe),
                              adapted_components(pipe), max_rank=8))
    requests = [("a fox", 1, [("A", 1.0)]), ("a cat", 2, [("B", 0.7)]), ("a dog", 3, []),
                ("an owl", 4, [("A", 0.5), ("B", 1.0)])]
    handle = apply_multi_lora(pool, MultiLoraConfig())
    try:
        batched = _run(pipe, spec, [r[0] for r in requests], [r[1] for r in requests],
                       [tuple(LoraUse(name=n, scale=s) for n, s in r[2]) for r in requests], pool)
    finally:
        handle.remove()
    for n, p in pipe.transformer.named_parameters():  # never merged, never unmerged
        assert torch.equal(p, weights[n]), n
    for i, (prompt, seed, uses) in enumerate(requests):
        if uses:  # the reference: diffusers merges the adapters into the weights
            for name, _ in uses:
                pipe.load_lora_weights(str(files[name]), adapter_name=name)
            pipe.set_adapters([n for n, _ in uses], [s for _, s in uses])
            pipe.fuse_lora(adapter_names=[n for n, _ in uses])
        try:
            alone = _run(pipe, spec, [prompt], [seed])
        finally:
            if uses:  # diffusers' unmerge rounds (W + BA - BA != W): put the exact weights back
                pipe.unfuse_lora()
                pipe.unload_lora_weights()
                pipe.transformer.load_state_dict(weights)
        diff = float(np.abs(batched[i] - alone[0]).max())
        assert diff <= ATOL, f"request {i} ({uses}): max |batched - merged| = {diff}"
        if uses:  # the adapter changed the picture: the comparison is not vacuous
            plain = _run(pipe, spec, [prompt], [seed])
            assert float(np.abs(plain[0] - alone[0]).max()) > 100 * ATOL


def test_cfg_rows_share_their_samples_adapters() -> None:
    """Rows [uncond; cond] of 2 samples: row r uses sample r % 2's adapters."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, 8, generator=g)  # 3 slots, rank 4, in 8
    b = torch.randn(3, 6, 4, generator=g)  # out 6
    x = torch.randn(4, 5, 8, generator=g)
    slots = torch.tensor([[0, 2], [1, 0]])
    scales = torch.tensor([[1.0, 0.5], [2.0, 0.0]])
    out = lora_delta_(torch.zeros(4, 5, 6), x, a, b, slots, scales)
    for r in range(4):
        s = r % 2
        want = sum(scales[s, j] * (x[r] @ a[slots[s, j]].T) @ b[slots[s, j]].T for j in range(2))
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple"):
        lora_delta_(torch.zeros(3, 5, 6), x[:3], a, b, slots, scales)
