"""The GPU check's discovery and collection (gpu_check/run.py); standard library only.

Discovery is by marker: every ``tests/**/*.py`` module whose source applies ``pytest.mark.gpu``
(read with ``ast``, never imported: a CPU test module may import what the GPU machine lacks) is a
GPU module, whatever its name. Those modules alone are collected, in one ``pytest --collect-only
-m gpu`` process, with the check's plugin reporting each test's node id and its ``gpu`` marker's
keyword arguments; then every module the GPU tests import inside their functions is imported in a
second process (one missing there is a collection error, not a test that fails at its first line
on the GPU machine).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from gpu_record import CollectionError

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "gpu_check"
TAIL_CHARS = 3000
#: PYTHONHASHSEED for every test process: the serving workers' (xema_ray/hash_seed.py), under which the
#: allocation streams the static layouts were solved for are the ones a run makes
HASH_SEED = "0"


def _is_gpu_mark(node: ast.AST) -> bool:
    """``pytest.mark.gpu`` / ``mark.gpu`` (called with arguments or not)."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "gpu" and (
        (isinstance(node.value, ast.Attribute) and node.value.attr == "mark")
        or (isinstance(node.value, ast.Name) and node.value.id == "mark"))


def uses_gpu_marker(path: Path) -> bool:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return False
    return any(_is_gpu_mark(n) for n in ast.walk(tree))


def discover(root: Path = REPO / "tests") -> list[str]:
    """The test modules that mark a test ``gpu`` (paths relative to the repo)."""
    return sorted(str(p.relative_to(REPO)) for p in root.rglob("test_*.py") if uses_gpu_marker(p))


def modules(pattern: str | None) -> list[str]:
    """``pattern`` (a glob under the repo, or an absolute one: rehearsals' planted modules), else discovery."""
    if pattern is None:
        return discover()
    base = Path(pattern)
    if base.is_absolute():
        return sorted(str(p) for p in Path(base.anchor).glob(str(base.relative_to(base.anchor))))
    return sorted(str(p.relative_to(REPO)) for p in REPO.glob(pattern))


def child_env(extra: dict[str, str], prep_site: str | None = None) -> dict[str, str]:
    """A test process's environment: gpu_check/ (the plugin) and the repo prepended to PYTHONPATH,
    never replacing it (carried packages live there on the GPU machine); string hashing seeded."""
    env = dict(os.environ)
    parts = [str(KIT), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if prep_site is not None and prep_site != sysconfig.get_paths()["purelib"]:
        parts.append(prep_site)  # the kit went to a folder of its own (gpu_prep.sh fell back to it)
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONHASHSEED"] = HASH_SEED
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the allocator tests choose their own
    # only the plugins named on the command line: the machine's own (cov, xdist, benchmark...) stay out
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env | extra


def pytest_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "gpu_pytest_plugin", "-p", "no:cacheprovider",
            "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), *args]


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:  # a process killed mid-write
            continue
    return lines


def collect(mods: list[str], work: Path, prep_site: str | None, timeout_s: float = 180
            ) -> tuple[list[str], dict[str, dict], list[CollectionError]]:
    """(node ids, their gpu markers' keyword arguments, collection errors) of ``mods``."""
    if not mods:
        return [], {}, [CollectionError(nodeid="(discovery)", message="no module marks a test gpu")]
    report, log = work / "collect.jsonl", work / "collect.log"
    with log.open("w") as f:
        try:
            proc = subprocess.run(pytest_cmd(["--collect-only", "-q", "-m", "gpu", *mods]), cwd=REPO, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=child_env({"XEMA_GPU_REPORT": str(report)}, prep_site))
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    evs = events(report)
    collected = [e["nodeid"] for e in evs if e["kind"] == "collected" and e.get("gpu")]
    markers = {e["nodeid"]: e.get("marker") or {} for e in evs if e["kind"] == "collected" and e.get("gpu")}
    errors = list({e["nodeid"]: CollectionError(nodeid=e["nodeid"], message=e["message"])
                   for e in evs if e["kind"] == "collect_error"}.values())  # one per module
    if rc is None or (rc not in (0, 5) and not errors):
        tail = log.read_text(errors="replace")[-TAIL_CHARS:]
        errors.append(CollectionError(nodeid="(collection)", message=f"pytest --collect-only rc={rc}: {tail}"))
    return collected, markers, errors + check_imports(mods, prep_site)


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


def lazy_imports(mods: list[str]) -> dict[str, list[str]]:
    """Every module a GPU test module imports anywhere (inside its test functions too), by file."""
    out: dict[str, list[str]] = {}
    for m in mods:
        path = Path(m) if Path(m).is_absolute() else REPO / m
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        out[m] = sorted(names - {"__future__"})
    return out


def check_imports(mods: list[str], prep_site: str | None, timeout_s: float = 180) -> list[CollectionError]:
    """Import what the GPU tests import inside their functions (collection only sees module level)."""
    wanted = lazy_imports(mods)
    test_dirs = sorted({str((Path(m) if Path(m).is_absolute() else REPO / m).parent) for m in mods})
    env = child_env({}, prep_site)
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
