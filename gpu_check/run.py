"""`make gpu-check` (also `python3 bench/gpu_check.py`): the GPU tests, one process each, in priority order.

Standard library only until the tests run: ``gpu-check.json`` is written first, before anything
else is imported, so a machine where the kit (pydantic among it) is missing still returns a
record saying why. The GPU tests are found by their ``gpu`` marker (gpu_check/gpu_collect.py) and
ordered by the table in gpu_check/gpu_plan.py. Each test runs in its own ``pytest`` process (its
own process session: a timeout kills its children too) with ``PYTHONHASHSEED=0``, its own timeout and
``$XEMA_GPU_HOST_BUDGET_BYTES`` (the share of the machine's RAM it may pin); ``gpu-check.json`` is
rewritten after every test, so a segfault or a hang costs one test, not the record. A test whose
prep step failed (gpu_check/gpu_prep.sh: no Python.h, say, fails the allocator's build) is
``skipped`` with that step's reason while the others run. ``--until`` (a unix time) stops starting
tests that cannot finish by then; they are recorded ``not_run`` with the reason. JSON results the
tests write are folded into ``gpu-check.json``; only the files the plan names are copied to --out,
and every test's output is appended to ``gpu-check.log``: at most 8 files come back.

On a machine without CUDA it writes a "no CUDA GPU" record and exits 0 (nothing run), unless
``--dry-run``: then it collects as the GPU machine would (exit 1 on a collection error).
``--list`` prints the plan laid out in the device time and both device calls, ready to
send. docs/gpu-check.md.

Examples:
    python3 gpu_check/run.py --list
    python3 gpu_check/run.py --dry-run --out out
    python3 gpu_check/run.py --part 1 --until 1767000000 --out $OUT   # then --part 2 --until ... in call 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

KIT_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(KIT_DIR))
from gpu_collect import REPO, child_env, collect, events, modules, pytest_cmd  # noqa: E402  (not a package)
from gpu_plan import (  # noqa: E402
    BASE_NEEDS, COLLECT_S, DEVICE_RAM_BYTES, DEVICE_S, HOST_PIN_SHARE, MACHINE_KIND, MAX_OUT_FILES, PLAN, PREP_COLD_S,
    PREP_WARM_S, Timeline, plan_for)
from gpu_record import (  # noqa: E402
    CollectionError, GpuCheckRecord, ReportPhase, TestRecord, prep_steps, write_record)

TAIL_CHARS = 3000
PREP_RECORD = Path(os.environ.get("XEMA_GPU_PREP", "/tmp/xema-gpu-prep.json"))
RESULT_MAX_BYTES = 2 * 2**20  # a result JSON larger than this is not folded in (copied if the plan names it)
VERSIONS = ("torch", "transformers", "huggingface-hub", "tokenizers", "diffusers", "pydantic", "safetensors",
            "numpy", "pytest")
BAD = ("failed", "error", "timeout", "crashed")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _read_prep() -> dict | None:
    if not PREP_RECORD.exists():
        return None
    try:
        prep = json.loads(PREP_RECORD.read_text())
        return prep if isinstance(prep, dict) else {"status": "failed", "reason": f"{PREP_RECORD} is not an object"}
    except (OSError, json.JSONDecodeError) as e:
        return {"status": "failed", "reason": f"{PREP_RECORD} unreadable: {e}"}


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def plan(collected: list[str], markers: dict[str, dict]) -> list[TestRecord]:
    ordered = sorted(((plan_for(n, markers.get(n)), n) for n in collected), key=lambda x: x[0][0])
    return [TestRecord(nodeid=n, order=i, part=e.part, expected_s=e.expected_s, timeout_s=e.timeout_s,
                       planned=priority < len(PLAN), needs=[*BASE_NEEDS, *e.needs], files=list(e.files),
                       device_gb=e.device_gb)
            for i, ((priority, e), n) in enumerate(ordered)]


def _held_back(rec: TestRecord, steps: dict[str, tuple[str, str | None]]) -> str | None:
    """Why a failed prep step keeps ``rec`` from running (None: everything it needs is ready)."""
    for need in rec.needs:
        status, reason = steps.get(need, ("ok", None))  # a step the prep record lacks: not known to fail
        if status != "ok":
            return f"prep step {need} {status}: {reason}"
    return None


def _short_of_memory(rec: TestRecord, device_bytes: int | None) -> str | None:
    """Why the device is too small for ``rec`` (None: it fits, or its memory was not read)."""
    if device_bytes is None or rec.device_gb * 1e9 <= device_bytes:
        return None
    return f"needs {rec.device_gb:.0f} GB of device memory, the device has {device_bytes / 1e9:.1f} GB"


def device_memory_bytes() -> int | None:
    """GPU 0's memory as nvidia-smi reports it (no CUDA context in this process), None if unread."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return int(float(out.splitlines()[0])) * 2**20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def shm_dir() -> Path:
    """Where the tests' shared weight segments live (xema_ray/platforms/host_memory.py's rule)."""
    return Path(os.environ.get("XEMA_SHM_DIR") or "/dev/shm")


