"""`ray job submit -- python -m planner plan ...` against a local `ray start --head` started with
the app's Ray settings (`ray_env`: the environment's `python` first on the cluster's PATH, so the
entry point runs as written) produces a plan table for the tiny models: with logical GPUs
(candidates timed on this CPU) beside placement groups that hold most of the CPUs, as a serving
app's do (the tasks take a fraction of a CPU), and on a cluster with no GPUs at all (tasks request
none; every latency estimated). With every CPU held, the job stops after its own wait for room
(``WAIT_S``) and names who holds them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.scenarios.local_cluster import BIN, LocalCluster
from planner.cluster_fit import WAIT_S
from xema_ray.plan import PlanTable
from xema_ray.serving.ray_env import ray_env

pytestmark = pytest.mark.slow


def _hold(cluster: LocalCluster, cpus: float, name: str) -> None:
    """A detached placement group holding ``cpus`` CPUs, named as Serve names a replica's."""
    code = ("import ray; from ray.util.placement_group import placement_group; "
            f"ray.init(address={cluster.gcs_address!r}); "
            f"ray.get(placement_group([{{'CPU': {cpus}}}], name={name!r}, lifetime='detached').ready(), timeout=60)")
    subprocess.run([sys.executable, "-c", code], env=cluster.env, check=True, capture_output=True, timeout=120)


def _submit(cluster: LocalCluster, args: list[str]) -> subprocess.CompletedProcess:
    # the documented entry point, `python`, as written: the cluster's PATH finds this environment's
    cmd = [str(BIN / "ray"), "job", "submit", f"--address={cluster.dashboard_url}", "--", "python", "-m", "planner",
           "plan", *args]
    deadline = time.time() + 120
    while True:
        job = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=600)
        # the head's job agent comes up a few seconds after the dashboard does
        if "No available agent" not in job.stderr or time.time() > deadline:
            return job
        time.sleep(3)


@pytest.mark.parametrize("cluster_gpus,hardware,source", [(2, "cpu", "measured"), (0, "a6000", "estimated")])
# (2, cpu): SP 1 candidates are timed on this CPU, SP 2 ones estimated from those timings
def test_ray_job_submit_writes_a_plan_table(tmp_path: Path, cluster_gpus: int, hardware: str, source: str) -> None:
    # our own cluster (own temp dir and ports, retried on a port collision, stopped by process
    # tree): the job must not join another test's cluster
    cluster = LocalCluster(env=ray_env(open_ports=False), auth_mode="token")
    out, stats = tmp_path / "tiny.json", tmp_path / "stats.json"
    plan = ["--templates", "tiny-flux2:64x64", "--steps", "2", "--gpus", "2", "--budget", "96MB", "--hardware", hardware,
            "--out", str(out), "--stats", str(stats)]
    try:
        cluster.start_head(num_cpus=2, num_gpus=cluster_gpus)
        if cluster_gpus:
            # a serving app's placement groups hold 1.5 of the 2 CPUs (make serve: 5 groups x 2 x 0.15)
            _hold(cluster, 1.5, "SERVE_REPLICA::xema#ModelGroup:tiny-flux2#test")
        job = _submit(cluster, plan)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        if cluster_gpus:
            assert "planning tasks ask for 0.5 CPU per task" in job.stdout, job.stdout[-3000:]
            # every CPU held now: the job stops after its wait for room and says what it asked, what is free,
            # who holds it. The wait is the planner's own figure; the wall clock around `ray job submit` (a
            # client, the job's driver, imports) only guards against a job left waiting for the CPUs
            _hold(cluster, 0.5, "SERVE_REPLICA::xema#ModelGroup:tiny-ltx2#test")
            t0 = time.monotonic()
            full = _submit(cluster, [*plan[:-4], "--out", str(tmp_path / "never.json")])
            seconds = time.monotonic() - t0
            said = full.stdout + full.stderr
            assert full.returncode != 0 and seconds < 120, (seconds, said[-3000:])
            waited = re.search(r"after (\d+) s the cluster has", said)
            assert waited is not None and WAIT_S <= float(waited.group(1)) <= WAIT_S + 10, said[-3000:]
            assert "at least 0.1 CPU" in said and "0 of 2 CPUs" in said, said[-3000:]
            assert "ModelGroup:tiny-flux2" in said and "ModelGroup:tiny-ltx2" in said, said[-3000:]
            assert not (tmp_path / "never.json").exists()
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
