"""GPU check of the static allocator (run by `make gpu-check`): the same request under PyTorch's
caching allocator, under expandable segments and under libxema_alloc with a plan solved from a
recorded run, each in its own process (the allocator is process-wide and chosen before CUDA
initializes). Ours must serve every planned allocation from the plan, reserve at most 2% above
its active peak, produce bitwise the default allocator's output, and keep per-step latency within
1%. Reports land in $OUT (or out/) as allocator_gpu_<workload>.json.

Workloads: a self-contained DiT stack, and the real CogVideoX-5B (720×480×49) and Flux.2 (1024²)
pipelines with random bf16 weights (Flux.2 needs ~80 GB of GPU memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WORKER = Path(__file__).with_name("gpu_alloc_worker.py")
REPO = Path(__file__).resolve().parents[2]

WORKLOADS = [
    pytest.param("dit", 600, id="dit"),
    pytest.param("cogvideox-5b:720x480x49:4", 1200, id="cogvideox-5b-720x480x49"),
    pytest.param("flux2:1024x1024x1:4", 1200, id="flux2-1024"),
]


def run_worker(mode: str, workload: str, out: Path, timeout: int) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--mode", mode, "--workload", workload, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(f"{mode} worker for {workload} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize(("workload", "timeout"), WORKLOADS)
def test_static_allocator_against_the_caching_allocator(workload: str, timeout: int, tmp_path: Path) -> None:
    results = {mode: run_worker(mode, workload, tmp_path / f"{mode}.json", timeout) for mode in ("default", "expandable", "static")}
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    name = workload.replace(":", "_")
    (out / f"allocator_gpu_{name}.json").write_text(json.dumps(results, indent=1))

    ours, default = results["static"], results["default"]
    assert ours["planned_misses"] == 0 and not ours["fell_back"]
    assert ours["planned_hits"] == ours["plan_length"] > 0
    assert ours["peak_reserved_bytes"] / ours["peak_active_bytes"] <= 1.02
    assert ours["output_sha256"] == default["output_sha256"]
    assert ours["step_seconds_median"] <= 1.01 * default["step_seconds_median"]


def test_install_refuses_after_cuda_initialized() -> None:
    code = (
        "import torch; torch.zeros(1, device='cuda');"
        "from xema_ray.runtime.allocator import install_cuda_allocator\n"
        "try:\n    install_cuda_allocator()\nexcept RuntimeError as e:\n    print('refused', e)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "refused" in proc.stdout, proc.stdout + proc.stderr


def test_teardown_with_live_tensors_does_not_crash() -> None:
    """Tensors still alive at interpreter exit are freed after everything else is torn down."""
    code = (
        "from xema_ray.runtime.allocator import install_cuda_allocator\n"
        "import numpy as np, torch\n"
        "from xema_ray.layout import solve_arrays\n"
        "alloc = install_cuda_allocator()\n"
        "layout = solve_arrays(np.array([4096, 4096]), np.array([0, 1]), np.array([3, 3]))\n"
        "alloc.reserve(layout.reserved_bytes, 1 << 20)\n"
        "with alloc.armed(layout.replay_plan()) as r:\n"
        "    keep = [torch.empty(4096, dtype=torch.uint8, device='cuda') for _ in range(2)]\n"
        "assert r.hits == 2, r\n"
        "print('ok', flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
