"""The stream tests (``pytest -m streams``, tests/runtime/test_streams.py) against main's stream
handling, to show each of them fails there: torch's ``record_stream`` is all main had to keep a
block from reuse, and under the pluggable (static) allocator it does nothing, so ``mark_used`` is
made a no-op; main's host->device copies were not ordered after compute (``to_device`` without
``after_compute``); main's residency switch and pause moves (``git show main:...``) replace ours.

Usage: PYTHONHASHSEED=0 .venv/bin/python bench/streams_before_after.py [--ref main]
Writes bench/results/streams-before-after.json: per test, passed or the first line of its failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
import contextlib, subprocess
import xema_ray.platforms.streams as streams

streams.mark_used = lambda t, stream: None  # record_stream under CUDAPluggableAllocator: nothing
_to_device = streams.to_device


def to_device(host, device, stream, pending=None):
    saved = streams.TransferStream.after_compute
    streams.TransferStream.after_compute = lambda self: None  # main: no ordering after compute
    try:
        return _to_device(host, device, stream, pending)
    finally:
        streams.TransferStream.after_compute = saved


streams.to_device = to_device
import importlib
import sys


def _main_source(name):
    src = subprocess.run(["git", "show", "REF:" + name], capture_output=True, text=True, check=True).stdout
    ns = {"__name__": "main_" + name.replace("/", "_")[:-3]}
    sys.modules[ns["__name__"]] = type(sys)(ns["__name__"])
    exec(compile(src, "REF:" + name, "exec"), ns)
    return ns


residency = importlib.import_module("xema_ray.runtime.residency")
ns = _main_source("xema_ray/runtime/residency.py")
residency.ResidencyManager._move = ns["ResidencyManager"]._move
residency.ResidencyManager.__post_init__ = ns["ResidencyManager"].__post_init__
pause = importlib.import_module("xema_ray.runtime.pause")
ns = _main_source("xema_ray/runtime/pause.py")
pause.move_to_host, pause.move_back = ns["move_to_host"], ns["move_back"]
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ref", default="main", help="git ref whose residency.py / pause.py stand for today's code")
    ap.add_argument("--out", default=str(ROOT / "bench/results/streams-before-after.json"))
    args = ap.parse_args()
    tests = ["test_activation_offload_armed_with_a_layout", "test_activation_offload_unarmed", "test_block_offload_armed",
             "test_residency_switch", "test_pause_resume_of_an_offloaded_state"]
    results: dict[str, dict[str, str]] = {}
    for label, plugin in (("before", PLUGIN.replace("REF", args.ref)), ("after", None)):
        per: dict[str, str] = {}
        for test in tests:  # one process each: a failed test's tensors (its traceback) stay out of the next's arena
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "streams",
                       f"tests/runtime/test_streams.py::{test}", "-rA", "--tb=line"]
                env = {**os.environ, "COLUMNS": "2000", "PYTHONHASHSEED": "0"}
                if plugin is not None:
                    Path(tmp, "streams_before_plugin.py").write_text(plugin)
                    cmd += ["-p", "streams_before_plugin"]
                    env["PYTHONPATH"] = tmp
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env).stdout
            for line in out.splitlines():
                m = re.match(r"(PASSED|FAILED) tests/runtime/test_streams.py::(\w+)(?: - (.*))?", line)
                if m:
                    per[m.group(2)] = "passed" if m.group(1) == "PASSED" else (m.group(3) or "failed")
            print(f"{label} {test}: {per.get(test, 'no result')}", flush=True)
        results[label] = per
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
