"""The request options against a live deployment (``make serve``), as a peer's client sends them:

- the report's six-request case, ``rounds`` times: ``POST /v1/videos/sync`` on tiny-ltx2, five
  with ``guidance_scale`` 3.0 and one with 0.0, sent at once (statuses per round);
- a peer benchmark client's payload (``n``, ``size``, ``response_format``, ``num_inference_steps``
  8 and 50, ``negative_prompt``, ``true_cfg_scale``) on tiny-qwen-image, the same without
  ``true_cfg_scale`` on the CFG video models, and on tiny-flux2 (no CFG: 400s expected).

    python -m bench.options_live --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time

import requests


def _post(url: str, path: str, body: dict) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    r = requests.post(f"{url}{path}", json=body, timeout=900)
    took = time.perf_counter() - t0
    detail = r.headers.get("content-type", "") if r.ok else r.json()["error"]["message"][:160]
    return r.status_code, detail, round(took, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    deadline = time.monotonic() + 900
    while True:
        try:
            if requests.get(f"{args.url}/healthz", timeout=10).status_code == 200:
                break
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            return 2
        time.sleep(2)
    out: dict = {"six_request_rounds": []}
    ltx = {"model": "tiny-ltx2", "prompt": "a red fox", "size": "64x64", "num_frames": 9}
    for rnd in range(args.rounds):
        bodies = [{**ltx, "seed": rnd * 10 + i, "guidance_scale": 0.0 if i == 3 else 3.0} for i in range(6)]
        with cf.ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda b: _post(args.url, "/v1/videos/sync", b), bodies))
        out["six_request_rounds"].append([g[0] for g in got])
        out["six_request_refusal"] = got[3][1]
    peer = {"prompt": "a lighthouse at dusk", "n": 1, "size": "64x64", "response_format": "b64_json",
            "negative_prompt": "blurry, low quality"}
    runs = []
    for model, extra, path in (("tiny-qwen-image", {"true_cfg_scale": 4.0}, "/v1/images/generations"),
                               ("tiny-flux2", {"true_cfg_scale": 4.0}, "/v1/images/generations"),
                               ("tiny-cogvideox", {}, "/v1/videos/sync"),
                               ("tiny-ltx2", {}, "/v1/videos/sync"),
                               ("tiny-wan2.2", {}, "/v1/videos/sync")):
        for steps in (8, 50):
            body = {**peer, **extra, "model": model, "num_inference_steps": steps, "seed": 1}
            if path.endswith("sync"):
                body = {k: v for k, v in body.items() if k not in ("n", "response_format")} | {"num_frames": 9}
            status, detail, took = _post(args.url, path, body)
            runs.append({"model": model, "steps": steps, "status": status, "seconds": took, "detail": detail})
    out["peer_payload"] = runs
    print(json.dumps(out, indent=1))
    ok = all(r == [200, 200, 200, 422, 200, 200] for r in out["six_request_rounds"])
    ok &= all((r["status"] == 400) == (r["model"] == "tiny-flux2") and r["status"] in (200, 400) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
