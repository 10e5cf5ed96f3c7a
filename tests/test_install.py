"""``make install``'s choice of torch (install/install.py) without a GPU: a fake ``nvidia-smi`` on
PATH stands for the machine, ``--dry-run`` prints the plan. CPU stays exactly what it was (CI)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "install" / "install.py"


def _fake_smi(bin_dir: Path, lines: list[str], code: int = 0) -> None:
    """An ``nvidia-smi`` answering ``--query-gpu=name,driver_version`` with ``lines`` (exit ``code``)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    body = "\n".join(f"echo '{line}'" for line in lines)
    exe.write_text(f"#!/bin/sh\n{body}\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def _install(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(SCRIPT), "--python", "PY", "--dry-run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def _commands(out: str) -> list[str]:
    return [line.removeprefix("install: $ ") for line in out.splitlines() if line.startswith("install: $ ")]


CPU = ["PY -m pip install -q torch==2.13.0", "PY -m pip install -q -e .[dev]"]


def test_no_gpu_installs_what_make_install_always_did(tmp_path: Path) -> None:
    done = _install(tmp_path / "bin")  # no nvidia-smi on PATH
    assert done.returncode == 0, done.stderr
    assert _commands(done.stdout) == CPU and "CPU install: no nvidia-smi on PATH" in done.stdout


def test_nvidia_smi_without_a_driver_is_a_cpu_machine(tmp_path: Path) -> None:
    _fake_smi(tmp_path / "bin", ["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."], code=9)
    done = _install(tmp_path / "bin")
    assert done.returncode == 0 and _commands(done.stdout) == CPU and "nvidia-smi failed" in done.stdout


def test_a_gpu_gets_the_cuda_torch_the_sp_extra_and_a_check(tmp_path: Path) -> None:
    _fake_smi(tmp_path / "bin", ["NVIDIA RTX A6000, 580.82.07"] * 8)
    done = _install(tmp_path / "bin")
    assert done.returncode == 0, done.stderr
    assert _commands(done.stdout) == ["PY -m pip install -q torch==2.13.0", "PY -m pip install -q -e .[dev,sp]",
                                      "PY -c <check torch sees the GPU>"]
    assert "8 GPU(s): NVIDIA RTX A6000; driver 580.82.07" in done.stdout
    # DEVICE=cpu keeps a GPU machine on the CPU install
    assert _commands(_install(tmp_path / "bin", "--device", "cpu").stdout) == CPU


def test_error_raised_if_the_driver_is_older_than_the_cuda_build(tmp_path: Path) -> None:
    _fake_smi(tmp_path / "bin", ["NVIDIA RTX A6000, 535.183.01"])
    done = _install(tmp_path / "bin")
    assert done.returncode == 2 and not _commands(done.stdout)
    assert ("torch 2.13.0 for CUDA 13.0 needs NVIDIA driver >= 580.65, this machine has 535.183.01" in done.stderr
            and "TORCH_INDEX=https://download.pytorch.org/whl/cu128" in done.stderr)
    # a CUDA 12.8 build needs 570.26: still too old here; a 570 driver takes it
    assert _install(tmp_path / "bin", "--index-url", "https://download.pytorch.org/whl/cu128").returncode == 2
    _fake_smi(tmp_path / "bin", ["NVIDIA RTX A6000, 570.86.10"])
    done = _install(tmp_path / "bin", "--index-url", "https://download.pytorch.org/whl/cu128")
    assert done.returncode == 0 and _commands(done.stdout)[0].endswith(
        "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_make_passes_device_and_index_to_the_script(device: str) -> None:
    done = subprocess.run(["make", "-n", "-B", "install", f"DEVICE={device}", "TORCH_INDEX=https://example/whl/cu128"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (f"install/install.py --python .venv/bin/python --device {device} --index-url https://example/whl/cu128"
            in done.stdout)
