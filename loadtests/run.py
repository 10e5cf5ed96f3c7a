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
from xema_ray.sim.simulate import Arrival, simulate

ROOT = Path(__file__).resolve().parent.parent


def _up(url: str) -> bool:
    try:
        return requests.get(f"{url}/healthz", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def start_app(url: str, timeout_s: float) -> subprocess.Popen | None:
    """Start ``serve run deployments/xema.yaml`` unless ``url`` already answers; wait until healthy."""
    if _up(url):
        return None
    serve = Path(sys.executable).parent / "serve"
    log = open(ROOT / "loadtests" / "results" / "serve.log", "w")  # noqa: SIM115 - lives as long as the app
    proc = subprocess.Popen([str(serve), "run", "deployments/xema.yaml"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
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
    serve = Path(sys.executable).parent / "serve"
    subprocess.run([str(serve), "shutdown", "-y"], cwd=ROOT, check=False, capture_output=True)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], check=False, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.5, help="requests per second")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--mix", choices=("uniform", "skewed"), default="uniform")
    ap.add_argument("--slo-scale", type=float, default=1.0)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, default=ROOT / "loadtests" / "results")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    proc = start_app(args.url, args.startup_timeout)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XEMA_RATE": str(args.rate), "XEMA_DURATION": str(args.duration),
               "XEMA_MIX": args.mix, "XEMA_SLO_SCALE": str(args.slo_scale), "XEMA_OUT": str(args.out)}
        locust = Path(sys.executable).parent / "locust"
        subprocess.run([str(locust), "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless", "-u", "1", "-r", "1",
                        "--host", args.url, "--only-summary", "--csv", str(args.out / "locust")],
                       cwd=ROOT, env=env, check=True)
        table = PlanTable.model_validate(requests.get(f"{args.url}/v1/plans", timeout=30).json())
    finally:
        stop_app(proc)
    live = json.loads((args.out / "summary.json").read_text())
    arrivals = [Arrival.model_validate(a) for a in json.loads((args.out / "arrivals.json").read_text())]
    sim = simulate(table, arrivals, slo_scale=args.slo_scale)
    comparison = {"live_attainment": live["attainment"], "simulated_attainment": sim.attainment,
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
