"""The layers (docs/architecture.md): every import runs down, never up, stated here as data.

A module's *room* is its folder under ``xema_ray/`` (``xema_ray/analyzer/run.py`` -> ``analyzer``),
its file for the top-level schema modules (``xema_ray/plan.py`` -> ``plan``), or the top-level
folder outside the library (``planner``, ``deployments``, ``bench``, ``gpu_check``, ``loadtests``).
Every import of every module counts, the lazy ones inside functions too: a lazy import that runs
back up is the same cycle, only later.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("xema_ray", "planner", "deployments", "bench", "gpu_check", "loadtests")

#: rank per room, lowest first: a room may import its own rank and every rank below it
LAYERS: tuple[tuple[str, ...], ...] = (
    ("templates", "plan", "vocabulary", "deployment", "platforms", "placement", "hash_seed", "net", "configs",
     "host_budget", "expert_plan", "lora_pool"),
    ("models", "memory", "parallel"),
    ("deployment",),
    ("mitigation", "analyzer", "lora"),
    ("allocator",),
    ("profiling",),
    ("scheduling",),
    ("runtime",),
    ("measure",),
    ("sim", "planner"),
    ("serving",),
    ("deployments", "cli", "checkpoints", "bench", "gpu_check", "loadtests"),
)
RANK = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}

#: arrows forbidden although the ranks would allow them (same rank, or a rule of its own)
FORBIDDEN: frozenset[tuple[str, str]] = frozenset({
    ("mitigation", "analyzer"),  # the analyzer traces mitigated pipelines; primitives never trace
    ("models", "mitigation"),  # diffusers' rule: hooks sit above models
    ("lora", "analyzer"),  # as mitigation: the analyzer traces adapted pipelines, adapters never trace
    ("models", "memory"), ("memory", "models"),  # the trace is data; the analyzer joins the two
    ("planner", "serving"), ("planner", "deployments"),  # the planner reads a deployment's shape (xema_ray.deployment)
    ("sim", "planner"),
    ("bench", "tests"), ("gpu_check", "tests"), ("deployments", "tests"), ("loadtests", "tests"),
})
#: arrows up that are allowed, each named with its reason
ALLOWED_UP: dict[tuple[str, str], str] = {
    ("templates", "models"): "RequestTemplate.spec: the one named, lazy back-reference to its model's spec",
}
#: where torch.cuda may be touched (the allocator's binding installs the pluggable allocator)
CUDA_ROOMS = ("platforms", "allocator")
CUDA = re.compile(r"torch\.(cuda|backends\.(cuda|cudnn))\b")
OUTSIDE = ("planner", "deployments", "bench", "gpu_check", "loadtests", "tests")


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "xema_ray":
        return parts[1] if len(parts) > 1 else None
    return parts[0] if parts[0] in OUTSIDE else None


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                out.add(node.module)
                if node.module == "xema_ray":
                    out |= {f"xema_ray.{a.name}" for a in node.names}
    return out


def _scanned() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py"))


def _arrows() -> dict[tuple[str, str], list[str]]:
    arrows: dict[tuple[str, str], list[str]] = {}
    for path in _scanned():
        src = _room(_module_of(path))
        for target in _imported(path):
            dst = _room(target)
            if src and dst and src != dst:
                arrows.setdefault((src, dst), []).append(f"{path.relative_to(ROOT)} -> {target}")
    return arrows


def test_every_room_has_a_layer() -> None:
    rooms = {r for a in _arrows() for r in a}
    missing = sorted(r for r in rooms if r not in RANK and r != "tests")
    assert missing == [], f"rooms without a layer in LAYERS: {missing}"


def test_imports_run_down_the_layers() -> None:
    bad = []
    for (src, dst), where in sorted(_arrows().items()):
        up = dst == "tests" or RANK.get(dst, -1) > RANK.get(src, -1)
        if (src, dst) in FORBIDDEN or (up and (src, dst) not in ALLOWED_UP):
            bad.append(f"{src} -> {dst}: {where[:3]}")
    assert bad == [], "imports that run up a layer or break a rule:\n" + "\n".join(bad)


def test_the_allowed_arrow_up_stays_lazy() -> None:
    for (src, dst) in ALLOWED_UP:
        path = ROOT / "xema_ray" / f"{src}.py"
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        eager = [ast.unparse(n) for n in top if f"xema_ray.{dst}" in ast.unparse(n)]
        assert eager == [], f"{src} imports {dst} at module level: {eager}"


def test_cuda_is_touched_only_by_the_platforms_and_the_allocator_binding() -> None:
    offenders = []
    for path in _scanned():
        room = _room(_module_of(path))
        if path.parts[len(ROOT.parts)] in ("xema_ray", "planner", "deployments") and room not in CUDA_ROOMS:
            if CUDA.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], f"these modules reach CUDA outside xema_ray/platforms/ and xema_ray/allocator/: {offenders}"


def test_no_library_module_of_xema_ray_imports_planner() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "xema_ray").rglob("*.py"))
                 if p.name != "cli.py" and any(m.split(".")[0] == "planner" for m in _imported(p))]
    assert offenders == [], f"these xema_ray modules import planner: {offenders}"


def test_estimates_left_the_mitigation_library() -> None:
    import xema_ray.mitigation as mitigation

    for name in ("estimate_saving", "evenly_spread", "MemorySaving"):
        assert not hasattr(mitigation, name), name
    from planner.estimates import estimate_block_offload, estimate_saving, evenly_spread  # noqa: F401


#: one-algorithm files allowed past MAX_LINES, each with its reason
LONG_MODULES: dict[str, str] = {
    "planner/stages.py": "the planner's stages 1-4 (paper §7.3): one algorithm, read top to bottom",
}
MAX_LINES = 500


def test_modules_stay_small() -> None:
    long = {str(p.relative_to(ROOT)): n for top in ("xema_ray", "planner") for p in sorted((ROOT / top).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    unnamed = {p: n for p, n in long.items() if p not in LONG_MODULES}
    assert unnamed == {}, f"modules over {MAX_LINES} lines (split them by concern, or name the one algorithm): {unnamed}"


def test_serving_keeps_only_glue_at_its_root() -> None:
    # replica_bind.py: where each replica binds Serve's server, installed at replica start-up like ray_env's settings
    glue = {"__init__.py", "config.py", "startup.py", "ray_env.py", "replica_bind.py"}
    root = {p.name for p in (ROOT / "xema_ray" / "serving").glob("*.py")}
    assert root <= glue, f"serving/ holds only config and start-up glue at its root; move {sorted(root - glue)} into a room"


# ---- part E: determinism and fault tests that hold on any 2-core machine, loaded or not
#: fault-test modules (and the helpers they use) whose every sleep is a poll: inside a loop that
#: waits on a fact (an actor id dead, a probe answer newer than the fault, Serve's replica state),
#: never a fixed wait for a fault to take effect, which a loaded machine outlasts
FACT_WAITING_MODULES = ("tests/serving/test_hardening.py", "bench/scenarios/serve_app.py")


def _sleeps_outside_a_loop(tree: ast.AST) -> list[int]:
    lines: list[int] = []

    def visit(node: ast.AST, in_loop: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            in_loop = False  # a function's body runs where it is called, not where it is written
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sleep"
                and not in_loop):
            lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, in_loop or isinstance(node, ast.While | ast.For | ast.AsyncFor))

    visit(tree, False)
    return lines


def test_fault_tests_wait_on_facts_not_on_fixed_sleeps() -> None:
    fixed = {m: lines for m in FACT_WAITING_MODULES
             if (lines := _sleeps_outside_a_loop(ast.parse((ROOT / m).read_text())))}
    assert fixed == {}, f"fixed sleeps (wait on a fact in a polling loop instead): {fixed}"


def test_the_batch_size_bound_the_tests_hold_is_the_documented_one() -> None:
    from tests.batch_sizes import MEAN_ABS_BOUND

    assert f"**{MEAN_ABS_BOUND} of 255**" in (ROOT / "docs" / "tenancy.md").read_text()
    assert f"at most {MEAN_ABS_BOUND} of 255" in (ROOT / "docs" / "lora.md").read_text()
