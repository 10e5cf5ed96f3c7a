"""Wan2.2's image inputs through the official ``openai`` client against a running ``make serve``:
``videos.create_and_poll(input_reference=...)`` on tiny-wan2.2-i2v (image-to-video only; a text-only
create is refused naming ``input_reference``) and on tiny-wan2.2-ti2v (with a first frame, and
without one: text-to-video), each video downloaded as MP4 and decoded; the same image and seed
give the same bytes, another image another video. ``--browser``: the playground (``/ui``) in
headless Chromium shows the first-frame box for the templates that take one and runs a job with a
picture attached. Writes what it got as JSON (``--out``).

    make serve &   # then, once /healthz answers 200:
    python bench/wan_i2v_client_demo.py --out bench/results/wan-i2v-client.json --browser
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import time
from pathlib import Path
from typing import Any

import imageio.v3 as iio
import requests

from bench.image_inputs_client_demo import picture, wait_ready


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--browser", action="store_true", help="also drive the playground in headless Chromium")
    args = ap.parse_args()
    import openai

    out: dict[str, Any] = {"ready_after_s": round(wait_ready(args.url, args.ready_timeout), 1)}
    c = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused", max_retries=5)
    templates = requests.get(f"{args.url}/v1/templates", timeout=30).json()
    out["wan_templates"] = sorted(t["template"] for t in templates if t["model"].startswith("tiny-wan2.2-"))

    def video(model: str, seconds: str, image: bytes | None, seed: int = 7) -> dict[str, Any]:
        t0 = time.monotonic()
        extra = {"input_reference": ("first.png", image, "image/png")} if image is not None else {}
        v = c.videos.create_and_poll(model=model, prompt="the sea moves", size="64x64", seconds=seconds,  # type: ignore[arg-type]
                                     extra_body={"seed": seed}, **extra)
        row: dict[str, Any] = {"model": model, "first_frame": image is not None, "status": v.status, "size": v.size,
                               "seconds": v.seconds, "wall_s": round(time.monotonic() - t0, 2)}
        if v.status == "completed":
            mp4 = c.videos.download_content(v.id).read()
            frames = iio.imread(io.BytesIO(mp4), extension=".mp4")
            row.update(mp4_bytes=len(mp4), mp4_head=mp4[4:8].decode(), frames=list(frames.shape),
                       sha256=hashlib.sha256(mp4).hexdigest()[:16])
        else:
            row["error"] = str(v.error)
        return row

    first, other = picture(3, (128, 100)), picture(4, (80, 80))
    rows = [video("tiny-wan2.2-i2v", "0.5", first), video("tiny-wan2.2-i2v", "0.5", first),
            video("tiny-wan2.2-i2v", "0.5", other),
            video("tiny-wan2.2-ti2v", "0.33", first), video("tiny-wan2.2-ti2v", "0.33", None)]
    out["videos.create_and_poll"] = rows
    out["same_image_and_seed_same_bytes"] = "sha256" in rows[0] and rows[0]["sha256"] == rows[1].get("sha256")
    out["other_image_other_bytes"] = rows[0].get("sha256") != rows[2].get("sha256")
    try:
        c.videos.create(model="tiny-wan2.2-i2v", prompt="the sea moves", size="64x64", seconds="0.5")  # type: ignore[arg-type]
        out["text_only_on_i2v"] = "accepted (wrong)"
    except openai.BadRequestError as e:
        err = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
        out["text_only_on_i2v"] = {"status": e.status_code, "param": err.get("param"), "message": err.get("message")}
    if args.browser:
        out["playground"] = playground(args.url, first)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


def playground(url: str, image: bytes) -> dict[str, Any]:
    """The playground's first-frame box per template (``/v1/templates``' ``references``), and a
    tiny-wan2.2-i2v job started from the page with a picture attached, played back."""
    from bench.scenarios.console_app import browser

    got: dict[str, Any] = {}
    with browser() as b:
        page = b.new_context(viewport={"width": 1366, "height": 900}).new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/ui")
        page.wait_for_selector("#template option", state="attached", timeout=60_000)
        for model, template in (("tiny-wan2.2-ti2v", "tiny-wan2.2-ti2v/64x64x9"),
                                ("tiny-wan2.2-ti2v", "tiny-wan2.2-ti2v/64x64x9/ref1@64x64"),
                                ("tiny-wan2.2-i2v", "tiny-wan2.2-i2v/64x64x9/ref1@64x64")):
            page.select_option("#model", model)
            page.select_option("#template", template)
            got[f"box shown for {template}"] = page.is_visible("#refs-box")
        page.set_input_files("#refs", files=[{"name": "first.png", "mimeType": "image/png", "buffer": image}])
        t0 = time.monotonic()
        page.click("#submit")
        page.wait_for_selector("#out-video", timeout=120_000)
        deadline = time.monotonic() + 20  # polled here: wait_for_function evals strings, which the page's CSP forbids
        while not page.evaluate("document.querySelector('#out-video').readyState >= 1") and time.monotonic() < deadline:
            time.sleep(0.1)
        got["i2v job from the page"] = {"video_size": page.evaluate(
            "[document.querySelector('#out-video').videoWidth, document.querySelector('#out-video').videoHeight]"),
            "meta": page.text_content("#output .meta"), "wall_s": round(time.monotonic() - t0, 2)}
        got["page_errors"] = errors
    return got


if __name__ == "__main__":
    main()
