"""The official openai client against a fresh ``make serve``: a ``tiny-wan2.2`` video job (two
experts, the switch inside the job) and a ``tiny-qwen-image`` image, with what came back.

    make serve > /tmp/serve.log 2>&1 &
    PYTHONPATH=. .venv/bin/python bench/new_models_client_demo.py --out bench/results/new-models-client.json
    ray stop --force
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import time
import urllib.request
import warnings
from pathlib import Path


def _wait_healthy(url: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{url}/healthz not ok after {timeout_s:.0f} s")
        time.sleep(2.0)


def main() -> None:
    import openai

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, default=None, help="write the transcript here (JSON)")
    ap.add_argument("--wait", type=float, default=400.0, help="seconds to wait for /healthz")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # openai marks its video API deprecated
    ready_s = _wait_healthy(a.url, a.wait)
    with urllib.request.urlopen(f"{a.url}/v1/templates", timeout=10) as r:
        listed = r.read().decode()
    client = openai.OpenAI(base_url=f"{a.url}/v1", api_key="local")
    out: dict[str, object] = {"healthz_after_s": round(ready_s, 1), "openai": openai.__version__,
                              "templates_listed": sorted(set(re.findall(r'"model":\s*"([^"]+)"', listed)))}

    t0 = time.monotonic()
    img = client.images.generate(model="tiny-qwen-image", prompt="a red fox in the snow", size="64x64",
                                 response_format="b64_json")
    png = base64.b64decode(img.data[0].b64_json or "")
    out["image"] = {"model": "tiny-qwen-image", "size": "64x64", "seconds": round(time.monotonic() - t0, 2),
                    "png_bytes": len(png), "png_magic_ok": png[:8] == b"\x89PNG\r\n\x1a\n",
                    "sha256": hashlib.sha256(png).hexdigest()[:16]}

    t0 = time.monotonic()
    v = client.videos.create_and_poll(model="tiny-wan2.2", prompt="waves on a beach at dusk", size="128x96", seconds="1")
    mp4 = client.videos.download_content(v.id).read() if v.status == "completed" else b""
    out["video"] = {"model": "tiny-wan2.2", "size": "128x96", "seconds_requested": "1", "id": v.id, "status": v.status,
                    "progress": v.progress, "seconds": round(time.monotonic() - t0, 2), "mp4_bytes": len(mp4),
                    "mp4_ftyp_ok": mp4[4:8] == b"ftyp", "sha256": hashlib.sha256(mp4).hexdigest()[:16]}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
