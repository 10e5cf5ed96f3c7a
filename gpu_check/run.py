"""`make gpu-check`: the GPU tests, one process each, in priority order, results in --out.

Only the GPU test modules (``tests/**/test_*_gpu.py``) are collected, never a CPU one (and every
module they import inside their tests is imported too, as a collection check); each test
runs in its own ``pytest`` process (its own session: a timeout kills its children too) with its own
timeout, and ``gpu-check.json`` is rewritten after every test (status, seconds, return code or
signal, stderr tail, the JSON results the test wrote), so a segfault or a hang costs one test,
not the record. What tests write goes to a private folder ($XEMA_GPU_OUT); JSON results are
folded into ``gpu-check.json``, only the files the plan names (device-allocs records) are copied
to --out, and every test's output is appended to ``gpu-check.log``: at most 8 files come back.

On a machine without CUDA it writes a "no CUDA GPU" record and exits 0 (nothing faked, nothing
run), unless ``--dry-run``: then it collects as the GPU machine would and writes ``collected``,
``collection_errors`` and ``planned_files`` (exit 1 on a collection error). docs/gpu-check.md
gives the device calls; gpu_check/gpu_plan.py the plan.

Examples:
    python3 gpu_check/run.py --list
    python3 gpu_check/run.py --dry-run --out out
    python3 gpu_check/run.py --part 1 --out $OUT      # then --part 2 in a second call
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "gpu_check"
TAIL_CHARS = 3000
PREP_RECORD = Path(os.environ.get("XEMA_GPU_PREP", "/tmp/xema-gpu-prep.json"))
START_FRACTION = 0.6
RESULT_MAX_BYTES = 2 * 2**20  # a result JSON larger than this is copied, not folded in (if the plan names it)


def _prep_site() -> str | None:
    """Where gpu_check/gpu_prep.sh installed the kit (None: no prep record)."""
    try:
        site = json.loads(PREP_RECORD.read_text()).get("site")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return site if isinstance(site, str) else None


PREP_SITE = _prep_site()
if PREP_SITE is not None and PREP_SITE not in sys.path:  # the kit (pydantic among it) in a folder of its own
    sys.path.append(PREP_SITE)
sys.path.insert(0, str(KIT))
from gpu_plan import (  # noqa: E402  (gpu_check/ is not a package)
    GPU_MODULES_GLOB, MAX_OUT_FILES, PART_BUDGET_S, CollectionError, GpuCheckRecord, ReportPhase, TestRecord, plan_for)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    """The test process's environment: gpu_check/ (the plugin) and the repo prepended to PYTHONPATH,
    never replacing it (carried packages live there on the GPU machine)."""
    env = dict(os.environ)
    parts = [str(KIT), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if PREP_SITE is not None and PREP_SITE != sysconfig.get_paths()["purelib"]:
        parts.append(PREP_SITE)  # the kit went to a folder of its own (gpu_prep.sh fell back to it)
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the allocator tests choose their own
    # only the plugins named on the command line: the machine's own (cov, xdist, benchmark...) stay out
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env | extra


def _pytest(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "gpu_pytest_plugin", "-p", "no:cacheprovider",
            "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), *args]


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:  # a process killed mid-write
            continue
    return lines


def _modules(pattern: str) -> list[str]:
    base = Path(pattern)
    if base.is_absolute():
        return sorted(str(p) for p in Path(base.anchor).glob(str(base.relative_to(base.anchor))))
    return sorted(str(p.relative_to(REPO)) for p in REPO.glob(pattern))


def collect(pattern: str, work: Path, timeout_s: float = 180) -> tuple[list[str], list[CollectionError]]:
    """Collect the GPU modules in one pytest process, as a test process would import them."""
    modules = _modules(pattern)
    if not modules:
        return [], [CollectionError(nodeid=pattern, message="no GPU test module matches")]
    report = work / "collect.jsonl"
    log = work / "collect.log"
    with log.open("w") as f:
        try:
            proc = subprocess.run(_pytest(["--collect-only", "-q", "-m", "gpu", *modules]), cwd=REPO, stdout=f,
                                  stderr=subprocess.STDOUT, env=_child_env({"XEMA_GPU_REPORT": str(report)}),
                                  timeout=timeout_s)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    events = _events(report)
    collected = [e["nodeid"] for e in events if e["kind"] == "collected" and e.get("gpu")]
    errors = list({e["nodeid"]: CollectionError(nodeid=e["nodeid"], message=e["message"])
                   for e in events if e["kind"] == "collect_error"}.values())  # one per module
    if rc is None or (rc not in (0, 5) and not errors):
        tail = log.read_text(errors="replace")[-TAIL_CHARS:]
        errors.append(CollectionError(nodeid="(collection)", message=f"pytest --collect-only rc={rc}: {tail}"))
    return collected, errors + check_imports(modules)


_IMPORT_CHECK = """
import importlib, json, sys
bad = {}
for module, names in json.loads(sys.argv[1]).items():
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 -- reported, not raised
            bad.setdefault(module, []).append(f"{name}: {type(e).__name__}: {e}")
