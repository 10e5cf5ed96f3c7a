"""`ray job submit -- python -m planner plan ...` against a local `ray start --head` with logical
GPUs produces a plan table for the tiny models."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from xema_ray.plan import PlanTable

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ray_job_submit_writes_a_plan_table(tmp_path: Path) -> None:
    gcs, dash = _free_port(), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    # our own temp dir: the job must not join another test's cluster
    start = [str(BIN / "ray"), "start", "--head", f"--port={gcs}", "--num-cpus=2", "--num-gpus=2",
             f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
             f"--temp-dir={tmp_path / 'ray'}"]
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=120)
    out = tmp_path / "tiny.json"
    try:
        job = subprocess.run(
            [str(BIN / "ray"), "job", "submit", f"--address=http://127.0.0.1:{dash}",
             "--runtime-env-json", json.dumps({"env_vars": {"PYTHONPATH": str(ROOT)}}), "--", sys.executable, "-m", "planner", "plan", "--templates", "tiny-flux2:64x64", "--steps", "2",
             "--gpus", "2", "--budget", "96MB", "--hardware", "cpu", "--out", str(out)],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
    table = PlanTable.load(str(out))
    assert list(table.entries) == ["tiny-flux2/64x64x1"]
    assert table.entries["tiny-flux2/64x64x1"].config.dp * table.entries["tiny-flux2/64x64x1"].config.sp == 2
