"""Image inputs through the official ``openai`` client against a running ``make serve``:
``images.edit`` on tiny-flux2 with one and with two references, ``videos.create_and_poll(input_reference=...)``
on tiny-ltx2 and tiny-cogvideox-i2v, each video downloaded as MP4 and decoded. Writes what it got
as JSON (``--out``).

    make serve &   # then, once /healthz answers 200:
    python bench/image_inputs_client_demo.py --out bench/results/image-inputs-client.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import time
from pathlib import Path
from typing import Any

import imageio.v3 as iio
import numpy as np
import requests
from PIL import Image


def picture(seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def wait_ready(url: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url}/healthz not ready after {timeout_s} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ready-timeout", type=float, default=600)
    args = ap.parse_args()
    from openai import OpenAI

    out: dict[str, Any] = {"ready_after_s": round(wait_ready(args.url, args.ready_timeout), 1)}
    c = OpenAI(base_url=f"{args.url}/v1", api_key="unused", max_retries=5)
    templates = requests.get(f"{args.url}/v1/templates", timeout=30).json()
    out["templates_with_references"] = sorted(t["template"] for t in templates if "/ref" in t["template"])

    def edit(images: list[bytes]) -> dict[str, Any]:
        files = [(f"ref{i}.png", im, "image/png") for i, im in enumerate(images)]
        t0 = time.monotonic()
        raw = c.images.with_raw_response.edit(model="tiny-flux2", prompt="the fox, in winter",
                                              image=files[0] if len(files) == 1 else files, size="auto",
                                              response_format="b64_json", extra_body={"seed": 7})
        resp = raw.parse()
        png = base64.b64decode(resp.data[0].b64_json)
        return {"references": len(images), "seconds": round(time.monotonic() - t0, 2), "size": resp.size,
                "template": raw.headers.get("x-xema-template"), "png_bytes": len(png),
                "decoded": list(Image.open(io.BytesIO(png)).size)}

    out["images.edit"] = [edit([picture(1, (96, 80))]), edit([picture(1, (96, 80)), picture(2, (50, 50))])]

    def video(model: str) -> dict[str, Any]:
        t0 = time.monotonic()
        v = c.videos.create_and_poll(model=model, prompt="the sea moves", size="64x64", seconds="0.5" if model ==
                                     "tiny-cogvideox-i2v" else "0.33",
                                     input_reference=("first.png", picture(3, (128, 100)), "image/png"))
        row: dict[str, Any] = {"model": model, "status": v.status, "size": v.size, "seconds": v.seconds,
                               "wall_s": round(time.monotonic() - t0, 2)}
        if v.status == "completed":
            mp4 = c.videos.download_content(v.id).read()
            frames = iio.imread(io.BytesIO(mp4), extension=".mp4")
            row.update(mp4_bytes=len(mp4), mp4_head=mp4[4:8].decode(), frames=list(frames.shape))
        else:
            row["error"] = str(v.error)
        return row

    out["videos.create_and_poll"] = [video("tiny-ltx2"), video("tiny-cogvideox-i2v")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