print(json.dumps(bad))
"""


def lazy_imports(modules: list[str]) -> dict[str, list[str]]:
    """Every module a GPU test module imports anywhere (inside its test functions too), by file."""
    out: dict[str, list[str]] = {}
    for m in modules:
        path = Path(m) if Path(m).is_absolute() else REPO / m
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        out[m] = sorted(names - {"__future__"})
    return out


def check_imports(modules: list[str], timeout_s: float = 180) -> list[CollectionError]:
    """Import what the GPU tests import inside their functions (collection only sees module
    level): a test that would fail on the GPU machine at its first line is a collection error."""
    wanted = lazy_imports(modules)
    test_dirs = sorted({str((Path(m) if Path(m).is_absolute() else REPO / m).parent) for m in modules})
    env = _child_env({})
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *test_dirs])  # as pytest's rootdir-less import does
    try:
        proc = subprocess.run([sys.executable, "-c", _IMPORT_CHECK, json.dumps(wanted)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [CollectionError(nodeid="(imports)", message=f"importing the tests' modules took over {timeout_s:.0f} s")]
    try:
        bad = json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return [CollectionError(nodeid="(imports)", message=f"rc={proc.returncode}: {proc.stderr[-TAIL_CHARS:]}")]
    return [CollectionError(nodeid=f"{m} (imports inside its tests)", message="; ".join(errors))
            for m, errors in bad.items()]


def plan(collected: list[str]) -> list[TestRecord]:
    ordered = sorted(((plan_for(n), n) for n in collected), key=lambda x: x[0][0])
    return [TestRecord(nodeid=n, order=i, part=e.part, expected_s=e.expected_s, timeout_s=e.timeout_s,
                       planned=bool(e.match), files=list(e.files)) for i, ((_, e), n) in enumerate(ordered)]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue


def _status(rec: TestRecord, timed_out: bool) -> None:
    """status and message from the phases the process reported, its return code and the clock."""
    failed = [p for p in rec.phases if p.outcome == "failed"]
    call = next((p for p in rec.phases if p.when == "call"), None)
    skipped = next((p for p in rec.phases if p.outcome == "skipped"), None)
    finished = any(p.when == "teardown" for p in rec.phases)
    if timed_out:
        rec.status, rec.message = "timeout", f"killed after {rec.timeout_s:.0f} s (its own timeout)"
    elif rec.returncode is not None and rec.returncode < 0:
        rec.status = "crashed"
        rec.message = f"the test process died of {rec.signal}" + ("" if finished else " before the test finished")
    elif failed:
        rec.status = "failed" if failed[0].when == "call" else "error"
        rec.message = failed[0].message
    elif skipped is not None:
        rec.status, rec.message = "skipped", skipped.message
    elif call is not None and call.outcome == "passed" and rec.returncode == 0:
        rec.status = "passed"
    else:
        rec.status = "crashed" if not finished else "error"
        rec.message = f"pytest exited {rec.returncode} without a test report"


def _tail(err: str) -> str | None:
    """The end of a test's stderr; after a crash, faulthandler's report from its start (the
    crashing frames come first, the pytest machinery after them)."""
    fatal = err.rfind("Fatal Python error")
    if fatal >= 0 and len(err) - fatal > TAIL_CHARS:
        return err[fatal:fatal + TAIL_CHARS // 2] + "\n[...]\n" + err[-TAIL_CHARS // 2:]
    return err[-TAIL_CHARS:] or None


def run_one(rec: TestRecord, work: Path, out: Path, log: Path, timeout_s: float) -> None:
    slug = f"t{rec.order:02d}"
    results = work / slug
    results.mkdir()
    report, stdout, stderr = work / f"{slug}.jsonl", work / f"{slug}.out", work / f"{slug}.err"
    env = _child_env({"XEMA_GPU_OUT": str(results), "XEMA_GPU_REPORT": str(report)})
    t0 = time.perf_counter()
    timed_out = False
    with stdout.open("wb") as so, stderr.open("wb") as se:
        proc = subprocess.Popen(_pytest(["-q", "-m", "gpu", rec.nodeid]), cwd=REPO, env=env, stdout=so, stderr=se,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)  # a hang, or children the test left behind
    rec.seconds = time.perf_counter() - t0
    rec.returncode = None if timed_out else proc.returncode
    if rec.returncode is not None and rec.returncode < 0:
        rec.signal = signal.Signals(-rec.returncode).name
    rec.phases = [ReportPhase.model_validate({k: v for k, v in e.items() if k != "kind" and k != "nodeid"})
                  for e in _events(report) if e["kind"] == "phase"]
    _status(rec, timed_out)
    err = stderr.read_bytes().decode(errors="replace")
    rec.stderr_tail = _tail(err)
    files = []
    for path in sorted(results.rglob("*")):
        if not path.is_file():
            continue
        if path.name in rec.files:
            shutil.copy2(path, out / path.name)
            files.append(path.name)
        elif path.suffix == ".json" and path.stat().st_size <= RESULT_MAX_BYTES:
            try:
                rec.results[path.name] = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                rec.results[path.name] = f"not JSON: {e}"
        else:
            rec.results[path.name] = f"{path.stat().st_size} bytes, not kept (not in the plan's files)"
    rec.files = files
    with log.open("a") as f:
        f.write(f"\n===== [{rec.order}] {rec.nodeid}: {rec.status} in {rec.seconds:.1f} s "
                f"(rc={rec.returncode}, signal={rec.signal}) =====\n")
        f.write(stdout.read_bytes().decode(errors="replace"))
        if err:
            f.write("----- stderr -----\n" + err)


def _allocator_summary(tests: list[TestRecord]) -> dict:
    out = {}
    for rec in tests:
        for name, r in rec.results.items():
            if name.startswith("allocator_gpu_") and isinstance(r, dict):
                static = r.get("static") if isinstance(r.get("static"), dict) else {}
                out[str(r.get("template", name))] = {k: r.get(k) for k in (
                    "static_over_request_active", "reserved_over_active", "caching_reserved_over_active",
                    "step_ratio", "outputs_equal", "analyzer", "device_allocs")} | {
                    "fallbacks": static.get("layout_misses") if static else None}
    return out


def write(record: GpuCheckRecord, out: Path) -> None:
    record.counts = {}
    for t in record.tests:
        record.counts[t.status] = record.counts.get(t.status, 0) + 1
    record.allocator = _allocator_summary(record.tests)
    tmp = out / ".gpu-check.json.tmp"
    tmp.write_text(record.model_dump_json(indent=1))
    tmp.replace(out / "gpu-check.json")


def _torch_facts(record: GpuCheckRecord) -> bool:
    try:
        import torch
    except ImportError:
        return False
    record.torch = torch.__version__
    # is_available() reads NVML / the driver; it does not create a CUDA context in this process
    record.cuda = torch.cuda.is_available()
    return record.cuda


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--part", choices=["1", "2", "all"], default="all", help="which part of the plan to run")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the tests of this run (default {PART_BUDGET_S:.0f} per part, none for all): "
                        f"a test starts only while {START_FRACTION * 100:.0f}%% of its expected seconds are left; "
                        "its timeout is cut to what is left")
    p.add_argument("--list", action="store_true", help="print the plan (collects; runs nothing)")
    p.add_argument("--dry-run", action="store_true", help="collect as the GPU machine would; write the plan; run nothing")
    p.add_argument("--modules", default=GPU_MODULES_GLOB, help="the GPU test modules (a glob under the repo)")
    p.add_argument("--run-without-cuda", action="store_true",
                   help="run the collected tests even without CUDA (rehearsals with planted tests only)")
    p.add_argument("--timeout", type=float, default=None, help="override every test's own timeout (seconds)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    mode = "dry-run" if args.dry_run or args.list else "run"
    record = GpuCheckRecord(mode=mode, started=_now(), part=args.part, python=platform.python_version())
    if PREP_RECORD.exists():
        try:
            record.prep = json.loads(PREP_RECORD.read_text())
        except json.JSONDecodeError:
            record.prep = {"error": f"{PREP_RECORD} is not JSON"}
    cuda = _torch_facts(record)
    if mode == "run" and not cuda and not args.run_without_cuda:
        record.mode = "no-gpu"
        record.skipped = "no CUDA GPU on this machine: the -m gpu tests were not run"
        record.finished = _now()
        write(record, args.out)
        print(record.skipped)
        return 0
    prep_failed = record.prep is not None and record.prep.get("status") != "ok"
    if mode == "run" and prep_failed:
        record.skipped = f"gpu_check/gpu_prep.sh failed: {record.prep.get('reason') if record.prep else None}"
        record.finished, record.returncode = _now(), 1
        write(record, args.out)
        print(record.skipped, file=sys.stderr)
        return 1
    if cuda:
        import torch

        record.device = torch.cuda.get_device_name(0)
    work = Path(tempfile.mkdtemp(prefix="xema-gpu-check-"))
    try:
        record.collected, record.collection_errors = collect(args.modules, work)
        tests = plan(record.collected)
        if args.part != "all":
            tests = [t for t in tests if str(t.part) == args.part]
        if args.timeout is not None:
            for t in tests:
                t.timeout_s = args.timeout
        record.tests = tests
        record.expected_s = sum(t.expected_s for t in tests)
        record.budget_s = args.budget if args.budget is not None else (PART_BUDGET_S if args.part != "all" else None)
        record.planned_files = ["gpu-check.json", "gpu-check.log"] + [f for t in tests for f in t.files]
        if len(record.planned_files) > MAX_OUT_FILES:
            record.collection_errors.append(CollectionError(
                nodeid="(plan)", message=f"{len(record.planned_files)} files planned, the device returns {MAX_OUT_FILES}"))
        if args.list:
            for part in sorted({t.part for t in tests}):
                rows = [t for t in tests if t.part == part]
                print(f"part {part}: {sum(t.expected_s for t in rows):.0f} s expected")
                for t in rows:
                    print(f"  {t.order:2d}  {t.expected_s:5.0f} s  (timeout {t.timeout_s:3.0f} s)  {t.nodeid}"
                          + ("" if t.planned else "  [unplanned]"))
            for e in record.collection_errors:
                print(f"COLLECTION ERROR {e.nodeid}: {e.message.splitlines()[-1] if e.message else ''}")
        if mode == "dry-run":
            record.finished = _now()
            record.seconds = time.perf_counter() - t_start
            record.returncode = 1 if record.collection_errors else 0
            write(record, args.out)
            if not args.list:
                print(f"collected {len(record.collected)} GPU tests, {len(record.collection_errors)} collection "
                      f"errors, {len(record.planned_files)} planned files, {record.expected_s:.0f} s expected")
            return record.returncode
        log = args.out / "gpu-check.log"
        log.write_text(f"gpu-check {record.started} part {args.part} on {record.device or 'no GPU'}\n")
        (work / "collect.log").exists() and log.open("a").write((work / "collect.log").read_text())
        write(record, args.out)
        t_tests = time.perf_counter()
        for rec in tests:
            left = None if record.budget_s is None else record.budget_s - (time.perf_counter() - t_tests)
            # started when 60 % of its estimate is left (estimates are rough; its timeout is cut to what is left)
            if left is not None and left < START_FRACTION * min(rec.expected_s, rec.timeout_s):
                rec.status, rec.message = "not_run", f"budget: {left:.0f} s left, {rec.expected_s:.0f} s expected"
                continue
            rec.status = "running"
            write(record, args.out)
            run_one(rec, work, args.out, log, rec.timeout_s if left is None else min(rec.timeout_s, left))
            print(f"[{rec.order:2d}] {rec.status:8s} {rec.seconds:6.1f} s  {rec.nodeid}", flush=True)
            write(record, args.out)
        record.finished = _now()
        record.seconds = time.perf_counter() - t_start
        bad = [t for t in tests if t.status in ("failed", "error", "timeout", "crashed")]
        record.returncode = 1 if bad or record.collection_errors else 0
        write(record, args.out)
        return record.returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
