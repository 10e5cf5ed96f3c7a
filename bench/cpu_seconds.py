"""Run a command and report its wall time and the CPU seconds of its whole process tree (the
command, and every process it starts: Ray's raylet, GCS and workers), sampled with psutil.

CPU seconds are what a run costs on a shared machine: other jobs stretch the wall time, not
the CPU time. Samples every ``--interval`` s; a process that lives shorter than that is missed.

    python bench/cpu_seconds.py --json bench/results/planner-cpu.json -- python -m planner plan --templates paper ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--json", type=Path, default=None, help="write wall_s, cpu_s, load averages here")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    seen: dict[tuple[int, float], tuple[float, str]] = {}  # (pid, create time) -> (cpu s, name)
    samples: list[float] = []

    def sample() -> None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    seen[(p.pid, p.create_time())] = (t.user + t.system, p.name())
            except psutil.Error:
                continue

    while proc.poll() is None:
        sample()
        samples.append(os.getloadavg()[0])
        time.sleep(args.interval)
    wall = time.perf_counter() - t0
    cpu = sum(c for c, _ in seen.values())
    by_name: dict[str, float] = {}
    for c, name in seen.values():
        by_name[name] = by_name.get(name, 0.0) + c
    out = {"command": " ".join(cmd), "rc": proc.returncode, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
           "cpu_s_by_process": {k: round(v, 1) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])},
           "load_1min_before": round(load_before[0], 2), "load_1min_max": round(max(samples, default=0.0), 2),
           "load_1min_mean": round(sum(samples) / max(1, len(samples)), 2), "cpus": os.cpu_count()}
    print(json.dumps(out, indent=1), file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
