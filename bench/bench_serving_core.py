"""Serving-core measurements against a running app (BENCHMARKS.md "Serving overhead"):

* ``timeline``: from the moment the app's command starts, ``/healthz`` and one small image
  request every ``--every`` seconds (each request waited for): when readiness turned 200, when
  the first request was served, and every answer in between.
* ``burst``: N concurrent image requests; every answer classified (200, JSON 503 with
  Retry-After by ``code`` and ``limit``, anything else), and whether any 503 blames a group.
* ``ports``: the TCP ports the process tree of ``--pid`` listens on, loopback or not.

Examples:
    python bench/bench_serving_core.py timeline --url http://127.0.0.1:8291 -- serve run app.yaml
    python bench/bench_serving_core.py burst --url http://127.0.0.1:8291 -n 300
    python bench/bench_serving_core.py ports --pid 12345
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import requests
from pydantic import BaseModel


IMAGE = {"model": "tiny-flux2", "prompt": "a red fox", "size": "64x64"}
#: 503 codes that are admission limits (the request was never accepted)
ADMISSION = {"busy", "queue_full"}


class Answer(BaseModel):
    sent_s: float
    seconds: float
    status: int | None  # None: no HTTP answer (connection refused / reset / timed out)
    json_body: bool = False
    retry_after: str | None = None
    code: str | None = None
    limit: str | None = None
    message: str | None = None


def _post(url: str, seed: int, t0: float, timeout: float) -> Answer:
    sent = time.monotonic()
    try:
        r = requests.post(f"{url}/v1/images/generations", json={**IMAGE, "seed": seed}, timeout=timeout)
    except requests.RequestException as e:
        return Answer(sent_s=sent - t0, seconds=time.monotonic() - sent, status=None, message=type(e).__name__)
    a = Answer(sent_s=sent - t0, seconds=time.monotonic() - sent, status=r.status_code,
               retry_after=r.headers.get("Retry-After"))
    if r.status_code != 200:
        try:
            err = r.json()["error"]
            a.json_body, a.code, a.limit, a.message = True, err.get("code"), err.get("limit"), err["message"][:200]
        except (ValueError, KeyError, TypeError):
            a.message = r.text[:200]
    return a


def _control_calls(url: str, stop: threading.Event, out: list[dict]) -> None:
    """``/healthz`` and ``/v1/stats`` every 0.5 s while the burst runs: answered, and how fast."""
    while not stop.is_set():
        for path in ("/healthz", "/v1/stats"):
            t = time.monotonic()
            status, state = None, None
            try:
                r = requests.get(f"{url}{path}", timeout=30)
                status = r.status_code
                state = r.json().get("status") if path == "/healthz" else None
            except (requests.RequestException, ValueError) as e:
                state = type(e).__name__
            out.append({"path": path, "seconds": round(time.monotonic() - t, 3), "status": status, "state": state})
        stop.wait(0.5)


def burst(url: str, n: int, timeout: float) -> dict:
    t0 = time.monotonic()
    barrier = threading.Barrier(n)
    control: list[dict] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_control_calls, args=(url, stop, control), daemon=True)

    def one(i: int) -> Answer:
        barrier.wait()  # all n at once
        return _post(url, 1000 + i, t0, timeout)

    watcher.start()
    with cf.ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(one, range(n)))
    wall = time.monotonic() - t0
    stop.set()
    watcher.join(timeout=60)

    def calls(path: str) -> dict:
        got = [c for c in control if c["path"] == path]
        secs = sorted(c["seconds"] for c in got)
        return {"calls": len(got), "statuses": dict(Counter(str(c["status"]) for c in got)),
                "states": dict(Counter(str(c["state"]) for c in got if c["state"])),
                "median_s": secs[len(secs) // 2] if secs else None, "max_s": secs[-1] if secs else None}
    by = Counter((a.status, a.code, a.limit) for a in answers)
    bad_503 = [a for a in answers if a.status == 503 and (not a.json_body or not a.retry_after)]
    blaming = [a for a in answers if a.status == 503 and a.code not in ADMISSION]
    other = [a for a in answers if a.status not in (200, 503)]
    ok = [a.seconds for a in answers if a.status == 200]
    return {"n": n, "wall_s": round(wall, 1), "ok": len(ok),
            "outcomes": {f"{s} {c or ''} {lim or ''}".strip(): k for (s, c, lim), k in by.most_common()},
            "503_not_json_or_no_retry_after": len(bad_503), "503_not_an_admission_limit": len(blaming),
            "not_200_or_503": len(other),
            "examples": {a.code or str(a.status): a.message for a in answers if a.status != 200},
            "ok_latency_s": {"median": round(sorted(ok)[len(ok) // 2], 2), "max": round(max(ok), 2)} if ok else None,
            "during_the_burst": {"healthz": calls("/healthz"), "stats": calls("/v1/stats")},
            "load_average": os.getloadavg()}


def _healthz(url: str) -> tuple[int | None, str | None, dict[str, str]]:
    """``/healthz``: HTTP status, overall state, and each group's state (when the Router answers)."""
    try:
        r = requests.get(f"{url}/healthz", timeout=5)
    except requests.RequestException:
        return None, None, {}
    try:
        body = r.json()
    except ValueError:
        return r.status_code, None, {}
    groups = body.get("groups") if isinstance(body.get("groups"), dict) else {}
    return r.status_code, body.get("status"), {m: g.get("status") for m, g in groups.items()}


