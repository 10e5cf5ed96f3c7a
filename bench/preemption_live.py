"""Does step-level preemption fire on a live deployment? Open-loop Poisson arrivals against the
app of ``deployments/xema.yaml`` (tiny models on CPU, plans made at start-up) or another
deployment YAML (``--deployment deployments/xema-100step.yaml``: the long-step deployment),
optionally with every template's denoising steps raised (``--steps N``) and with preemption off
(``--max-preemptions 0``: the same run without it); counts the dispatcher's preemption decisions
(``/v1/stats``) and reports each template's latency against its SLO (``/v1/templates``).

    .venv/bin/python bench/preemption_live.py [--n 80] [--rate 1.0] [--steps N]
        [--deployment YAML] [--max-preemptions K] [--out results.json]

Uses only long-standing interfaces, so an older checkout runs the same file with its own
interpreter (from its root). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import time
from pathlib import Path

import ray
import requests
import yaml
from ray import serve

from deployments.app import build_app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps of every template (default: the YAML's)")
    ap.add_argument("--port", type=int, default=8302)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deployment", default="deployments/xema.yaml", help="the deployment YAML whose app runs")
    ap.add_argument("--max-preemptions", type=int, default=None,
                    help="every model group's max_preemptions (0: preemption off; default: the YAML's)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = ap.parse_args()
    doc = yaml.safe_load(Path(a.deployment).read_text())
    args = doc["applications"][0]["args"]
    args.pop("jobs", None)  # synchronous requests only: no store on this path
    if a.steps is not None:
        for g in args["models"]:
            for t in g["templates"]:
                t["steps"] = a.steps
    if a.max_preemptions is not None:
        for g in args["models"]:
            g["max_preemptions"] = a.max_preemptions
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    out: dict = {"deployment": a.deployment, "n": a.n, "rate": a.rate, "steps": a.steps,
                 "max_preemptions": a.max_preemptions, "load_avg_start": os.getloadavg()}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        t0 = time.time()
        serve.run(build_app(args), name="xema", route_prefix="/")
        out["startup_s"] = round(time.time() - t0, 1)
        url = f"http://127.0.0.1:{a.port}"
        templates = requests.get(f"{url}/v1/templates", timeout=60).json()
        rng = random.Random(a.seed)
        gaps = [rng.expovariate(a.rate) for _ in range(a.n)]
        picks = [rng.choice(templates) for _ in range(a.n)]

        def body(t: dict) -> tuple[str, dict]:
            common = {"model": t["model"], "prompt": "a lighthouse", "size": f"{t['width']}x{t['height']}",
                      "num_inference_steps": t["steps"]}
            if t["frames"] == 1:
                return "/v1/images/generations", common
            return "/v1/videos/sync", {**common, "num_frames": t["frames"]}

        for t in templates:  # warm-up: each template once
            path, b = body(t)
            requests.post(f"{url}{path}", json=b, timeout=600)

        def fire(i: int, at: float) -> tuple[str, float, int]:
            time.sleep(max(0.0, at - time.perf_counter()))
            path, b = body(picks[i])
            t1 = time.perf_counter()
            try:
                status = requests.post(f"{url}{path}", json=b, timeout=600).status_code
            except requests.RequestException:
                status = -1
            return picks[i]["template"], time.perf_counter() - t1, status

        start, at, plan = time.perf_counter() + 1.0, 0.0, []
        for g in gaps:
            at += g
            plan.append(start + at)
        with cf.ThreadPoolExecutor(64) as pool:
            done = list(pool.map(fire, range(a.n), plan))
        stats = requests.get(f"{url}/v1/stats", timeout=60).json()
        out["decisions"] = {m: r.get("decisions", 0) for m, r in stats.get("preemption", {}).items()}
        out["decisions_total"] = sum(out["decisions"].values())
        slo = {t["template"]: t["slo_s"] for t in templates}
        per: dict = {}
        for key in sorted(slo):
            lat = sorted(d for k, d, s in done if k == key and s == 200)
            if not lat:
                continue
            per[key] = {"n": len(lat), "slo_s": round(slo[key], 3), "p50_s": round(statistics.median(lat), 3),
                        "p90_s": round(lat[min(len(lat) - 1, int(0.9 * len(lat)))], 3),
                        "within_slo": round(sum(x <= slo[key] for x in lat) / len(lat), 3)}
        out["per_template"] = per
        out["statuses"] = sorted({s for _, _, s in done})
    finally:
        serve.shutdown()
        ray.shutdown()
    out["load_avg"] = os.getloadavg()
    print(json.dumps(out))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
