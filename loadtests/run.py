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
import subprocess
import sys
import time
from pathlib import Path

import requests

from xema_ray.plan import PlanTable
from xema_ray.serving.ray_env import ray_env
from xema_ray.sim.simulate import Arrival, simulate

ROOT = Path(__file__).resolve().parent.parent


def _up(url: str) -> bool:
    try:
        return requests.get(f"{url}/healthz", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def start_app(url: str, timeout_s: float, emulated: Path | None = None) -> subprocess.Popen | None:
    """Start ``serve run deployments/xema.yaml`` (or, with ``emulated``, that emulated box on its
    own Ray cluster: ``deployments.emulated_box``) unless ``url`` already answers; wait until healthy."""
    if _up(url):
        return None
    log = open(ROOT / "loadtests" / "results" / "serve.log", "w")  # noqa: SIM115 - lives as long as the app
    if emulated is not None:
        port = url.rsplit(":", 1)[-1].split("/")[0]
        cmd = [sys.executable, "-m", "deployments.emulated_box", str(emulated), "--port", port]
    else:
        cmd = [str(Path(sys.executable).parent / "serve"), "run", "deployments/xema.yaml"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=ray_env(base={**os.environ, "PYTHONPATH": str(ROOT)}))
    proc.emulated = emulated is not None  # type: ignore[attr-defined]
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode}; see loadtests/results/serve.log")
        if _up(url):
            return proc
        time.sleep(2)
    proc.terminate()
    raise TimeoutError(f"the app did not become healthy within {timeout_s:.0f} s; see loadtests/results/serve.log")


def stop_app(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    if getattr(proc, "emulated", False):  # the launcher owns its cluster: SIGTERM shuts down that one only
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        return
    serve = Path(sys.executable).parent / "serve"
    subprocess.run([str(serve), "shutdown", "-y"], cwd=ROOT, check=False, capture_output=True)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], check=False, capture_output=True)


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
    gaps = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = requests.post(f"{url}{path}", json=body, timeout=120)
        r.raise_for_status()
        gaps.append(time.perf_counter() - t0 - float(r.headers["X-Xema-Batch-Seconds"]))
    return sorted(gaps)[len(gaps) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.5, help="requests per second")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--mix", choices=("uniform", "skewed"), default="uniform")
    ap.add_argument("--slo-scale", type=float, default=1.0)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, default=ROOT / "loadtests" / "results")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--emulated", type=Path, default=None,
                    help="serve this device: emulated deployment (e.g. deployments/xema-a6000x8-emulated.yaml) on a "
                         "Ray cluster of its own instead of the tiny CPU app; rates are on its emulated clock")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    proc = start_app(args.url, args.startup_timeout, args.emulated)
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
    sim = simulate(table, arrivals, slo_scale=args.slo_scale, overhead_s=overhead, shared_cores=cores, preemption=preemption)
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
