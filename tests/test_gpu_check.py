"""`make gpu-check` without a GPU (issue #24): the "no CUDA GPU" record; and a rehearsal of the
GPU machine's run on CPU. The dry run collects the GPU tests with every package the GPU machine
lacks made unimportable (ray, fastapi, redis, xfuser, openai, locust, schemathesis and the rest:
installed here, absent from gpu_check/gpu_device_packages.txt and not in the kit, gpu_check/gpu-kit.txt);
planted tests that crash (SIGSEGV), hang (with a child process), fail and pass are each recorded
as such, in their own process, while the others still report."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "gpu_check" / "run.py"


def _part_budget_s() -> float:
    spec = importlib.util.spec_from_file_location("gpu_plan", ROOT / "gpu_check" / "gpu_plan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return float(module.PART_BUDGET_S)


PART_BUDGET_S = _part_budget_s()
#: named by the issue; every other package the GPU machine lacks is blocked too
NAMED = ("ray", "fastapi", "redis", "xfuser", "openai", "locust", "schemathesis")

BLOCKER = '''
"""Rehearsal of the GPU machine (tests/test_gpu_check.py): the modules it lacks do not import."""
import os
import sys
from importlib.abc import MetaPathFinder

_BLOCKED = frozenset(filter(None, os.environ.get("XEMA_BLOCK_MODULES", "").split(",")))


class _NotOnTheGpuMachine(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)", name=name)
        return None


sys.meta_path.insert(0, _NotOnTheGpuMachine())
'''


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(path: Path) -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {_norm(line.split("==")[0]) for line in lines if line}


def _needed_by(kept: set[str]) -> set[str]:
    """Distributions installed here that the kept ones need, transitively: a package of another
    version here (huggingface_hub 2.x needs httpx2; the GPU machine's 1.33 does not) keeps what
    its version imports, so the rehearsal blocks only what the GPU machine really lacks."""
    from packaging.requirements import Requirement

    seen, todo = set(), list(kept)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, requires):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(_norm(r.name))
    return seen


def _blocked_modules() -> list[str]:
    """Top-level modules installed here whose every distribution is absent from the GPU machine
    (neither there, nor in the kit, nor needed by what is) and the issue's named ones."""
    keep = _names(ROOT / "gpu_check" / "gpu_device_packages.txt") | _names(ROOT / "gpu_check" / "gpu-kit.txt")
    keep = _needed_by(keep) | {"xema-ray"}  # the project itself: its dependencies are the question
    blocked = {m for m, dists in importlib.metadata.packages_distributions().items()
               if m not in sys.stdlib_module_names and all(_norm(d) not in keep for d in dists)}
    return sorted(blocked | set(NAMED))


def _rehearsal_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "gpu-machine"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in [str(site), os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path, "XEMA_BLOCK_MODULES": ",".join(_blocked_modules()),
            "XEMA_GPU_PREP": str(tmp_path / "no-prep.json")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu-check runs the GPU tests instead")
def test_gpu_check_without_cuda_exits_0_with_a_no_gpu_record(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(CHECK), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert summary["cuda"] is False and "no CUDA GPU" in summary["skipped"] and summary["mode"] == "no-gpu"


def test_dry_run_without_ray_and_co_collects_every_gpu_test_and_plans_at_most_8_files(tmp_path: Path) -> None:
    env = _rehearsal_env(tmp_path)
    assert set(NAMED) <= set(env["XEMA_BLOCK_MODULES"].split(","))
    probe = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "not on the GPU machine" in probe.stderr  # the blocker is in force
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(CHECK), "--dry-run", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    record = json.loads((out / "gpu-check.json").read_text())
    assert record["collection_errors"] == [], record["collection_errors"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record["mode"] == "dry-run" and len(record["collected"]) >= 13
    assert all(t["planned"] for t in record["tests"]), [t["nodeid"] for t in record["tests"] if not t["planned"]]
    assert 2 <= len(record["planned_files"]) <= 8 and sorted(p.name for p in out.iterdir()) == ["gpu-check.json"]
    # never a CPU test module: every collected test comes from a *_gpu.py module
    assert all(re.search(r"test_\w+_gpu\.py::", n) for n in record["collected"])
    for part in (1, 2):
        assert sum(t["expected_s"] for t in record["tests"] if t["part"] == part) <= PART_BUDGET_S


PLANTED = '''
import json, os, signal, subprocess, sys, time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_a_crashes():
    os.kill(os.getpid(), signal.SIGSEGV)


def test_b_hangs_with_a_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(os.environ["PLANTED_CHILD"]).write_text(str(child.pid))
    time.sleep(600)


def test_c_fails():
    assert 1 + 1 == 3, "planted failure"


def test_d_passes_and_reports():
    Path(os.environ["XEMA_GPU_OUT"], "planted_result.json").write_text(json.dumps({"ok": True}))
'''


def test_planted_crash_and_hang_are_recorded_while_the_others_report(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "test_planted_gpu.py").write_text(textwrap.dedent(PLANTED))
    out = tmp_path / "out"
    child_file = tmp_path / "child.pid"
    env = {**os.environ, "PLANTED_CHILD": str(child_file), "XEMA_GPU_PREP": str(tmp_path / "no-prep.json")}
    proc = subprocess.run([sys.executable, str(CHECK), "--modules", str(planted / "test_*_gpu.py"), "--run-without-cuda",
                           "--timeout", "15", "--out", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a crash, a hang and a failure: the check fails
    record = json.loads((out / "gpu-check.json").read_text())
    by_name = {t["nodeid"].rsplit("::", 1)[1]: t for t in record["tests"]}
    crash, hang, fail, ok = (by_name[n] for n in ("test_a_crashes", "test_b_hangs_with_a_child", "test_c_fails",
                                                  "test_d_passes_and_reports"))
    assert crash["status"] == "crashed" and crash["signal"] == "SIGSEGV" and crash["returncode"] == -11
    assert "Fatal Python error" in (crash["stderr_tail"] or "") or "Segmentation" in (crash["stderr_tail"] or "")
    assert hang["status"] == "timeout" and hang["seconds"] >= 15 and hang["returncode"] is None
    pid = int(child_file.read_text())
    assert _gone(pid), f"the hanging test's child {pid} outlived its process group's kill"
    assert fail["status"] == "failed" and "planted failure" in (fail["message"] or "")
    assert ok["status"] == "passed" and ok["results"] == {"planted_result.json": {"ok": True}}
    assert record["counts"] == {"crashed": 1, "timeout": 1, "failed": 1, "passed": 1}
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu-check.log"]
    log = (out / "gpu-check.log").read_text()
    assert all(name in log for name in by_name)


def test_a_spent_budget_starts_no_test_and_says_so(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "test_planted_gpu.py").write_text(textwrap.dedent(PLANTED))
    out = tmp_path / "out"
    env = {**os.environ, "PLANTED_CHILD": str(tmp_path / "child.pid"), "XEMA_GPU_PREP": str(tmp_path / "no-prep.json")}
    proc = subprocess.run([sys.executable, str(CHECK), "--modules", str(planted / "test_*_gpu.py"), "--run-without-cuda",
                           "--part", "2", "--budget", "1", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((out / "gpu-check.json").read_text())
    assert record["budget_s"] == 1 and len(record["tests"]) == 4  # unplanned tests run in part 2
    assert all(t["status"] == "not_run" and "budget" in t["message"] for t in record["tests"])


def test_a_module_a_test_imports_inside_itself_is_checked_by_the_dry_run(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "test_lazy_gpu.py").write_text(textwrap.dedent('''
        import pytest

        @pytest.mark.gpu
        def test_imports_late():
            import not_on_the_gpu_machine_xyz  # noqa: F401
    '''))
    out = tmp_path / "out"
    env = {**os.environ, "XEMA_GPU_PREP": str(tmp_path / "no-prep.json")}
    proc = subprocess.run([sys.executable, str(CHECK), "--dry-run", "--modules", str(planted / "test_*_gpu.py"),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=120)
    record = json.loads((out / "gpu-check.json").read_text())
    assert proc.returncode == 1 and len(record["collected"]) == 1
    [error] = record["collection_errors"]
    assert "imports inside its tests" in error["nodeid"] and "not_on_the_gpu_machine_xyz" in error["message"]


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """The process is gone or a zombie (killed, not yet reaped by whoever adopted it), within ``timeout_s``."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
