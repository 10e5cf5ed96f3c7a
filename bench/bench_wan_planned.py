"""Wan2.2-T2V-A14B on one 48 GB A6000 as planned, end to end: the node's host memory as the
planner counts it (``xema plan``'s table, ``host.pinned_bytes``), as the serving worker's own load
pins it (``xema verify``'s meta run, ``node.pinned_bytes``), and as ``xema serve``'s start-up check
counts it (``xema_ray.serving.startup.node_host``'s function, ``group_worker_host_bytes``); the
entry's static layout as verify reports it; and ``--host-budget 64GB`` refused naming the bytes.

Everything runs on the CPU (meta device, shape-only): the bytes are exact, no GPU is used.

Example:
    python bench/bench_wan_planned.py --out bench/results/wan_planned.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 10**9
PLAN = ["plan", "--templates", "wan2.2-t2v-a14b:1280x720x81", "--gpus", "1", "--budget", "48GB", "--hardware", "a6000",
        "--no-ray"]


def _xema(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xema_ray.cli", *args], capture_output=True, text=True, check=False)


def _children_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes: the planner's own work, which a
    busy shared machine does not inflate as it does the wall time."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from xema_ray.plan import PlanTable
    from xema_ray.runtime.host_bytes import group_worker_host_bytes

    with tempfile.TemporaryDirectory() as d:
        table_path, report_path = Path(d) / "wan.json", Path(d) / "verify.json"
        t0, cpu0 = time.perf_counter(), _children_cpu()
        planned = _xema(*PLAN, "--out", str(table_path))
        plan_s, plan_cpu_s = time.perf_counter() - t0, _children_cpu() - cpu0
        assert planned.returncode == 0, planned.stderr[-2000:]
        table = PlanTable.load(str(table_path))
        verified = _xema("verify", "--plan-table", str(table_path), "--json", str(report_path))
        report = json.loads(report_path.read_text())
        refused = _xema(*PLAN, "--host-budget", "64GB")
    (key, entry), = table.entries.items()
    startup = group_worker_host_bytes([entry.config], shared=False, share=True)
    assert table.host is not None and startup is not None
    row = {
        "template": key, "plan": entry.config.describe(),
        "planner_pinned_gb": table.host.pinned_bytes / GB,
        "verify_pinned_gb": report["node"]["pinned_bytes"] / GB,
        "startup_pinned_gb": startup.pinned_bytes / GB,
        "layout_ref": entry.config.layout_ref,
        "layout_not_kept": table.provenance.layouts_not_armed.get(key),
        "verify_layout_line": next((ln.strip() for ln in verified.stdout.splitlines() if "static layout" in ln), None),
        "host_budget_64gb_exit": refused.returncode,
        "host_budget_64gb_message": refused.stderr.strip().splitlines()[-1] if refused.stderr.strip() else "",
        "verify_device_peak_gb": report["entries"][0]["device_peak_bytes"] / GB,
        "verify_fits": report["entries"][0]["fits"],
        "verify_layout_misses": report["entries"][0]["layout_misses"],
        "plan_s": round(plan_s, 1),
        "plan_cpu_s": round(plan_cpu_s, 1),
    }
    for k, v in row.items():
        print(f"{k:<26} {v:.2f}" if isinstance(v, float) else f"{k:<26} {v}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": platform.node(), "rows": [row]}, indent=1))


if __name__ == "__main__":
    main()
