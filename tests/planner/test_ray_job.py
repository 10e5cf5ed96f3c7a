"""`ray job submit -- python -m planner plan ...` against a local `ray start --head` with logical
GPUs produces a plan table for the tiny models."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from local_cluster import BIN, ROOT, LocalCluster
from xema_ray.plan import PlanTable

pytestmark = pytest.mark.slow


def test_ray_job_submit_writes_a_plan_table(tmp_path: Path) -> None:
    # our own cluster (own temp dir and ports, retried on a port collision, stopped by process
    # tree): the job must not join another test's cluster
    cluster = LocalCluster(auth_mode="token")
    out = tmp_path / "tiny.json"
    try:
        cluster.start_head(num_cpus=2, num_gpus=2)
        cmd = [str(BIN / "ray"), "job", "submit", f"--address={cluster.dashboard_url}",
               "--runtime-env-json", json.dumps({"env_vars": {"PYTHONPATH": str(ROOT)}}), "--", sys.executable,
               "-m", "planner", "plan", "--templates", "tiny-flux2:64x64", "--steps", "2",
               "--gpus", "2", "--budget", "96MB", "--hardware", "cpu", "--out", str(out)]
        deadline = time.time() + 120
        while True:
            job = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=600)
            # the head's job agent comes up a few seconds after the dashboard does
            if "No available agent" not in job.stderr or time.time() > deadline:
                break
            time.sleep(3)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    finally:
        cluster.shutdown()
    table = PlanTable.load(str(out))
    assert list(table.entries) == ["tiny-flux2/64x64x1"]
    assert table.entries["tiny-flux2/64x64x1"].config.dp * table.entries["tiny-flux2/64x64x1"].config.sp == 2
