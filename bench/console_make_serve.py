"""The console against a running ``make serve`` (every group of deployments/xema.yaml), in Debian's
headless Chromium: issue #40's must-show "from a fresh ``make serve``".

1. Playground: an image generated on an image model; a video job run to completion with its
   progress bar seen moving; a second job cancelled while it runs (the job then gone from the store).
2. Operator view: every template ``/v1/templates`` lists shows its plan row and its trace plot
   (the trace computed by the app from the analyzer), while a burst of image requests moves the
   queue numbers.
3. Page weight and time to first render of both pages on this app (median of ``--runs`` cold
   loads, as ``bench/bench_console.py`` measures them), and every URL the browser asked for: all
   must be the app's host.

Screenshots of both pages go to ``--screenshots`` (docs/console-*-make-serve.png); the figures to
``--out``. No API keys (make serve runs without them); ``--key`` / ``--admin-key`` for an app with keys.

    make serve &      # wait for "Deployed app 'xema' successfully"
    PYTHONPATH=. .venv/bin/python bench/console_make_serve.py --url http://127.0.0.1:8000 \\
        --out bench/results/console-make-serve.json --screenshots docs
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from bench.bench_console import load, shrink, until
from bench.scenarios.console_app import browser


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def templates(base: str, key: str | None) -> list[dict[str, Any]]:
    r = requests.get(f"{base}/v1/templates", headers=_headers(key), timeout=30)
    r.raise_for_status()
    return list(r.json())


def warm_traces(base: str, keys: list[str], admin: str | None) -> dict[str, float]:
    """Ask the app for every template's trace once (the view then reads them); seconds each."""
    def one(k: str) -> float:
        t0 = time.monotonic()
        requests.get(f"{base}/v1/console/traces/{k}", headers=_headers(admin), timeout=300).raise_for_status()
        return time.monotonic() - t0

    with cf.ThreadPoolExecutor(2) as pool:
        return dict(zip(keys, pool.map(one, keys)))


def new_page(chrome: Any, key: str | None, height: int = 900) -> tuple[Any, Any, list[str], list[str]]:
    ctx = chrome.new_context(viewport={"width": 1366, "height": height})
    if key:
        ctx.add_init_script(f"localStorage.setItem('xema.apiKey', {json.dumps(key)})")
    page = ctx.new_page()
    urls: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: urls.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    return ctx, page, urls, errors


def playground(chrome: Any, base: str, key: str | None, image_model: str, video_model: str,
               shots: Path | None) -> dict[str, Any]:
    ctx, page, urls, errors = new_page(chrome, key, 860)
    out: dict[str, Any] = {}
    page.goto(base + "/ui/")
    until(page, "document.querySelectorAll('#template option').length > 0")
    out["models_listed"] = page.evaluate("[...document.querySelectorAll('#model option')].map(o => o.value)")

    page.select_option("#model", image_model)
    t0 = time.monotonic()
    page.click("#submit")
    page.wait_for_selector("#out-image", timeout=120_000)
    out["image"] = {"model": image_model, "seconds": round(time.monotonic() - t0, 2),
                    "size": page.evaluate("(() => { const i = document.querySelector('#out-image'); "
                                          "return [i.naturalWidth, i.naturalHeight]; })()")}

    page.select_option("#model", video_model)
    t0 = time.monotonic()
    page.click("#submit")
    page.wait_for_selector("#progress", state="visible", timeout=30_000)
    seen: set[int] = set()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not page.query_selector("#out-video"):
        seen.add(int(page.get_attribute("#progress", "aria-valuenow") or 0))
        time.sleep(0.05)
    if not page.query_selector("#out-video"):
        raise AssertionError(f"the video job did not finish: {page.text_content('#status')}")
    until(page, "document.querySelector('#out-video').readyState >= 1", 30)
    out["video_job"] = {"model": video_model, "seconds": round(time.monotonic() - t0, 2),
                        "progress_seen": sorted(seen), "job_line": page.text_content("#job-line"),
                        "video_width": page.evaluate("document.querySelector('#out-video').videoWidth")}
    if not [v for v in seen if 0 < v < 100]:
        raise AssertionError(f"no intermediate progress seen: {sorted(seen)}")
    if shots is not None:
        page.screenshot(path=str(shots / "console-playground-make-serve.png"))
        shrink(shots / "console-playground-make-serve.png")

    page.click("#submit")  # a second job, cancelled while it runs
    page.wait_for_selector("#cancel", state="visible", timeout=30_000)
    job = (page.text_content("#job-line") or "").split(" ")[0]
    until(page, "parseInt(document.querySelector('#progress').getAttribute('aria-valuenow')) > 0 "
                "|| document.querySelector('#job-line').textContent.includes('in_progress')", 60)
    page.click("#cancel")
    until(page, "document.querySelector('#job-line').textContent.includes('cancelled')", 30)
    gone = requests.get(f"{base}/v1/videos/{job}", headers=_headers(key), timeout=30)
    out["cancelled_job"] = {"job": job, "job_line": page.text_content("#job-line"),
                            "get_after_cancel": gone.status_code}
    if gone.status_code != 404:
        raise AssertionError(f"the cancelled job {job} is still in the store: {gone.status_code}")
    out["errors"] = errors
    out["left_the_machine"] = away(base, urls)
    ctx.close()
    return out


def away(base: str, urls: list[str]) -> list[str]:
    host = urlsplit(base).netloc
    return sorted({u for u in urls if urlsplit(u).scheme not in ("blob", "data") and urlsplit(u).netloc != host})


