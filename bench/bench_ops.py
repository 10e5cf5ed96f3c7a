"""Operations where the app runs (issue #37): from a running `xema serve` on a Ray cluster of its own,

1. every listening socket of the cluster's and the app's processes, and how many are on all interfaces;
2. the documented `RAY_AUTH_MODE=token ray job submit -- python -m planner plan --templates tiny --gpus 2
   --budget 96MB --hardware cpu --out plans/tiny.json`, verbatim (RAY_ADDRESS names the cluster): its
   exit status, wall time, where the table landed;
3. the same command with the cluster's CPUs deliberately exhausted (a placement group takes what the app
   left): seconds until it fails, and its message;
4. `xema serve CONFIG --reload-plans plans/tiny.json` under open-loop image load: requests sent, answered
   200, lost; the cluster's head processes (no restart) and the replicas kept.

The cluster is `bench/scenarios/local_cluster.py`'s (`ray start --head` with `xema serve`'s settings,
`ray_env`), the app `deployments/xema.yaml` on a free HTTP port, deployed with `xema serve CONFIG
--address` (the way docs/serving.md attaches the app to a cluster started for it).

    PYTHONPATH=. .venv/bin/python bench/bench_ops.py --out bench/results/ops.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scenarios.local_cluster import BIN, LocalCluster  # noqa: E402
from xema_ray.net import free_port  # noqa: E402
from xema_ray.serving.api.ready import wait_ready  # noqa: E402
from xema_ray.serving.ray_env import ray_env  # noqa: E402

DOCUMENTED = ["ray", "job", "submit", "--", "python", "-m", "planner", "plan", "--templates", "tiny", "--gpus", "2",
              "--budget", "96MB", "--hardware", "cpu", "--out", "plans/tiny.json"]
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listeners(pids: set[int]) -> list[dict]:
    rows = []
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.Error:
                name = "?"
            rows.append({"ip": c.laddr.ip, "port": c.laddr.port, "pid": c.pid, "process": name})
    return rows


def tree(pid: int) -> set[int]:
    try:
        root = psutil.Process(pid)
        return {root.pid} | {p.pid for p in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def submit(env: dict[str, str], cwd: Path, timeout_s: float) -> dict:
    t0 = time.monotonic()
    # the head's job agent comes up a few seconds after the dashboard does
    while True:
        job = subprocess.run([str(BIN / DOCUMENTED[0]), *DOCUMENTED[1:]], env=env, cwd=cwd, capture_output=True,
                             text=True, timeout=timeout_s)
        if "No available agent" not in job.stderr or time.monotonic() - t0 > 120:
            break
        time.sleep(3)
    said = job.stdout + job.stderr
    return {"rc": job.returncode, "seconds": round(time.monotonic() - t0, 1),
            "tasks_asked": next((ln.strip() for ln in said.splitlines() if "planning tasks ask for" in ln), None),
            "tail": said[-2500:]}


def hog(env: dict[str, str], address: str, cpus: float, name: str) -> None:
    """A detached placement group taking ``cpus`` CPUs (the cluster's resources, exhausted on purpose)."""
    code = (f"import ray; from ray.util.placement_group import placement_group; ray.init(address={address!r}, namespace='bench'); "
            f"pg = placement_group([{{'CPU': {cpus}}}], name={name!r}, lifetime='detached'); ray.get(pg.ready(), timeout=60)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)


def unhog(env: dict[str, str], address: str, name: str) -> None:
    code = (f"import ray; from ray.util.placement_group import get_placement_group, remove_placement_group; "
            f"ray.init(address={address!r}, namespace='bench'); remove_placement_group(get_placement_group({name!r}))")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)


class Load:
    """Open-loop image requests (one thread each, at ``rate`` per second) until stopped."""

    def __init__(self, url: str, rate: float) -> None:
        self.url, self.rate = url, rate
        self.answers: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.t0 = time.monotonic()

    def _one(self, i: int) -> None:
        sent = time.monotonic() - self.t0
        try:
            r = requests.post(f"{self.url}/v1/images/generations", timeout=600,
                              json={"model": "tiny-flux2", "prompt": f"a fox {i}", "size": "64x64",
                                    "response_format": "b64_json", "seed": i})
            self.answers.append((sent, r.status_code))
        except requests.RequestException:
            self.answers.append((sent, -1))

    def run(self) -> None:
        i = 0
        while not self._stop.is_set():
            t = threading.Thread(target=self._one, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
            i += 1
            self._stop.wait(1.0 / self.rate)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/ops.json")
    ap.add_argument("--rate", type=float, default=2.0, help="image requests per second during the reload")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    work = Path(tempfile.mkdtemp(prefix="xema-ops-"))
    os.chdir(work)  # the cluster's working directory, hence the job's: plans/tiny.json lands here
    result: dict = {"machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
                    "documented_command": "RAY_AUTH_MODE=token " + " ".join(DOCUMENTED)}
    cluster = LocalCluster(env=ray_env(open_ports=False), auth_mode="token")
    serve_proc = None
    try:
        cluster.start_head(num_cpus=2, num_gpus=0)
        config = yaml.safe_load((ROOT / "deployments" / "xema.yaml").read_text())
        port = free_port()
        config["http_options"]["port"] = port
        cfg_path = work / "xema.yaml"
        cfg_path.write_text(yaml.safe_dump(config))
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        serve_log = open(work / "serve.log", "w")
        serve_proc = subprocess.Popen([str(BIN / "xema"), "serve", str(cfg_path), "--address", cluster.gcs_address],
                                      env=cluster.env, stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_ready(url, timeout_s=900)
        result["app_ready_s"] = round(time.monotonic() - t0, 1)
        head = cluster.head
        assert head is not None
        pids = tree(head.proc.pid) | tree(serve_proc.pid)
        rows = listeners(pids)
        exposed = [r for r in rows if r["ip"] not in LOOPBACK]
        result["listeners"] = {"listening": len(rows), "on_all_interfaces": len(exposed), "exposed": exposed,
                               "serve_replicas": sum(1 for r in rows if r["process"].startswith("ray::ServeRepl"))}
        print("listeners:", json.dumps(result["listeners"])[:400], flush=True)
        env = {**cluster.env, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": cluster.dashboard_url}
        # 2. the documented job
        job = submit(env, work, timeout_s=1800)
        table = work / "plans" / "tiny.json"
        job["table_written"] = table.is_file()
        job["table_path"] = str(table)
        result["job"] = job
        print("job:", job["rc"], job["seconds"], job["table_written"], flush=True)
        # 3. exhausted: a placement group takes every CPU the app left
        status = subprocess.run([str(BIN / "ray"), "status", f"--address={cluster.gcs_address}"], env=cluster.env,
                                capture_output=True, text=True, timeout=60).stdout
        free_line = next((ln for ln in status.splitlines() if "CPU" in ln), "")
        result["cpu_usage_before_hog"] = free_line.strip()
        used = float(free_line.split("/")[0].split()[-1]) if "/" in free_line else 1.5
        hog(env, cluster.gcs_address, round(2.0 - used, 2), "bench-exhaust")
        t1 = time.monotonic()
        fail = submit(env, work, timeout_s=300)
        fail["seconds"] = round(time.monotonic() - t1, 1)
        result["exhausted"] = fail
        print("exhausted:", fail["rc"], fail["seconds"], flush=True)
        unhog(env, cluster.gcs_address, "bench-exhaust")
        # 4. the new table, under load; then a table where only tiny-flux2's plans differ (its SLOs x1.5)
        result["reload"] = reload_under_load(cluster, cfg_path, url, table, args.rate)
        from xema_ray.plan import PlanTable

        t = PlanTable.load(str(table))
        flux = {k: e.model_copy(update={"prediction": e.prediction.model_copy(update={"slo_s": e.prediction.slo_s * 1.5})})
                for k, e in t.entries.items() if k.startswith("tiny-flux2/")}
        one = work / "plans" / "tiny-flux-slo.json"
        t.model_copy(update={"entries": {**t.entries, **flux}}).save(str(one))
        result["reload_one_group"] = reload_under_load(cluster, cfg_path, url, one, args.rate)
    finally:
        if serve_proc is not None:
            _stop(serve_proc)
        cluster.shutdown()
    result["load_average_end"] = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    ok = (result["listeners"]["on_all_interfaces"] == 0 and result["job"]["rc"] == 0 and result["job"]["table_written"]
          and result["exhausted"]["rc"] != 0 and result["exhausted"]["seconds"] < 30
          and all(result[k]["rc"] == 0 and result[k]["lost"] == 0 for k in ("reload", "reload_one_group")))
    return 0 if ok else 1


def reload_under_load(cluster: LocalCluster, cfg_path: Path, url: str, table: Path, rate: float) -> dict:
    """``xema serve CONFIG --reload-plans TABLE`` under open-loop load: its outcome, the requests'
    status codes, and whether the cluster and the replicas are the same processes afterwards."""
    head = cluster.head
    assert head is not None
    head_pids = sorted(p for p in tree(head.proc.pid) if "ray::" not in _name(p))
    replicas_before = _replicas(cluster)
    generations_before = _generations(url)
    load = Load(url, rate)
    loader = threading.Thread(target=load.run, daemon=True)
    loader.start()
    time.sleep(5)
    t0 = time.monotonic()
    reload = subprocess.run([str(BIN / "xema"), "serve", str(cfg_path), "--reload-plans", str(table),
                             "--dashboard", cluster.dashboard_url], env=cluster.env, capture_output=True,
                            text=True, timeout=900)
    seconds = time.monotonic() - t0
    time.sleep(5)
    load.stop()
    codes: dict[str, int] = {}
    for _, c in load.answers:
        codes[str(c)] = codes.get(str(c), 0) + 1
    replicas_after = _replicas(cluster)
    served = requests.get(f"{url}/v1/plans", timeout=30).json()
    out = {"table": table.name, "rc": reload.returncode, "seconds": round(seconds, 1),
           "output": reload.stdout[-1500:] + reload.stderr[-1500:], "requests": len(load.answers),
           "status_codes": codes, "lost": sum(n for c, n in codes.items() if c != "200"),
           "worker_generations_before": generations_before, "worker_generations_after": _generations(url),
           "head_processes_kept": sorted(p for p in head_pids if psutil.pid_exists(p)) == head_pids and bool(head_pids),
           "replicas_kept": replicas_before == replicas_after and bool(replicas_before),
           "serve_replica_actors": len(replicas_before),
           "served_table_provenance": (served.get("provenance") or {}).get("command", "")[-200:]}
    print("reload:", json.dumps(out)[:900], flush=True)
    return out


def _generations(url: str) -> dict[str, int]:
    """Each group's worker-set generation (+1 whenever its workers are replaced)."""
    groups = requests.get(f"{url}/healthz", timeout=60).json().get("groups", {})
    return {m: g.get("generation") for m, g in sorted(groups.items())}


def _name(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _replicas(cluster: LocalCluster) -> list[str]:
    """The Serve replica actors alive (their ids): the same before and after means none was restarted."""
    out = subprocess.run([str(BIN / "ray"), "list", "actors", f"--address={cluster.dashboard_url}", "--format=json",
                          "--filter", "state=ALIVE", "--limit", "1000"], env=cluster.env, capture_output=True,
                         text=True, timeout=60)
    try:
        return sorted(a["actor_id"] for a in json.loads(out.stdout) if "ServeReplica" in a.get("class_name", ""))
    except (json.JSONDecodeError, KeyError, TypeError):
        return []


def _stop(proc: subprocess.Popen) -> None:
    for p in sorted(tree(proc.pid), reverse=True):
        try:
            psutil.Process(p).terminate()
        except psutil.Error:
            pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        for p in tree(proc.pid):
            try:
                psutil.Process(p).kill()
            except psutil.Error:
                pass


if __name__ == "__main__":
    raise SystemExit(main())
