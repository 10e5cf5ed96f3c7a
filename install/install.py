"""``make install``'s torch and extras, chosen for the machine (stdlib only: it runs before torch).

- No NVIDIA GPU (no ``nvidia-smi``, or one that cannot reach a driver), or ``DEVICE=cpu``: exactly
  what ``make install`` always did: ``torch==2.13.0`` (the CPU wheel where pip finds it locally, as
  on CI) and the project with its ``dev`` extra.
- An NVIDIA GPU (``nvidia-smi`` lists one), or ``DEVICE=cuda``: ``torch==2.13.0`` as PyPI ships it
  for Linux x86_64, the CUDA 13.0 build (``TORCH_INDEX`` picks another, e.g.
  https://download.pytorch.org/whl/cu128 for CUDA 12.8), which needs NVIDIA driver >= 580; then the
  project with its ``dev`` and ``sp`` extras (xfuser for sequence parallelism; nvidia-ml-py, the
  GPU topology, is a base dependency); then a check that torch sees the GPU.

A driver older than the build needs stops the install with the versions and what to do, before
anything is installed.

Example:
    python install/install.py --python .venv/bin/python --dry-run     # prints the plan, runs nothing
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

TORCH_VERSION = "2.13.0"
#: the oldest NVIDIA driver each CUDA build of torch runs on (CUDA's release notes, Linux)
MIN_DRIVER = {"13.0": (580, 65), "12.8": (570, 26), "12.6": (560, 28)}
#: CUDA of the build PyPI serves for Linux x86_64 (the default when TORCH_INDEX is not given)
PYPI_CUDA = "13.0"


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str  # as nvidia-smi prints it, e.g. "580.82.07"

    @property
    def driver_version(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.driver.split("."))


@dataclass
class Plan:
    device: str
    commands: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


def detect_gpus(nvidia_smi: str | None = None) -> tuple[list[Gpu], str | None]:
    """The NVIDIA GPUs ``nvidia-smi`` lists, and why none were found (None: it answered)."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if exe is None:
        return [], "no nvidia-smi on PATH"
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi did not run ({e})"
    if out.returncode != 0:
        return [], f"nvidia-smi failed: {(out.stderr or out.stdout).strip().splitlines()[:1]}"
    gpus = []
    for line in out.stdout.strip().splitlines():
        name, _, driver = line.rpartition(",")
        gpu = Gpu(name.strip(), driver.strip())
        try:
            gpu.driver_version  # noqa: B018 — parses, or the answer is not what was asked
            gpus.append(gpu)
        except ValueError:
            return [], f"nvidia-smi answered {line!r}, not 'name, driver_version'"
    return gpus, None if gpus else "nvidia-smi lists no GPU"


def cuda_of_index(index_url: str | None) -> str | None:
    """The CUDA version a torch index serves (PyPI: ``PYPI_CUDA``; .../whl/cu128: 12.8; cpu: None)."""
    if not index_url:
        return PYPI_CUDA
    tail = index_url.rstrip("/").rsplit("/", 1)[-1]
    if tail.startswith("cu") and tail[2:].isdigit():
        return f"{tail[2:-1]}.{tail[-1]}"
    return None


def plan_install(python: str, device: str, gpus: list[Gpu], why_none: str | None,
                 torch_version: str = TORCH_VERSION, index_url: str | None = None) -> Plan:
    """What to run: see the module docstring. ``device``: auto, cpu or cuda."""
    pip = [python, "-m", "pip", "install", "-q"]
    if device not in ("auto", "cpu", "cuda"):
        return Plan(device, error=f"DEVICE must be auto, cpu or cuda, got {device!r}")
    if device == "cpu" or (device == "auto" and not gpus):
        plan = Plan("cpu", [[*pip, f"torch=={torch_version}", *(["--index-url", index_url] if index_url else [])],
                            [*pip, "-e", ".[dev]"]])
        if device == "auto":
            plan.notes.append(f"CPU install: {why_none}")
        return plan
    plan = Plan("cuda")
    cuda = cuda_of_index(index_url)
    if gpus:
        oldest = min(gpus, key=lambda g: g.driver_version)
        plan.notes.append(f"{len(gpus)} GPU(s): {', '.join(sorted({g.name for g in gpus}))}; driver {oldest.driver}")
        need = MIN_DRIVER.get(cuda or "")
        if need is not None and oldest.driver_version[:2] < need:
            return Plan("cuda", notes=plan.notes, error=(
                f"torch {torch_version} for CUDA {cuda} needs NVIDIA driver >= {need[0]}.{need[1]}, this machine has "
                f"{oldest.driver}: update the driver, or install a build for an older CUDA, e.g. "
                "make install TORCH_INDEX=https://download.pytorch.org/whl/cu128 (driver >= 570.26)"))
    else:
        plan.notes.append(f"DEVICE=cuda without a GPU here ({why_none}): torch cannot be checked on one")
    plan.commands = [[*pip, f"torch=={torch_version}", *(["--index-url", index_url] if index_url else [])],
                     [*pip, "-e", ".[dev,sp]"]]
    if gpus:
        plan.commands.append([python, "-c", _CHECK])
    return plan


_CHECK = ("import sys, torch; ok = torch.cuda.is_available(); "
          "print(f'torch {torch.__version__} (CUDA {torch.version.cuda}): ' + "
          "(f'{torch.cuda.device_count()} GPU(s), {torch.cuda.get_device_name(0)}' if ok else 'NO GPU VISIBLE')); "
          "sys.exit(0 if ok else 'torch does not see the GPU: compare its CUDA version above with the driver '"
          "'(nvidia-smi; docs/install-gpu.md)')")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="install/install.py", description=__doc__.splitlines()[0])
    p.add_argument("--python", default=sys.executable, help="the venv's python")
    p.add_argument("--device", default="auto", help="auto (nvidia-smi decides), cpu or cuda")
    p.add_argument("--torch", default=TORCH_VERSION, help="torch version")
    p.add_argument("--index-url", default=None, help="torch's package index (default: PyPI)")
    p.add_argument("--nvidia-smi", default=None, help="the nvidia-smi to ask (default: the one on PATH)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    args = p.parse_args(argv)
    gpus, why = detect_gpus(args.nvidia_smi) if args.device != "cpu" else ([], "DEVICE=cpu")
    plan = plan_install(args.python, args.device, gpus, why, args.torch, args.index_url)
    for note in plan.notes:
        print(f"install: {note}")
    if plan.error is not None:
        print(f"install: ERROR: {plan.error}", file=sys.stderr)
        return 2
    print(f"install: {plan.device}")
    for cmd in plan.commands:
        print("install: $ " + " ".join(cmd if cmd[1] != "-c" else [*cmd[:2], "<check torch sees the GPU>"]))
        if not args.dry_run:
            done = subprocess.run(cmd)
            if done.returncode != 0:
                return done.returncode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