def operator(chrome: Any, base: str, key: str | None, admin: str | None, served: list[str], burst_model: str,
             burst_size: str, shots: Path | None) -> dict[str, Any]:
    ctx, page, urls, errors = new_page(chrome, admin)
    page.goto(base + "/ui/operator.html?refresh=0.5")
    t0 = time.monotonic()
    for k in served:  # every served template: its plan row and its trace plot
        page.wait_for_selector(f"table.plans tr[data-template='{k}']", timeout=60_000)
        page.wait_for_selector(f".trace-card[data-template='{k}'] svg.trace path.mitigated", timeout=300_000)
    shown_s = time.monotonic() - t0
    rows = page.evaluate("[...document.querySelectorAll('table.plans tr[data-template]')].map(r => r.dataset.template)")
    traces = page.evaluate("[...document.querySelectorAll('.trace-card svg.trace path.mitigated')]"
                           ".map(p => p.closest('.trace-card').dataset.template)")
    queued = f"section.group[data-model='{burst_model}'] [data-stat='queued'] b"
    seen: set[int] = set()
    body = {"model": burst_model, "prompt": "burst", "size": burst_size}
    with cf.ThreadPoolExecutor(16) as pool:
        burst = [pool.submit(requests.post, f"{base}/v1/images/generations", json={**body, "seed": i},
                             headers=_headers(key), timeout=300) for i in range(24)]
        shot = False
        while not all(f.done() for f in burst):
            n = int(page.text_content(queued) or 0)
            seen.add(n)
            if n >= 3 and not shot and shots is not None:
                page.screenshot(path=str(shots / "console-operator-make-serve.png"), full_page=True)
                shot = True
            time.sleep(0.1)
        statuses = sorted({f.result().status_code for f in burst})
    if shots is not None and not shot:
        page.screenshot(path=str(shots / "console-operator-make-serve.png"), full_page=True)
    if shots is not None:
        shrink(shots / "console-operator-make-serve.png")
    ctx.close()
    return {"plan_rows": sorted(rows), "trace_plots": sorted(traces), "all_shown_s": round(shown_s, 2),
            "burst": {"model": burst_model, "requests": 24, "statuses": statuses, "queued_seen": sorted(seen)},
            "errors": errors, "left_the_machine": away(base, urls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--key", default=None, help="a user key, if the app has API keys")
    ap.add_argument("--admin-key", default=None, help="an admin key, if the app has API keys")
    ap.add_argument("--image-model", default="tiny-flux2")
    ap.add_argument("--video-model", default="tiny-cogvideox")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/console-make-serve.json"))
    ap.add_argument("--screenshots", type=Path, default=None)
    args = ap.parse_args()
    base = args.url.rstrip("/")
    tpl = templates(base, args.key)
    served = sorted(t["template"] for t in tpl)
    image = next(t for t in tpl if t["model"] == args.image_model)
    trace_s = warm_traces(base, served, args.admin_key or args.key)
    print(f"{len(served)} templates served; traces computed in {sum(trace_s.values()):.1f} s")
    result: dict[str, Any] = {"url": base, "templates": served, "trace_seconds": trace_s}
    with browser() as chrome:
        result["playground"] = playground(chrome, base, args.key, args.image_model, args.video_model, args.screenshots)
        print("playground:", json.dumps({k: v for k, v in result["playground"].items() if k != "models_listed"}))
        result["operator"] = operator(chrome, base, args.key, args.admin_key or args.key, served, args.image_model,
                                      f"{image['width']}x{image['height']}", args.screenshots)
        print("operator:", json.dumps(result["operator"]))
        pages = {"playground": ("/ui/", args.key, "document.querySelectorAll('#template option').length > 0"),
                 "operator": ("/ui/operator.html", args.admin_key or args.key,
                              f"document.querySelectorAll('table.plans tr[data-template]').length == {len(served)} && "
                              f"document.querySelectorAll('svg.trace path.mitigated').length == {len(served)}")}
        result["pages"] = {}
        for name, (path, key, ready) in pages.items():
            runs = [load(chrome, base, path, key or "", ready) for _ in range(args.runs)]
            r = result["pages"][name] = {
                "fcp_ms_median": statistics.median(x["fcp_ms"] for x in runs),
                "data_ms_median": statistics.median(x["data_ms"] for x in runs),
                "static_bytes": runs[0]["static_bytes"], "api_bytes_median": statistics.median(x["api_bytes"] for x in runs),
                "requests": runs[0]["requests"], "left_the_machine": sorted({u for x in runs for u in x["left_the_machine"]})}
            print(f"{name}: first paint {r['fcp_ms_median']:.0f} ms, data shown {r['data_ms_median']:.0f} ms (median of "
                  f"{args.runs}); {r['static_bytes']} B of console files + {r['api_bytes_median']:.0f} B of API JSON; "
                  f"left the machine: {r['left_the_machine'] or 'none'}")
    result["machine"] = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    missing = set(served) - set(result["operator"]["plan_rows"]) | set(served) - set(result["operator"]["trace_plots"])
    assert not missing, f"templates without a plan row or trace: {sorted(missing)}"
    assert not result["playground"]["left_the_machine"] and not result["operator"]["left_the_machine"]
    assert not any(p["left_the_machine"] for p in result["pages"].values()), "a request left the machine"


if __name__ == "__main__":
    main()
