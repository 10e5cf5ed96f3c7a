"""GPU half of the SP tests (``make gpu-check``): the same SP = 2 vs SP = 1 comparison over NCCL,
with xfuser's USP when it is installed, and the CUDA platform's NVML fingerprint."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from sp_harness import run_worker_set


def gpu_sp_scenario(rank: int, world: int, url: str) -> dict[str, Any]:
    from xema_ray.parallel import ParallelConfig
    from xema_ray.plan import ExecutionConfig
    from xema_ray.runtime import ModelLoadConfig, Worker
    from xema_ray.templates import RequestTemplate

    worker = Worker(platform="cuda")
    worker.init_device(ParallelConfig(rank=rank, world_size=world, init_method=url, timeout_s=120), local_index=rank)
    worker.load_model(ModelLoadConfig(model="tiny-flux2", dtype="bfloat16"))
    assert worker.engine is not None
    template = RequestTemplate(model="tiny-flux2", height=128, width=128, steps=2)
    outs = {}
    for name, u, r in [("sp1", 1, 1), ("ulysses2", 2, 1), ("ring2", 1, 2)]:
        out = worker.engine.run_pipeline(ExecutionConfig(template=template, ulysses=u, ring=r), ["a fox"], [3],
                                         steps=template.steps).output
        outs[name] = np.asarray(out.images, dtype=np.float64)
    worker.shutdown()
    return outs


@pytest.mark.gpu
def test_sp2_matches_sp1_over_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for outs in run_worker_set(gpu_sp_scenario, 2):
        for name in ("ulysses2", "ring2"):
            # bf16: reductions reorder across ranks, so a looser bound than the fp32 CPU test
            np.testing.assert_allclose(outs[name], outs["sp1"], atol=3e-2)


@pytest.mark.gpu
def test_cuda_fingerprint_names_the_gpu() -> None:
    from xema_ray.platforms import get_platform

    cuda = get_platform("cuda")
    assert cuda.dist_backend == "nccl"
    assert cuda.hardware_fingerprint().startswith("cuda-")
    assert cuda.hardware_name()
