"""`ray job submit -- python -m planner plan ...` against a local `ray start --head` produces a
plan table for the tiny models: with logical GPUs (candidates timed on this CPU) and on a cluster
with no GPUs at all (tasks request none; every latency estimated)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.scenarios.local_cluster import BIN, ROOT, LocalCluster
from xema_ray.plan import PlanTable

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cluster_gpus,hardware,source", [(2, "cpu", "measured"), (0, "a6000", "estimated")])
# (2, cpu): SP 1 candidates are timed on this CPU, SP 2 ones estimated from those timings
def test_ray_job_submit_writes_a_plan_table(tmp_path: Path, cluster_gpus: int, hardware: str, source: str) -> None:
    # our own cluster (own temp dir and ports, retried on a port collision, stopped by process
    # tree): the job must not join another test's cluster
    cluster = LocalCluster(auth_mode="token")
    out, stats = tmp_path / "tiny.json", tmp_path / "stats.json"
    try:
        cluster.start_head(num_cpus=2, num_gpus=cluster_gpus)
        cmd = [str(BIN / "ray"), "job", "submit", f"--address={cluster.dashboard_url}",
               "--runtime-env-json", json.dumps({"env_vars": {"PYTHONPATH": str(ROOT)}}), "--", sys.executable,
               "-m", "planner", "plan", "--templates", "tiny-flux2:64x64", "--steps", "2",
               "--gpus", "2", "--budget", "96MB", "--hardware", hardware, "--out", str(out), "--stats", str(stats)]
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
    entry = table.entries["tiny-flux2/64x64x1"]
    assert entry.config.dp * entry.config.sp == 2
    # the static layout, solved in a second wave of Ray tasks, is written next to the table
    assert entry.config.layout_ref is not None
    assert (out.with_name("tiny.layouts") / f"{entry.config.layout_ref}.json").is_file()
    if source == "measured":
        assert entry.prediction.latency_source == ("measured" if entry.config.sp == 1 else "measured+estimated")
    else:
        assert entry.prediction.latency_source == "estimated"
    result = json.loads(stats.read_text())["results"][0]
    if source == "measured":  # this CPU timed the candidates (segment-reuse profiler)
        assert result["device"] == "cpu" and result["measured"] >= 1
    else:  # no GPU in the cluster: nothing to measure on, every candidate estimated
        assert result["device"] == "none" and result["measured"] == 0 and result["estimated"] >= 1
