"""How long ``make serve`` takes to be ready, and where the time goes (BENCHMARKS.md "Start-up").

Starts ``xema serve CONFIG`` with a fresh ``HOME`` (nothing cached outside the clone) in its own
process session, polls ``/healthz`` until it answers 200 (every group can serve), reads the phases
from the command's log (Ray started, Serve started, the app built, the Router up), sums the CPU
seconds of every process of the run (those whose environment holds that ``HOME``) and counts them,
then sends SIGINT to the session and times how long the HTTP port takes to close.

    PYTHONPATH=. python bench/bench_startup.py [--config deployments/xema.yaml] [--json OUT]

On a machine running other work the wall times stretch; the CPU seconds divided by the cores
say what an idle machine would need at least.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[1]
#: log line -> phase (the first line matching each, seconds after the start)
PHASES = {
    "serve CLI running": r"Running config file",
    "Ray started": r"Started a local Ray instance",
    "Serve started": r"Started Serve in namespace",
    "app built": r"Imported and built app",
    "Router answering": r"xema_Router .* GET /healthz",
}


class StartupRun(BaseModel):
    config: str
    ready_s: float = Field(description="start -> /healthz 200")
    phases_s: dict[str, float] = Field(description="phase -> seconds after the start, from the log")
    processes: int = Field(description="processes of the run when ready")
    cpu_s: float = Field(description="CPU seconds (user + system) of those processes when ready")
    port_freed_s: float = Field(description="SIGINT to the session -> the HTTP port closed")
    load_average_1m: float = Field(description="the machine's load average when ready (other work stretches wall times)")


def _cpu_of_home(home: str) -> tuple[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    n, ticks = 0, 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            if f"HOME={home}".encode() not in env:
                continue
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        n += 1
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return n, ticks / tick


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def run(config: str, timeout_s: float = 600.0) -> StartupRun:
    port = yaml.safe_load((ROOT / config).read_text())["http_options"]["port"]
    if _port_open(port):
        raise SystemExit(f"port {port} is taken: stop what listens there first")
    home = tempfile.mkdtemp(prefix="xema-home-")
    log = Path(home) / "serve.log"
    env = {**os.environ, "HOME": home, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "xema"), "serve", config], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() - start > timeout_s:
                raise SystemExit(f"not ready: exit {proc.returncode}; see {log}")
            time.sleep(0.25)
        ready = time.monotonic() - start
        n, cpu = _cpu_of_home(home)
        load = os.getloadavg()[0]
        t0 = time.time() - ready  # the log's wall clock at the start
        phases: dict[str, float] = {}
        text = log.read_text()
        for name, pattern in PHASES.items():
            for line in text.splitlines():
                if re.search(pattern, line):
                    m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+)", line)
                    if m:
                        stamp = time.mktime(time.strptime(m[1][:19], "%Y-%m-%d %H:%M:%S")) + float("0." + m[1][20:])
                        phases[name] = round(stamp - t0, 1)
                    break
    finally:
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        while _port_open(port) and time.monotonic() - sent < 60:
            time.sleep(0.1)
        freed = time.monotonic() - sent
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return StartupRun(config=config, ready_s=round(ready, 1), phases_s=phases, processes=n, cpu_s=round(cpu, 1),
                      port_freed_s=round(freed, 2), load_average_1m=load)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="deployments/xema.yaml")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args()
    result = run(a.config)
    print(result.model_dump_json(indent=1))
    if a.json:
        Path(a.json).write_text(result.model_dump_json(indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
