"""`ray job submit -- python -m planner plan ...` against a local `ray start --head` produces a plan
table for the tiny models: on a cluster with (logical) GPUs, where each planning task holds one
and measures on its device (this CPU: ``--hardware cpu``), and on a cluster with no GPUs at all,
where the tasks must request none (they would wait forever) and the cost model answers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from xema_ray.plan import PlanTable
from xema_ray.net import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent



def _stop_cluster(temp_dir: Path) -> None:
    """Stop only the cluster this test started (``ray stop`` would kill every Ray on the machine):
    its processes carry its temp dir on their command lines."""
    import psutil

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(temp_dir) in part for part in (p.info["cmdline"] or [])):
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in procs:
        p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=20)
    for p in alive:
        p.kill()


@pytest.mark.parametrize("cluster_gpus,hardware,source", [(2, "cpu", "measured"), (0, "a6000", "estimated")])
# (2, cpu): SP 1 candidates are timed on this CPU, SP 2 ones estimated from those timings
def test_ray_job_submit_writes_a_plan_table(tmp_path: Path, cluster_gpus: int, hardware: str, source: str) -> None:
    gcs, dash = free_port(), free_port()
    # Ray's unix sockets live under the temp dir and their paths must stay under 108 bytes
    ray_dir = Path(tempfile.mkdtemp(prefix="xr-", dir="/tmp"))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    # our own temp dir: the job must not join another test's cluster
    start = [str(BIN / "ray"), "start", "--head", f"--port={gcs}", "--num-cpus=2", f"--num-gpus={cluster_gpus}",
             f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
             # the agent's ports default to fixed numbers another local cluster may hold
             f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
             f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
             f"--temp-dir={ray_dir}"]
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=120)
    out, stats = tmp_path / "tiny.json", tmp_path / "stats.json"
    try:
        cmd = [str(BIN / "ray"), "job", "submit", f"--address=http://127.0.0.1:{dash}",
               "--runtime-env-json", json.dumps({"env_vars": {"PYTHONPATH": str(ROOT)}}), "--", sys.executable,
               "-m", "planner", "plan", "--templates", "tiny-flux2:64x64", "--steps", "2",
               "--gpus", "2", "--budget", "96MB", "--hardware", hardware, "--out", str(out), "--stats", str(stats)]
        deadline = time.time() + 120
        while True:
            job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            # the head's job agent comes up a few seconds after `ray start` returns
            if "No available agent" not in job.stderr or time.time() > deadline:
                break
            time.sleep(3)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    finally:
        _stop_cluster(ray_dir)
        shutil.rmtree(ray_dir, ignore_errors=True)
    table = PlanTable.load(str(out))
    assert list(table.entries) == ["tiny-flux2/64x64x1"]
    assert table.entries["tiny-flux2/64x64x1"].config.dp * table.entries["tiny-flux2/64x64x1"].config.sp == 2
    entry = table.entries["tiny-flux2/64x64x1"]
    if source == "measured":
        assert entry.prediction.latency_source == ("measured" if entry.config.sp == 1 else "measured+estimated")
    else:
        assert entry.prediction.latency_source == "estimated"
    result = json.loads(stats.read_text())["results"][0]
    if source == "measured":  # this CPU timed the candidates (segment-reuse profiler)
        assert result["device"] == "cpu" and result["measured"] >= 1
    else:  # no GPU in the cluster: nothing to measure on, every candidate estimated
        assert result["device"] == "none" and result["measured"] == 0 and result["estimated"] >= 1
