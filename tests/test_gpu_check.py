"""`make gpu-check` on a machine without CUDA: exits 0 and says so in its JSON (nothing faked, nothing run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu-check runs the GPU tests instead")
def test_gpu_check_without_cuda_exits_0_with_a_no_gpu_record(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert summary["cuda"] is False and "no CUDA GPU" in summary["skipped"]
