"""`make gpu-check`: every `-m gpu` test, results as JSON under --out (GPU benchmarks are GPU tests
that write their measurements there through $XEMA_GPU_OUT). On a machine without CUDA it says so in
the JSON and exits 0: nothing is faked, nothing runs.

Among them, tests/gpu/test_allocator_gpu.py serves CogVideoX-5B 720×480×49 and Flux.2 1024² with the
static layout armed and records the GPU-only allocations: `allocator_gpu_*.json` (its figures are
summarised under "allocator" in gpu-check.json) and `device-allocs-*.json` (copy into
`<table>.layouts/device-allocs/<gpu>.json` to plan with them).

Example:
    python bench/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--timeout", type=int, default=480, help="seconds for the whole check (8 minutes)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch

        cuda = torch.cuda.is_available()
        summary["torch"] = torch.__version__
        summary["device"] = torch.cuda.get_device_name(0) if cuda else None
    except ImportError:
        cuda = False
    summary["cuda"] = cuda
    if not cuda:
        summary["skipped"] = "no CUDA GPU on this machine: the -m gpu tests were not run"
        (args.out / "gpu-check.json").write_text(json.dumps(summary, indent=1))
        print(summary["skipped"])
        return 0
    junit = args.out / "gpu-tests.xml"
    env = {**os.environ, "XEMA_GPU_OUT": str(args.out)}
    t0 = time.perf_counter()
    try:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={junit}", "tests"],
                            env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    summary["seconds"] = time.perf_counter() - t0
    summary["returncode"] = rc
    if junit.exists():
        cases = []
        for case in ET.parse(junit).getroot().iter("testcase"):
            status = "failed" if case.find("failure") is not None or case.find("error") is not None else (
                "skipped" if case.find("skipped") is not None else "passed")
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "status": status,
                          "seconds": float(case.get("time", 0))})
        summary["tests"] = cases
    summary["results"] = sorted(p.name for p in args.out.glob("*.json") if p.name != "gpu-check.json")
    allocator = {}
    for path in sorted(args.out.glob("allocator_gpu_*.json")):
        r = json.loads(path.read_text())
        allocator[r.get("template", path.stem)] = {k: r.get(k) for k in (
            "static_over_request_active", "reserved_over_active", "caching_reserved_over_active", "step_ratio",
            "outputs_equal", "analyzer", "device_allocs")} | {"fallbacks": r.get("static", {}).get("layout_misses")}
    if allocator:
        summary["allocator"] = allocator
    (args.out / "gpu-check.json").write_text(json.dumps(summary, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