def sweep_segments(directory: Path) -> list[str]:
    """Remove the ``xema-*`` files a test left in ``directory`` (a killed test's segments stay in RAM
    otherwise, and the next test finds the tmpfs full): ``name (bytes)`` for each."""
    left = []
    for path in sorted(directory.glob("xema-*")) if directory.is_dir() else []:
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        left.append(f"{path.name} ({size:,} bytes)")
    return left


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
    """The end of a test's stderr; after a crash, faulthandler's report from its start."""
    fatal = err.rfind("Fatal Python error")
    if fatal >= 0 and len(err) - fatal > TAIL_CHARS:
        return err[fatal:fatal + TAIL_CHARS // 2] + "\n[...]\n" + err[-TAIL_CHARS // 2:]
    return err[-TAIL_CHARS:] or None


def run_one(rec: TestRecord, work: Path, out: Path, log: Path, timeout_s: float, env_extra: dict[str, str],
            prep_site: str | None) -> None:
    slug = f"t{rec.order:02d}"
    results = work / slug
    results.mkdir()
    report, stdout, stderr = work / f"{slug}.jsonl", work / f"{slug}.out", work / f"{slug}.err"
    env = child_env({"XEMA_GPU_OUT": str(results), "XEMA_GPU_REPORT": str(report), **env_extra}, prep_site)
    rec.timeout_s = round(timeout_s, 1)
    t0 = time.perf_counter()
    timed_out = False
    with stdout.open("wb") as so, stderr.open("wb") as se:
        proc = subprocess.Popen(pytest_cmd(["-q", "-m", "gpu", rec.nodeid]), cwd=REPO, env=env, stdout=so, stderr=se,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)  # a hang, or children the test left behind
    rec.seconds = time.perf_counter() - t0
    rec.shm_left = sweep_segments(shm_dir())  # every process of the test is gone: nothing maps them
    rec.returncode = None if timed_out else proc.returncode
    if rec.returncode is not None and rec.returncode < 0:
        rec.signal = signal.Signals(-rec.returncode).name
    rec.phases = [ReportPhase(when=str(e.get("when")), outcome=str(e.get("outcome")),
                              duration=float(e.get("duration") or 0), message=e.get("message"))
                  for e in events(report) if e["kind"] == "phase"]
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
        if rec.shm_left:
            f.write(f"removed from {shm_dir()}: {', '.join(rec.shm_left)}\n")
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
    record.allocator = _allocator_summary(record.tests)
    write_record(record, out)


def _torch_facts(record: GpuCheckRecord) -> bool:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 -- a broken torch is recorded, not raised
        record.skipped = f"torch does not import: {type(e).__name__}: {e}"
        return False
    record.torch = torch.__version__
    record.cuda = torch.cuda.is_available()  # NVML / the driver; no CUDA context in this process
    if record.cuda:
        record.device = torch.cuda.get_device_name(0)
    return record.cuda


def print_list(tests: list[TestRecord], errors: list[CollectionError], start: float) -> None:
    """Both parts laid out in the device time (machine start counted) and the two calls; part 3,
    what the device time leaves out, listed for a later run."""
    start = int(start)
    line = Timeline(start=start, part1_expected_s=sum(t.expected_s for t in tests if t.part == 1),
                    part2_expected_s=sum(t.expected_s for t in tests if t.part == 2))
    print(f"device session of {DEVICE_S} s from the first call (unix {start}), machine start counted:")
    for what, a, b in line.rows():
        print(f"  {a:4.0f} - {b:4.0f} s  {what}")
    untils = {1: line.until1, 2: line.until2}
    for part in (1, 2, 3):
        rows = [t for t in tests if t.part == part]
        if part == 3:
            print(f"part 3: {sum(t.expected_s for t in rows):.0f} s of tests outside the {DEVICE_S} s "
                  "(a later run: --part 3)")
            clock, until = 0.0, float("inf")
        else:
            expected, window = line.expected_s(part), line.window_s(part)
            prep = PREP_COLD_S if part == 1 else PREP_WARM_S
            print(f"part {part}: {expected:.0f} s expected, {window:.0f} s until --until {untils[part]} "
                  f"(prep {prep} s + collection {COLLECT_S} s + tests {expected - prep - COLLECT_S:.0f} s)"
                  + ("" if expected <= window else f"  OVER its window by {expected - window:.0f} s")
                  + ("" if part == 1 else f"; {max(line.part2_window_cold_s, 0):.0f} s of tests if call 2 "
                                          "finds the machine gone"))
            clock, until = (line.call1_from if part == 1 else line.call2_from) + prep + COLLECT_S, untils[part]
        for t in rows:
            fits = clock + t.expected_s <= until
            clock += t.expected_s if fits else 0
            print(f"  {t.order:2d}  {t.expected_s:5.0f} s  (timeout {t.timeout_s:3.0f} s)  {t.nodeid}"
                  + ("" if t.planned else "  [unplanned]")
                  + ("" if t.needs == list(BASE_NEEDS) else f"  needs {','.join(t.needs[len(BASE_NEEDS):])}")
                  + (f"  {t.device_gb:.0f} GB" if t.device_gb else "")
                  + ("" if fits else "  [expected not run: past --until]"))
    for e in errors:
        print(f"COLLECTION ERROR {e.nodeid}: {e.message.splitlines()[-1] if e.message else ''}")
    print("the two device calls (send call 2 verbatim as soon as call 1 returns):")
    for part, until in untils.items():
        print(f'  run(kind="{MACHINE_KIND}", carry=[".whl"], timeout_s=600, command="bash gpu_check/gpu_prep.sh; '
              f'PYTHONUNBUFFERED=1 python3 gpu_check/run.py --part {part} --until {until} --out $OUT")')


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--part", choices=["1", "2", "3", "all"], default="all",
                   help="which part of the plan to run (3: what the two calls leave out, for a later run)")
    p.add_argument("--until", type=float, default=None,
                   help="unix time: no test starts that is not expected to finish by then (those are recorded "
                        "not_run); a running test's timeout is cut to it. --list prints both calls' values")
    p.add_argument("--budget", type=float, default=None, help="seconds for this run's tests (as --until, relative)")
    p.add_argument("--start", type=float, default=None, help="--list: unix time of the first device call (default now)")
    p.add_argument("--list", action="store_true", help="print the plan in the device time and both calls (runs nothing)")
    p.add_argument("--dry-run", action="store_true", help="collect as the GPU machine would; write the plan; run nothing")
    p.add_argument("--modules", default=None, help="a glob of test modules (default: every module marking a test gpu)")
    p.add_argument("--run-without-cuda", action="store_true",
                   help="run the collected tests even without CUDA (rehearsals with planted tests only)")
    p.add_argument("--timeout", type=float, default=None, help="override every test's own timeout (seconds)")
    p.add_argument("--host-ram-bytes", type=int, default=DEVICE_RAM_BYTES,
                   help=f"the machine's RAM; each test may pin {HOST_PIN_SHARE:.0%} of it")
    p.add_argument("--device-memory-bytes", type=int, default=None,
                   help="the GPU's memory (default: nvidia-smi's); a test that needs more is skipped")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start, clock = time.perf_counter(), time.time()
    mode = "dry-run" if args.dry_run or args.list else "run"
    prep = _read_prep()
    site = prep.get("site") if prep and isinstance(prep.get("site"), str) else None
    if site is not None and site not in sys.path:
        sys.path.append(site)  # the kit's folder, for the versions read below
    host_budget = int(args.host_ram_bytes * HOST_PIN_SHARE)
    record = GpuCheckRecord(mode=mode, started=_now(), part=args.part, python=platform.python_version(),
                            until=args.until, clock_at_start=clock, prep=prep, prep_steps=prep_steps(prep),
                            versions=_versions(), host_budget_bytes=host_budget,
                            env={"PYTHONHASHSEED": "0", "XEMA_GPU_HOST_BUDGET_BYTES": str(host_budget)})
    write(record, args.out)  # first: nothing beyond the standard library imported yet
    cuda = _torch_facts(record)
    record.device_memory_bytes = args.device_memory_bytes if args.device_memory_bytes is not None else (
        device_memory_bytes() if cuda else None)
    if mode == "run" and not cuda and not args.run_without_cuda:
        record.mode = "no-gpu"
        record.skipped = record.skipped or "no CUDA GPU on this machine: the -m gpu tests were not run"
        record.finished, record.returncode = _now(), 0
        write(record, args.out)
        print(record.skipped)
        return 0
    steps = {s.name: (s.status, s.reason) for s in record.prep_steps}
    base_failed = [f"prep step {n} {steps[n][0]}: {steps[n][1]}" for n in BASE_NEEDS if steps.get(n, ("ok",))[0] != "ok"]
    if mode == "run" and prep is not None and prep.get("status") != "ok" and not record.prep_steps:
        base_failed.append(f"gpu_check/gpu_prep.sh failed: {prep.get('reason')}")
    if mode == "run" and base_failed:  # nothing can import the project: collecting would only say so again
        record.skipped = "; ".join(base_failed) + " (no test can run)"
        record.finished, record.returncode = _now(), 1
        write(record, args.out)
        print(record.skipped, file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="xema-gpu-check-"))
    try:
        record.collected, markers, record.collection_errors = collect(modules(args.modules), work, site)
        tests = plan(record.collected, markers)
        if args.part != "all":
            tests = [t for t in tests if str(t.part) == args.part]
        if args.timeout is not None:
            for t in tests:
                t.timeout_s = args.timeout
        record.tests = tests
        record.expected_s = sum(t.expected_s for t in tests)
        record.budget_s = args.budget
        record.planned_files = ["gpu-check.json", "gpu-check.log"] + [f for t in tests for f in t.files]
        if len(record.planned_files) > MAX_OUT_FILES:
            record.collection_errors.append(CollectionError(
                nodeid="(plan)", message=f"{len(record.planned_files)} files planned, the device returns {MAX_OUT_FILES}"))
        if args.list:
            print_list(tests, record.collection_errors, args.start if args.start is not None else time.time())
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
        if (work / "collect.log").exists():
            with log.open("a") as f:
                f.write((work / "collect.log").read_text())
        write(record, args.out)
        deadlines = [d for d in (args.until, None if args.budget is None else time.time() + args.budget) if d is not None]
        deadline = min(deadlines) if deadlines else None
        for rec in tests:
            held = _held_back(rec, steps) or _short_of_memory(rec, record.device_memory_bytes)
            if held is not None:
                rec.status, rec.message = "skipped", held
                continue
            left = None if deadline is None else deadline - time.time()
            if left is not None and left < rec.expected_s:
                rec.status = "not_run"
                rec.message = f"--until: {max(left, 0):.0f} s left, {rec.expected_s:.0f} s expected"
                continue
            rec.status = "running"
            write(record, args.out)
            run_one(rec, work, args.out, log, rec.timeout_s if left is None else min(rec.timeout_s, left),
                    record.env, site)
            print(f"[{rec.order:2d}] {rec.status:8s} {rec.seconds:6.1f} s  {rec.nodeid}", flush=True)
            write(record, args.out)
        record.finished = _now()
        record.seconds = time.perf_counter() - t_start
        bad = [t for t in tests if t.status in BAD]
        record.returncode = 1 if bad or record.collection_errors or (prep or {}).get("status") not in (None, "ok") else 0
        write(record, args.out)
        return record.returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
