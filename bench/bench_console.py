"""Page weight and time to first render of the console (``/ui``) in Debian's headless Chromium,
against the console's test app (``bench/scenarios/console_app.py``: tiny Flux.2 + tiny CogVideoX on
CPU, API keys on), and a check that no request leaves the machine: every request URL the browser
makes is recorded and must be the app's host (or a blob:/data: URL the page made itself).

Per page, ``--runs`` cold loads, each in a fresh browser context (empty cache and localStorage, the
key put in localStorage before the page's scripts run):

- weight: bytes of every response the load fetched (the page, its CSS and JS, and its API answers,
  uncompressed: the app sends no Content-Encoding), split into the console's own files and API JSON;
- first contentful paint (the browser's ``first-contentful-paint`` entry) and time to data (from
  navigation start until the page shows data from the API: the template list on the playground;
  the plan table and every trace plot on the operator view, the traces already computed once).

``--screenshots DIR`` also writes ``console-playground.png`` (after an image is generated and a
video job finished) and ``console-operator.png`` (during a burst of image requests), down-scaled and
palette-quantised to stay small.

    PYTHONPATH=. .venv/bin/python bench/bench_console.py --out bench/results/console.json --screenshots docs
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from bench.scenarios.console_app import ADMIN_KEY, COG, FLUX, USER_KEY, app_args, app_table, browser
from bench.scenarios.serve_app import running_app

PAGES = {
    "playground": ("/ui/", USER_KEY, "document.querySelectorAll('#template option').length > 0"),
    "operator": ("/ui/operator.html", ADMIN_KEY,
                 "document.querySelectorAll('table.plans tr[data-template]').length == 2 && "
                 "document.querySelectorAll('svg.trace path.mitigated').length == 2"),
}
STATIC_EXT = (".html", ".css", ".js", "/ui/")


def until(page: Any, js: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(js):
        if time.monotonic() > deadline:
            raise TimeoutError(js)
        time.sleep(0.01)


def load(chrome: Any, base: str, path: str, key: str, ready: str) -> dict[str, Any]:
    ctx = chrome.new_context(viewport={"width": 1366, "height": 900})
    ctx.add_init_script(f"localStorage.setItem('xema.apiKey', {json.dumps(key)})")
    page = ctx.new_page()
    urls: list[str] = []
    sizes: dict[str, int] = {}
    page.on("request", lambda r: urls.append(r.url))

    def done(r: Any) -> None:
        try:
            sizes[r.url] = sizes.get(r.url, 0) + len(r.body())
        except Exception:  # a redirect has no body
            sizes.setdefault(r.url, 0)

    page.on("requestfinished", lambda r: done(r.response()) if r.response() else None)
    page.goto(base + path)
    until(page, ready)
    data_ms = page.evaluate("performance.now()")
    fcp = page.evaluate("(performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || null")
    page.wait_for_timeout(300)
    host = urlsplit(base).netloc
    away = [u for u in urls if urlsplit(u).scheme not in ("blob", "data") and urlsplit(u).netloc != host]
    own = sum(n for u, n in sizes.items() if urlsplit(u).path.startswith("/ui"))
    api = sum(n for u, n in sizes.items() if not urlsplit(u).path.startswith("/ui"))
    ctx.close()
    return {"fcp_ms": fcp, "data_ms": data_ms, "static_bytes": own, "api_bytes": api, "requests": len(urls),
            "urls": sorted(set(urls)), "left_the_machine": away}


def shrink(path: Path, width: int = 1100) -> None:
    from PIL import Image

    img = Image.open(path).convert("RGB")
    if img.width > width:
        img = img.resize((width, round(img.height * width / img.width)), Image.LANCZOS)
    img.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def screenshots(chrome: Any, base: str, out: Path) -> None:
    ctx = chrome.new_context(viewport={"width": 1366, "height": 860})
    ctx.add_init_script(f"localStorage.setItem('xema.apiKey', {json.dumps(USER_KEY)})")
    page = ctx.new_page()
    page.goto(base + "/ui/")
    until(page, PAGES["playground"][2])
    page.select_option("#model", COG.model)
    page.click("#submit")
    page.wait_for_selector("#out-video", timeout=120_000)
    page.select_option("#model", FLUX.model)
    page.click("#submit")
    page.wait_for_selector("#out-image", timeout=60_000)
    page.screenshot(path=str(out / "console-playground.png"))
    shrink(out / "console-playground.png")
    ctx.close()

    ctx = chrome.new_context(viewport={"width": 1366, "height": 900})
    ctx.add_init_script(f"localStorage.setItem('xema.apiKey', {json.dumps(ADMIN_KEY)})")
    page = ctx.new_page()
    page.goto(base + "/ui/operator.html?refresh=0.5")
    until(page, PAGES["operator"][2])
    body = {"model": FLUX.model, "prompt": "burst", "size": f"{FLUX.width}x{FLUX.height}"}
    with cf.ThreadPoolExecutor(16) as pool:
        burst = [pool.submit(requests.post, f"{base}/v1/images/generations", json={**body, "seed": i},
                             headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=120) for i in range(32)]
        until(page, "parseInt(document.querySelector(\"section.group[data-model='tiny-flux2'] [data-stat='queued'] b\")"
                    ".textContent) > 3", 30)
        page.screenshot(path=str(out / "console-operator.png"), full_page=True)
        for f in burst:
            f.result()
    shrink(out / "console-operator.png")
    ctx.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/console.json"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--screenshots", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    serve_args = app_args(tmp / "jobs")
    results: dict[str, Any] = {}
    with running_app(serve_args, app_table(serve_args), tmp) as base, browser() as chrome:
        for t in (FLUX, COG):  # the traces are computed once per template; the view then reads them
            requests.get(f"{base}/v1/console/traces/{t.shape_key}", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=120).raise_for_status()
        for name, (path, key, ready) in PAGES.items():
            runs = [load(chrome, base, path, key, ready) for _ in range(args.runs)]
            results[name] = {
                "fcp_ms_median": statistics.median(r["fcp_ms"] for r in runs),
                "data_ms_median": statistics.median(r["data_ms"] for r in runs),
                "static_bytes": runs[0]["static_bytes"], "api_bytes_median": statistics.median(r["api_bytes"] for r in runs),
                "requests": runs[0]["requests"], "urls": runs[0]["urls"],
                "left_the_machine": sorted({u for r in runs for u in r["left_the_machine"]}), "runs": runs}
            r = results[name]
            print(f"{name}: first paint {r['fcp_ms_median']:.0f} ms, data shown {r['data_ms_median']:.0f} ms (median of "
                  f"{args.runs}); {r['static_bytes']} B of console files + {r['api_bytes_median']:.0f} B of API JSON in "
                  f"{r['requests']} requests; left the machine: {r['left_the_machine'] or 'none'}")
        if args.screenshots is not None:
            screenshots(chrome, base, args.screenshots)
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "runs": args.runs, "pages": results}, indent=1))
    assert not any(r["left_the_machine"] for r in results.values()), "a request left the machine"


if __name__ == "__main__":
    main()
