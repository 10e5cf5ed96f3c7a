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
from collections.abc import Callable
from pathlib import Path

from tests.source_scan import ROOT, imported as _imported, module_of as _module_of, scanned as _scanned

#: rank per room, lowest first: a room may import its own rank and every rank below it
LAYERS: tuple[tuple[str, ...], ...] = (
    ("templates", "plan", "vocabulary", "platforms", "placement", "hash_seed", "net", "configs",
     "host_budget", "expert_plan", "lora_pool", "tier_plan", "ray_start"),
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


def _arrows(paths: list[Path] | None = None, room: Callable[[str], str | None] = _room,
            imported: Callable[[Path], set[str]] = _imported) -> dict[tuple[str, str], list[str]]:
    """Every import from one room to another (``room`` names a module's room), with where it is."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for path in _scanned() if paths is None else paths:
        src = room(_module_of(path))
        for target in imported(path):
            dst = room(target)
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


def test_every_module_at_servings_root_has_a_rank() -> None:
    # each module at serving/'s root is a room of its own (part A below): one that is not ranked in
    # SERVING_LAYERS, with the reason for its rank, belongs in a room
    root = {p.stem for p in (ROOT / "xema_ray" / "serving").glob("*.py")} - {"__init__"}
    unranked = sorted(root - set(SERVING_RANK))
    assert unranked == [], f"modules at serving/'s root without a rank in SERVING_LAYERS: {unranked}; rank them or move them into a room"


# ---- part A: serving/'s rooms ranked (each folder, and each module at serving/'s root, is a room)

SERVING = ROOT / "xema_ray" / "serving"

#: serving/'s rooms, lowest first, each rank with its reason. A room imports only rooms of a lower
#: rank (rooms of one rank never import each other): no import between rooms runs up, none cycles.
SERVING_LAYERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("messages", "frame_rate", "replica_bind"),
     "the words every room speaks: what crosses between the Router and a group (request, result, status with "
     "its layout counters, errors), a video template's frame rate, where a replica binds Serve's servers"),
    (("jobs", "scale"),
     "what a group writes and publishes, never reading a group: the job store, job progress and a group's job "
     "lifecycle; the replica summary and the policies over it (request router, autoscaling)"),
    (("group",),
     "one model's worker set behind a deployment and its ModelGroupConfig: it runs its jobs' lifecycle, "
     "publishes its summary for scale/'s policies, reports its counters"),
    (("stats",),
     "/v1/stats's answer and the Stats deployment: it gathers the groups' reports for the API and the console"),
    (("console",),
     "the operator view's data, built from the groups' reports, the replica summaries and /v1/stats; the Router serves it"),
    (("api",),
     "the Router: HTTP over every room below (the groups, the video job API over jobs/, the console's routes)"),
    (("config", "ray_env"),
     "the app composed: ServeConfig holds every room's config (ModelGroupConfig, the job store's, the API's auth "
     "and limits); ray_env sets Ray's environment, the API's proxy middlewares included"),
    (("startup",), "the checks a ServeConfig passes before the app starts"),
)
SERVING_RANK = {room: i for i, (rooms, _) in enumerate(SERVING_LAYERS) for room in rooms}


def _serving_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["xema_ray", "serving"] and len(parts) > 2 else None


def _serving_imported(path: Path) -> set[str]:
    """``_imported`` plus the modules a ``from xema_ray.serving import x`` (or ``from .. import x``) names."""
    out = _imported(path)
    module = _module_of(path)
    package = (module if path.name == "__init__.py" else module.rpartition(".")[0]).split(".")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] + [node.module] if node.level else [node.module]
            if ".".join(b for b in base if b) == "xema_ray.serving":
                out |= {f"xema_ray.serving.{a.name}" for a in node.names}
    return out


def _serving_arrows() -> dict[tuple[str, str], list[str]]:
    return _arrows(sorted(SERVING.rglob("*.py")), _serving_room, _serving_imported)


def test_every_serving_room_has_a_rank() -> None:
    rooms = {p.parent.name for p in SERVING.glob("*/__init__.py")} | ({p.stem for p in SERVING.glob("*.py")} - {"__init__"})
    assert sorted(rooms - set(SERVING_RANK)) == [], "serving rooms without a rank in SERVING_LAYERS"
    assert sorted(set(SERVING_RANK) - rooms) == [], "SERVING_LAYERS ranks rooms serving/ no longer has"
    assert all(reason for _, reason in SERVING_LAYERS), "every rank of SERVING_LAYERS says why"


def test_imports_between_serving_rooms_run_down() -> None:
    arrows = _serving_arrows()
    assert arrows, "no arrow between serving's rooms found: the scan is broken"
    up = [f"{src} -> {dst}: {where[:3]}" for (src, dst), where in sorted(arrows.items())
          if SERVING_RANK.get(dst, -1) >= SERVING_RANK.get(src, -1)]
    assert up == [], "imports between serving's rooms that do not run down SERVING_LAYERS:\n" + "\n".join(up)


# ---- inside planner/: no import cycle

def _planner_imports() -> dict[str, set[str]]:
    mods = {_module_of(p): p for p in sorted((ROOT / "planner").rglob("*.py"))}
    return {m: {t for t in _imported(p) if t in mods} for m, p in mods.items()}


def test_planner_modules_import_each_other_without_a_cycle() -> None:
    graph = _planner_imports()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == [], f"import cycles inside planner/ (lazy and TYPE_CHECKING imports count): {cycles}"