def timeline(url: str, cmd: list[str], every: float, limit_s: float, out_log: Path) -> dict:
    t0 = time.monotonic()
    log = open(out_log, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True) if cmd else None
    polls: list[tuple[float, int | None, str | None]] = []
    group_states: list[dict] = []
    answers: list[Answer] = []
    lock = threading.Lock()
    threads = []
    seed = 0
    first_ok: float | None = None
    while time.monotonic() - t0 < limit_s:
        now = time.monotonic() - t0
        status, state, groups = _healthz(url)
        polls.append((round(now, 2), status, state))
        group_states.append({"t_s": round(now, 2), **groups})

        def fire(s: int = seed) -> None:
            a = _post(url, s, t0, timeout=600)
            with lock:
                answers.append(a)

        th = threading.Thread(target=fire, daemon=True)
        th.start()
        threads.append(th)
        seed += 1
        with lock:
            oks = [a.sent_s + a.seconds for a in answers if a.status == 200]
        if oks and status == 200:
            first_ok = min(oks)
            break
        time.sleep(every)
    for th in threads:
        th.join(timeout=600)
    ready = next((t for t, s, _ in polls if s == 200), None)
    served = min((a.sent_s + a.seconds for a in answers if a.status == 200), default=first_ok)
    # every look at /healthz after the first served request must be 200, and none before it
    early_200 = [t for t, s, _ in polls if s == 200 and served is not None and t < served - 0.01]
    return {"command": cmd, "pid": proc.pid if proc else None, "healthz_first_200_s": ready,
            "first_request_served_s": round(served, 2) if served is not None else None,
            "healthz_200_before_any_request_served": early_200,
            "group_first_ok_s": {m: next((g["t_s"] for g in group_states if g.get(m) == "ok"), None)
                                 for m in sorted({k for g in group_states for k in g if k != "t_s"})},
            "healthz": [{"t_s": t, "status": s, "state": st} for t, s, st in polls],
            "group_states": group_states,
            "requests": [a.model_dump(exclude_none=True) for a in sorted(answers, key=lambda a: a.sent_s)],
            "load_average": os.getloadavg()}


def ports(pid: int) -> dict:
    root = psutil.Process(pid)
    tree = {root.pid} | {p.pid for p in root.children(recursive=True)}
    rows = []
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in tree:
            try:
                name = " ".join(psutil.Process(c.pid).cmdline())[:60]
            except psutil.Error:
                name = "?"
            rows.append({"ip": c.laddr.ip, "port": c.laddr.port, "pid": c.pid, "process": name})
    exposed = [r for r in rows if r["ip"] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    return {"listening": len(rows), "exposed": len(exposed),
            "exposed_by_process": dict(Counter(r["process"].split(" ")[0] for r in exposed)),
            "exposed_rows": exposed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("burst")
    b.add_argument("--url", required=True)
    b.add_argument("-n", type=int, default=300)
    b.add_argument("--timeout", type=float, default=600)
    t = sub.add_parser("timeline")
    t.add_argument("--url", required=True)
    t.add_argument("--every", type=float, default=1.0)
    t.add_argument("--limit", type=float, default=600)
    t.add_argument("--log", type=Path, default=Path("serve-timeline.log"))
    t.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command that starts the app (optional)")
    p = sub.add_parser("ports")
    p.add_argument("--pid", type=int, required=True)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.what == "burst":
        got = burst(args.url, args.n, args.timeout)
    elif args.what == "timeline":
        got = timeline(args.url, [c for c in args.cmd if c != "--"], args.every, args.limit, args.log)
    else:
        got = ports(args.pid)
    text = json.dumps(got, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text if args.what != "timeline" else json.dumps({k: v for k, v in got.items() if k not in ("healthz", "requests")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
