"""Quality tiers end to end against a live deployment (``make serve``; ``docs/quality.md``):
``POST /v1/images/generations`` on tiny-flux2 128x128 at 50 steps, ``b64_json``, ``fast`` and
``lossless`` interleaved (lossless, fast, lossless, fast, ...), one request at a time, ``rounds``
of each; the median wall time and the median ``X-Xema-Batch-Seconds`` of each tier, their ratios,
the planner's predicted ratio (``/v1/templates``' ``quality_tiers`` carried to 50 steps, a reused
step priced at what the plan says it costs) and the
PSNR of the fast image against the lossless one of the same seed.

    python -m bench.bench_quality --url http://127.0.0.1:8000 [--out bench/results/quality-tiers.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import requests
from PIL import Image

TEMPLATE = "tiny-flux2/128x128x1"


def psnr(a: bytes, b: bytes) -> float:
    """PSNR (dB) of two 8-bit images; inf where they are equal."""
    x = np.asarray(Image.open(io.BytesIO(a)), dtype=np.float64)
    y = np.asarray(Image.open(io.BytesIO(b)), dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _wait(url: str, timeout_s: float = 900) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/healthz", timeout=10).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(2)
    return False


def _one(url: str, quality: str, steps: int, seed: int) -> tuple[float, float, str, bytes]:
    body = {"model": "tiny-flux2", "prompt": "a red fox in the snow", "size": "128x128", "seed": seed,
            "num_inference_steps": steps, "response_format": "b64_json", "quality": quality}
    t0 = time.perf_counter()
    r = requests.post(f"{url}/v1/images/generations", json=body, timeout=900)
    took = time.perf_counter() - t0
    r.raise_for_status()
    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    return took, float(r.headers["X-Xema-Batch-Seconds"]), r.headers["X-Xema-Quality"], png


def _predicted_ratio(url: str, steps: int) -> float | None:
    """The planner's fast / lossless latency ratio at ``steps`` steps, priced as ``planner.tiers``
    prices it: ``/v1/templates`` gives, at the template's own step count ``n``, each tier's latency,
    a computed step's seconds ``s`` and the fast tier's reused step's ``r`` (the loop's work outside
    the denoiser, which a reused step still pays); what is not a step is ``lossless - n * s``, and
    at ``steps`` fast computes ``c`` steps and reuses ``steps - c``."""
    from xema_ray.tier_plan import StepCacheSchedule

    info = {t["template"]: t for t in requests.get(f"{url}/v1/templates", timeout=30).json()}.get(TEMPLATE)
    if info is None:
        return None
    tiers = {q["name"]: q for q in info["quality_tiers"]}
    if "fast" not in tiers or tiers["fast"].get("predicted_step_s", 0) <= 0:
        return None  # a server whose plan prices no steps
    s, r = tiers["fast"]["predicted_step_s"], tiers["fast"]["predicted_reused_step_s"]
    other = tiers["lossless"]["predicted_latency_s"] - info["steps"] * s
    c = StepCacheSchedule().computed_steps(steps)
    return round((other + c * s + (steps - c) * r) / (other + steps * s), 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=None, help="JSON to write the figures to")
    args = ap.parse_args()
    if not _wait(args.url):
        print("no deployment answered /healthz", file=sys.stderr)
        return 2
    _one(args.url, "lossless", args.steps, 0)  # warm both paths: first calls load and plan kernels
    _one(args.url, "fast", args.steps, 0)
    runs: dict[str, list[tuple[float, float]]] = {"lossless": [], "fast": []}
    images: dict[str, bytes] = {}
    served: set[str] = set()
    for i in range(args.rounds):
        for quality in ("lossless", "fast"):
            took, batch_s, header, png = _one(args.url, quality, args.steps, seed=100 + i)
            runs[quality].append((took, batch_s))
            served.add(f"{quality}->{header}")
            if i == 0:
                images[quality] = png
    med = {q: (statistics.median(t for t, _ in r), statistics.median(b for _, b in r)) for q, r in runs.items()}
    out = {
        "template": TEMPLATE, "steps": args.steps, "rounds": args.rounds, "served": sorted(served),
        "median_s": {q: round(m[0], 3) for q, m in med.items()},
        "median_batch_s": {q: round(m[1], 3) for q, m in med.items()},
        "ratio_end_to_end": round(med["fast"][0] / med["lossless"][0], 3),
        "ratio_batch_seconds": round(med["fast"][1] / med["lossless"][1], 3),
        "predicted_ratio": _predicted_ratio(args.url, args.steps),
        "psnr_fast_vs_lossless_db": round(psnr(images["fast"], images["lossless"]), 2),
        "runs": runs,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
