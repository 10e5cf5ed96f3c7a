"""``make loadtest``: start the Serve app if it is not up, run the open-loop locust test headless,
then replay the same arrivals through the cluster simulator with the server's plan table and
compare the simulated SLO attainment with the live one (the simulator's validation).

Example:
    python -m loadtests.run --rate 0.5 --duration 60
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
import yaml

from xema_ray.plan import PlanTable
from xema_ray.serving.ray_env import ray_env
from xema_ray.serving.api.ready import NotReady, poll_health, wait_ready
from xema_ray.sim.simulate import Arrival, SimulationConfig, simulate

ROOT = Path(__file__).resolve().parent.parent


def _up(url: str) -> bool:
    return poll_health(url)[0] == 200


def config_url(config: Path) -> str:
    """The base URL a Serve config file binds (``http_options``; Serve's defaults otherwise)."""
    http = (yaml.safe_load(config.read_text()) or {}).get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{http.get('port', 8000)}"


def _emulated(config: Path) -> bool:
    apps = (yaml.safe_load(config.read_text()) or {}).get("applications") or [{}]
    return (apps[0].get("args") or {}).get("device") == "emulated"


def start_app(url: str, timeout_s: float, config: Path = ROOT / "deployments" / "xema.yaml") -> subprocess.Popen | None:
    """Start the app of ``config`` unless ``url`` is ready already; wait until ``/healthz`` is 200.

    The app gets a Ray cluster of its own (``serve run --address local``, never one that happens
    to run on this machine; for a ``device: emulated`` config, ``deployments.emulated_box``, whose
    node declares the emulated GPUs), with the app's Ray settings (``ray_env``: local-only ports),
    in its own process session, so that ``stop_app`` stops that cluster and nothing else.
    """
    if _up(url):
        return None
    serve = Path(sys.executable).parent / "serve"
    log = open(ROOT / "loadtests" / "results" / "serve.log", "w")  # noqa: SIM115 - lives as long as the app
    env = ray_env(base={**os.environ, "PYTHONPATH": str(ROOT)})
    env.pop("RAY_ADDRESS", None)
    cmd = [str(serve), "run", "--address", "local", str(config)]
    if _emulated(config):  # its node must declare the GPUs: the emulated box's launcher (docs/emulated.md)
        cmd = [sys.executable, "-m", "deployments.emulated_box", str(config), "--port", url.rsplit(":", 1)[-1].strip("/")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        waited = wait_ready(url, timeout_s, poll_s=2.0, alive=lambda: proc.poll() is None)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; serve run exited with {proc.returncode}, see loadtests/results/serve.log") from None
    except NotReady as e:
        stop_app(proc)
        raise NotReady(f"{e}; see loadtests/results/serve.log") from None
    print(f"the app is ready after {waited:.0f} s", file=sys.stderr)
    return proc


def stop_app(proc: subprocess.Popen | None) -> None:
    """Stop the ``serve run`` that ``start_app`` started, and with it its own Ray cluster (the
    driver tears down the cluster it started); anything of its session left after 60 s is
    killed. Other clusters on this machine are never touched (no ``ray stop``)."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its session survived it
    except ProcessLookupError:
        pass


def unpriced_overhead(table: PlanTable, measured_s: float) -> float:
    """What the simulator adds to every request: the measured front-end overhead less what the
    table's latencies already price (a table planned with the serving path folded in records it,
    ``deployments.planning --overhead-s``: the demo's ``plans/demo-cpu.json``)."""
    priced = float(table.provenance.notes.get("serving_overhead_s", "0") or 0)
    return max(0.0, measured_s - priced)


def measure_overhead(url: str, n: int = 8) -> float:
    """Median time a request spends outside its batch on an idle server (HTTP, router, handles,
    wait window): client latency minus the batch time the server reports. The simulator adds it
    to every request; it is measured before the load run, not fitted to it."""
    templates = requests.get(f"{url}/v1/templates", timeout=30).json()
    t = min(templates, key=lambda x: x["predicted_latency_s"])
    path = "/v1/images/generations" if t["frames"] == 1 else "/v1/videos/sync"
    body = {"model": t["model"], "prompt": "overhead probe", "size": f"{t['width']}x{t['height']}", "seed": 0}
    if t["frames"] > 1:
        body["num_frames"] = t["frames"]
    gaps: list[float] = []
    deadline = time.time() + 300
    while len(gaps) < n:
        t0 = time.perf_counter()
        r = requests.post(f"{url}{path}", json=body, timeout=120)
        if r.status_code == 503 and time.time() < deadline:  # a group being replaced: wait as told
            time.sleep(float(r.headers.get("Retry-After", "2")))
            continue
        r.raise_for_status()
        gaps.append(time.perf_counter() - t0 - float(r.headers["X-Xema-Batch-Seconds"]))
    return sorted(gaps)[len(gaps) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.5, help="requests per second")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--mix", choices=("uniform", "skewed"), default="uniform")
    ap.add_argument("--slo-scale", type=float, default=1.0)
    ap.add_argument("--config", type=Path, default=ROOT / "deployments" / "xema.yaml",
                    help="the Serve config started when the app is not up")
    ap.add_argument("--url", default=None, help="the app's base URL (default: the config's http_options)")
    ap.add_argument("--out", type=Path, default=ROOT / "loadtests" / "results")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.url = args.url or config_url(args.config)
    proc = start_app(args.url, args.startup_timeout, args.config)
    try:
        overhead = measure_overhead(args.url)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XEMA_RATE": str(args.rate), "XEMA_DURATION": str(args.duration),
               "XEMA_MIX": args.mix, "XEMA_SLO_SCALE": str(args.slo_scale), "XEMA_OUT": str(args.out)}
        locust = Path(sys.executable).parent / "locust"
        subprocess.run([str(locust), "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless", "-u", "1", "-r", "1",
                        "--host", args.url, "--only-summary", "--csv", str(args.out / "locust")],
                       cwd=ROOT, env=env, check=True)
        table = PlanTable.model_validate(requests.get(f"{args.url}/v1/plans", timeout=30).json())
        table.save(str(args.out / "plans.json"))
        # the app's groups preempt unless their YAML turns it off: simulate what it ran
        groups = requests.get(f"{args.url}/v1/stats", timeout=30).json().get("preemption", {})
        preemption = any(g.get("enabled") for g in groups.values())
    finally:
        stop_app(proc)
    live = json.loads((args.out / "summary.json").read_text())
    arrivals = [Arrival.model_validate(a) for a in json.loads((args.out / "arrivals.json").read_text())]
    # the app's "GPUs" are logical workers sharing this machine's cores: simulate that sharing
    cores = float(os.cpu_count() or 1) if "CPU" in table.hardware else None
    sim = simulate(table, arrivals, SimulationConfig(slo_scale=args.slo_scale, overhead_s=unpriced_overhead(table, overhead),
                                                 shared_cores=cores, preemption=preemption))
    comparison = {"live_attainment": live["attainment"], "simulated_attainment": sim.attainment, "preemption": preemption,
                  "preemptions_simulated": sim.preemptions,
                  "front_end_overhead_s": overhead, "shared_cores": cores,
                  "per_template": {k: {"live": v["attainment"],
                                       "simulated": sim.per_template[k].met / max(1, sim.per_template[k].sent)}
                                   for k, v in live["per_template"].items() if k in sim.per_template},
                  "difference_pp": 100 * (sim.attainment - live["attainment"]),
                  "live_goodput_rpm": live["goodput_rpm"], "simulated_goodput_rpm": sim.goodput_rpm}
    (args.out / "simulator_validation.json").write_text(json.dumps(comparison, indent=1))
    print(json.dumps(comparison, indent=1))
    lost = live["lost"]
    if lost:
        print(f"{lost} requests got no answer", file=sys.stderr)
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
