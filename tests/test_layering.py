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


#: functions in xema_ray/ and planner/ allowed past MAX_FUNCTION_LINES (at most MAX_LONG_FUNCTIONS),
#: each with its reason; every other function is split along its seams (named helpers doing one job
#: each), never squeezed by joining statements: a length rule must not move work into length
LONG_FUNCTIONS: dict[str, str] = {}
MAX_FUNCTION_LINES = 80
MAX_LONG_FUNCTIONS = 3


def _function_lengths(tree: ast.Module) -> dict[str, int]:
    """Lines of each function and method (``Class.method``), from its ``def`` (decorators excluded) to
    its last line; a function nested in another is counted within its parent, not on its own."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                out[name] = max(out.get(name, 0), (child.end_lineno or child.lineno) - child.lineno + 1)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:  # a def under ``if TYPE_CHECKING:``, ``try:`` ...
                visit(child, prefix)

    visit(tree, "")
    return out


def _long_functions() -> dict[str, int]:
    return {f"{p.relative_to(ROOT).as_posix()}:{name}": n
            for top in ("xema_ray", "planner") for p in sorted((ROOT / top).rglob("*.py"))
            for name, n in _function_lengths(ast.parse(p.read_text())).items() if n > MAX_FUNCTION_LINES}


def test_functions_stay_short() -> None:
    long = _long_functions()
    unnamed = {f: n for f, n in long.items() if f not in LONG_FUNCTIONS}
    assert unnamed == {}, (f"functions over {MAX_FUNCTION_LINES} lines (split each along its seams into named "
                           f"helpers doing one job each): {unnamed}")
    stale = sorted(f for f in LONG_FUNCTIONS if f not in long)
    assert stale == [], (f"LONG_FUNCTIONS names functions that are gone or {MAX_FUNCTION_LINES} lines or fewer "
                         f"now (drop them): {stale}")


def test_long_functions_are_few_and_each_has_its_reason() -> None:
    assert len(LONG_FUNCTIONS) <= MAX_LONG_FUNCTIONS, f"at most {MAX_LONG_FUNCTIONS} long functions: {sorted(LONG_FUNCTIONS)}"
    assert [f for f, why in LONG_FUNCTIONS.items() if not why.strip()] == []


def test_a_function_counts_from_its_def_with_nested_functions_inside() -> None:
    src = ("@decorator\ndef f():\n    def g():\n        pass\n    return g\n\n\n"
           "class C:\n    @property\n    def m(self):\n        return 1\n\n\nif X:\n    def h():\n        pass\n")
    assert _function_lengths(ast.parse(src)) == {"f": 4, "C.m": 2, "h": 2}


def test_serving_keeps_only_glue_at_its_root() -> None:
    # each module at serving/'s root is a room of its own (part A below): one that is not ranked in
    # SERVING_LAYERS, with the reason for its rank, belongs in a room
    root = {p.stem for p in (ROOT / "xema_ray" / "serving").glob("*.py")} - {"__init__"}
    unranked = sorted(root - set(SERVING_RANK))
    assert unranked == [], f"modules at serving/'s root without a rank in SERVING_LAYERS: {unranked}; rank them or move them into a room"


# ---- lead: a broken install fails; the project speaks of itself alone

#: ``pytest.importorskip`` allowed for these modules only, each with its reason (none: every package the
#: tests import is a dependency or in the ``dev`` extra, so a missing one is a broken install and must fail)
IMPORTORSKIP_ALLOWED: dict[str, str] = {}
IMPORTORSKIP = re.compile(r"importorskip\(\s*[\"']([\w.]+)[\"']")


def test_no_test_skips_when_a_dependency_or_our_own_module_is_missing() -> None:
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: {m}" for m in IMPORTORSKIP.findall(text) if m not in IMPORTORSKIP_ALLOWED]
        tree = ast.parse(text)
        for node in ast.walk(tree):  # `except ImportError: pytest.skip(...)` is the same skip, spelled out
            if isinstance(node, ast.ExceptHandler) and node.type is not None and any(
                    n in ast.unparse(node.type) for n in ("ImportError", "ModuleNotFoundError")):
                if any(isinstance(c, ast.Call) and ast.unparse(c.func).endswith("skip") for s in node.body for c in ast.walk(s)):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: skip on ImportError")
    assert offenders == [], "tests that skip where a broken install should fail:\n" + "\n".join(offenders)


#: phrases about how a text was produced, or a build machine's paths: a user reading the record of a
#: result needs the command, the figure, the machine and the date, nothing of the workplace
WORKPLACE = re.compile("|".join((
    r"\b(?:this|that|the same|previous|last|earlier|next|a|each|every|other|these|those)\s+sessions?\b(?!\s*(?:directory|dir|id|name))",
    r"\bsessions?'\s", r"\bsession's\s+(?:work|load|jobs?|tests|runs?|end|own repo|device|measurements)",
    r"\bdevice tool\b", r"\b(?:was|were|is|are|be|been|being)\s+lent\b", r"\blent\s+(?:to|one|a)\b",
    r"\bhelper session", r"\bthe CEO\b",
    r"(?<![\w.])/work/", r"(?<![\w.])/root/", r"(?<![\w/])shared/(?:model-configs|seeds|ARCHITECTURE|STYLE)",
    r"xema-heavy\.lock", r"\bwt-[a-z][\w-]*/",
    # a document outside the repository (the measured facts the code cites are in docs/measured-facts.md)
    r"(?-i:\bARCHITECTURE\.md)", r"(?-i:\bSTYLE\.md)",
)), re.IGNORECASE)
#: files whose text is data recorded from a tool (Ray's metric labels name its own "session_..." directory)
WORKPLACE_EXEMPT = ("tests/test_layering.py",)


def _tracked_text_files() -> list[Path]:
    import subprocess

    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    out = []
    for name in (n.decode() for n in names if n):
        path = ROOT / name
        if name in WORKPLACE_EXEMPT or not path.is_file():
            continue
        head = path.read_bytes()[:8192]
        if b"\0" not in head:
            out.append(path)
    return out


def test_no_tracked_text_speaks_of_its_making_or_of_a_build_machine() -> None:
    hits = []
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if m := WORKPLACE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {m.group(0)!r}")
    assert hits == [], f"{len(hits)} workplace phrases or build-machine paths in tracked text:\n" + "\n".join(hits[:80])


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


# ---- part B: a model is known in its spec only (docs/architecture.md, "Where a model is known")
#: where model facts may be tested by name: the specs themselves
SPEC_ROOM = ROOT / "xema_ray" / "models"
#: what must not ask which model it holds: the library outside the specs, and the planner
SPEC_BLIND = ("xema_ray", "planner")


def _model_words() -> frozenset[str]:
    """Every registered model name and every spec family: the literals a comparison outside the
    specs may not hold."""
    from xema_ray.models import MODEL_NAMES, get_model_spec

    return frozenset(MODEL_NAMES) | {get_model_spec(m).family for m in MODEL_NAMES}


def _literals(node: ast.AST) -> list[str]:
    """The string literals of a comparison's side: a constant, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _literals(e)]
    return []


def _is_family(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "family") or (isinstance(node, ast.Name) and node.id == "family")


def _model_tests(source: str, words: frozenset[str]) -> list[tuple[int, str]]:
    """(line, text) of each comparison (``==``, ``!=``, ``in``, ``not in``, ...) or ``match`` case
    that asks which model it holds: one side a ``family`` or a model's name or family as a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_family(s) for s in sides) or any(w in words for s in sides for w in _literals(s)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and any(w in words for w in _literals(node.value)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_model_test_finder_finds_family_and_name_tests() -> None:
    words = frozenset({"flux2", "tiny-flux2"})
    src = ("a = spec.family == 'wan'\nb = family != x\nc = t.model in ('tiny-flux2', 'other')\n"
           "d = 'flux2' not in names\ne = spec.kind == 'video'\nf = {'flux2': 1}['flux2']\n")
    assert [line for line, _ in _model_tests(src, words)] == [1, 2, 3, 4]


def test_no_model_is_known_outside_its_spec() -> None:
    words = _model_words()
    found = [f"{path.relative_to(ROOT)}:{line}: {text}"
             for top in SPEC_BLIND for path in sorted((ROOT / top).rglob("*.py")) if SPEC_ROOM not in path.parents
             for line, text in _model_tests(path.read_text(), words)]
    assert found == [], ("these modules ask which model they hold; ask the spec instead (a ModelSpec hook: "
                         "block_work, transformer_passes_per_step, sequence_parallel_split, ...):\n" + "\n".join(found))


# ---- part C: the planner a list of passes; plan() prints nothing; no import cycle inside planner/

#: the planner's modules that may print or choose the process's exit status, each with its reason
PLANNER_SPEAKERS: dict[str, str] = {
    "planner/cli.py": "the command line: says the PlanResult and PlanError's exit code",
    "planner/__main__.py": "``python -m planner``: the process's entry and its exit status",
}
#: the run's passes in order (``planner.pipeline.PASSES``): a new pass is added here with its place
PLANNER_PASSES = ("templates", "load_aware", "groups", "expert_switch", "host_memory", "table", "layouts", "write")
GROUP_PASSES = ("residency", "text_encoder", "expert_switch", "decode_stage")


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


def _speaks(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("print", "exit", "quit"):
            return f.id
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in (
                ("sys", "exit"), ("os", "_exit")):
            return f"{f.value.id}.{f.attr}"
        # sys.stdout.write / sys.stderr.write
        if isinstance(f, ast.Attribute) and f.attr == "write" and isinstance(f.value, ast.Attribute) \
                and isinstance(f.value.value, ast.Name) and f.value.value.id == "sys":
            return f"sys.{f.value.attr}.write"
    if isinstance(node, ast.Raise) and node.exc is not None:
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(exc, ast.Name) and exc.id == "SystemExit":
            return "raise SystemExit"
    return None


def test_only_the_planner_cli_prints_or_exits() -> None:
    hits = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name in PLANNER_SPEAKERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (what := _speaks(node)) is not None:
                hits.append(f"{name}:{node.lineno}: {what}")
    assert hits == [], "plan() prints nothing: say it in planner/cli.py from the PlanResult / PlanEvent:\n" + "\n".join(hits)


def test_the_planner_is_an_ordered_list_of_named_passes() -> None:
    import dataclasses

    from planner.finishing import GROUP_PASSES as GROUPS
    from planner.pipeline import PASSES, PlanState

    assert tuple(p.name for p in PASSES) == PLANNER_PASSES
    assert tuple(p.name for p in GROUPS) == GROUP_PASSES
    fields = {f.name for f in dataclasses.fields(PlanState)}
    written: set[str] = set()
    for p in PASSES:
        assert set(p.reads) | set(p.writes) <= fields, f"pass {p.name} names what PlanState does not hold"
        unwritten = set(p.reads) - written
        assert not unwritten, f"pass {p.name} reads {sorted(unwritten)} before any pass writes it"
        written |= set(p.writes)


def test_no_stage_is_numbered_by_a_fraction() -> None:
    fraction = re.compile(r"[Ss]tages? \d[½¾¼]|\d[½¾¼]")
    hits = [f"{p.relative_to(ROOT)}:{i}" for top in ("planner", "docs") for p in sorted((ROOT / top).rglob("*"))
            if p.suffix in (".py", ".md")
            for i, line in enumerate(p.read_text().splitlines(), 1) if fraction.search(line)]
    assert hits == [], f"a pass has a name, not a fraction: {hits}"



# ---- part D: a request's step count resolved once, at the API; the layout armed through a typed call
#: where "not given" may still mean the template's steps, each with its reason: the API maps a request
#: onto its template (``serving/api/options.resolve_options``) and every layer below carries an ``int``
STEPS_RESOLVED_AT: dict[str, str] = {
    "xema_ray/serving/api/": "the API: where a request meets its template, its step count is resolved once",
    "xema_ray/templates.py": "the schema: a template made without steps takes its model's reference count",
    "xema_ray/plan.py": "the schema: plan entries and execution configs",
    "xema_ray/models/options.py": "the model's option rules check the request's raw fields for the API "
                                  "(not given: nothing to check)",
    "xema_ray/sim/simulate.py": "the simulator's front door: an arrival trace's request without steps, mapped onto "
                                "its plan as the API maps an HTTP request",
}
#: rooms whose state is passed in calls, never parked per thread (the worker used to hand the batch's
#: steps to the layout, and the layout's report back, through a ``threading.local``)
NO_THREAD_LOCAL_ROOMS = ("xema_ray/runtime", "xema_ray/allocator")


def _is_steps(node: ast.AST) -> bool:
    """``steps``, ``x.steps``, ``arm_steps``: a name for a step count."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "steps" or name.endswith("_steps")


def _steps_fallbacks(tree: ast.AST) -> list[tuple[int, str]]:
    """``steps is None`` / ``steps is not None`` tests and ``steps or ...`` fallbacks in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Compare) and _is_steps(node.left) and len(node.ops) == 1
                and isinstance(node.ops[0], ast.Is | ast.IsNot)
                and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None):
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and _is_steps(node.values[0]):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_steps_are_resolved_once_at_the_api() -> None:
    offenders = []
    for path in sorted((ROOT / "xema_ray").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel.startswith(allowed) for allowed in STEPS_RESOLVED_AT):
            continue
        offenders += [f"{rel}:{line}: {text}" for line, text in _steps_fallbacks(ast.parse(path.read_text()))]
    assert offenders == [], ("'not given means the template's steps' decided below the API (resolve it in "
                             "serving/api/options.resolve_options and carry the int):\n" + "\n".join(offenders))


def test_the_steps_check_finds_a_fallback() -> None:
    found = _steps_fallbacks(ast.parse("a = steps or t.steps\nif batch.steps is None: pass\nb = n or 1\n"))
    assert [line for line, _ in found] == [1, 2]


def test_no_thread_local_in_the_runtime_or_the_allocator() -> None:
    hits = [f"{p.relative_to(ROOT)}" for room in NO_THREAD_LOCAL_ROOMS for p in sorted((ROOT / room).rglob("*.py"))
            if "threading.local" in p.read_text() or re.search(r"from threading import .*\blocal\b", p.read_text())]
    assert hits == [], f"per-thread state in {hits}: pass it in the call (e.g. ArmLayout(layout_ref, steps))"


def test_the_layout_is_armed_with_the_steps_and_yields_its_report() -> None:
    import inspect

    from xema_ray.runtime.engine import ArmLayout

    params = list(inspect.signature(ArmLayout.__call__).parameters)
    assert params == ["self", "layout_ref", "steps"]
    assert "RequestReport" in str(inspect.signature(ArmLayout.__call__).return_annotation)


def test_every_layer_below_the_api_carries_the_steps_as_a_required_int() -> None:
    import dataclasses
    import inspect

    from xema_ray.runtime.engine import Batch, ExecutionEngine
    from xema_ray.scheduling.batch import Pending
    from xema_ray.scheduling.batch_key import BatchKey
    from xema_ray.scheduling.dispatcher import Dispatcher
    from xema_ray.serving.api.options import RequestOptions
    from xema_ray.serving.messages import GroupRequest
    from xema_ray.serving.jobs.store import JobRecord

    for model in (RequestOptions, GroupRequest, JobRecord, Batch):
        field = model.model_fields["steps"]
        assert field.is_required() and field.annotation in (int, "int"), f"{model.__name__}.steps: {field}"
    # below the group, the steps travel in the request's batch key (``xema_ray.scheduling.batch_key``)
    steps = next(f for f in dataclasses.fields(BatchKey) if f.name == "steps")
    assert steps.type in (int, "int") and steps.default is dataclasses.MISSING
    pending = next(f for f in dataclasses.fields(Pending) if f.name == "key")
    assert pending.type in (BatchKey, "BatchKey") and pending.default is dataclasses.MISSING
    for fn, name, annotations in ((Dispatcher.submit, "key", (BatchKey, "BatchKey")),
                                  (ExecutionEngine.run_pipeline, "steps", (int, "int"))):
        p = inspect.signature(fn).parameters[name]
        assert p.default is inspect.Parameter.empty and p.annotation in annotations, f"{fn.__qualname__}: {p}"


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


# ---- part E: hub classes hold their collaborators; no class is built from feature mixins
#: the hub classes (``path:Class``), each with what it holds instead of inheriting: at most one base
#: class (``Generic[...]`` aside), and that base a real abstraction of ``HUB_BASES``, never a feature mixed in
HUB_CLASSES: dict[str, str] = {
    "xema_ray/serving/group/model_group.py:ModelGroup": "holds GroupAdapters (adapters), SummaryPublisher "
                                                        "(publisher), the Dispatcher, the WorkerSet, JobLifecycle",
    "xema_ray/runtime/worker.py:Worker": "holds WorkerAdapters (adapters), the ExecutionEngine, the residency manager",
    "xema_ray/serving/api/router.py:Router": "holds AdapterAdmin (adapter_admin), GroupHealth, VideoJobs and typed "
                                            "GroupHandles",
    "xema_ray/models/base.py:ModelSpec": "returns its ReferenceInputs (reference_inputs) instead of inheriting them",
    "xema_ray/scheduling/dispatcher.py:Dispatcher": "holds StepPreemption and SloAdmission over one DispatchState",
}
#: the only bases a hub class may have, each with the abstraction it is
HUB_BASES: dict[str, str] = {
    "WorkerBase": "the worker interface a worker set calls (vLLM's WorkerBase): Worker and EmulatedWorker implement it",
    "ABC": "ModelSpec is the abstract spec each model implements",
}
#: classes of xema_ray/ and planner/ with more than one base, each with its reason: every other class
#: has at most one (a feature is a collaborator held in a field, not a base class mixed in)
MULTIPLE_BASES: dict[str, str] = {
    "xema_ray/allocator/oom.py:ArenaOutOfMemory": "torch's OutOfMemoryError and MemoryError: what callers catch",
    "xema_ray/runtime/out_of_memory.py:DeviceOutOfMemory": "torch's OutOfMemoryError and MemoryError: what callers catch",
    "xema_ray/placement.py:WeightHome": "a str Enum (its values are JSON strings)",
    "xema_ray/serving/group/worker_set.py:WorkerSet": "an ABC generic over its kind of worker handle",
    "planner/model.py:RefiningModel": "a Protocol extending the PlannerModel protocol",
}
#: bases that only make a class generic, abstract or a protocol (no state, no feature)
TYPING_BASES = ("Generic", "Protocol")


def _bases_of(source: str) -> dict[str, list[str]]:
    """Each class of ``source`` -> its base classes by name (``Other[P]`` as ``Other``, ``abc.ABC`` as ``ABC``)."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b.value if isinstance(b, ast.Subscript) else b) for b in node.bases]
            out[node.name] = [b.rpartition(".")[2] for b in bases]
    return out


def _classes(paths: list[Path]) -> dict[str, list[str]]:
    """``path:Class`` -> its base classes, for every class of ``paths``."""
    return {f"{path.relative_to(ROOT).as_posix()}:{name}": bases
            for path in paths for name, bases in _bases_of(path.read_text()).items()}


def _library_classes() -> dict[str, list[str]]:
    return _classes(sorted(p for top in ("xema_ray", "planner") for p in (ROOT / top).rglob("*.py")))


def test_hub_classes_have_at_most_one_base_and_it_is_an_abstraction() -> None:
    classes = _library_classes()
    missing = sorted(set(HUB_CLASSES) - set(classes))
    assert missing == [], f"HUB_CLASSES names classes that are gone: {missing}"
    assert all(HUB_CLASSES.values()) and all(HUB_BASES.values()), "every hub and every allowed base says why"
    real = {hub: [b for b in bases if b not in TYPING_BASES] for hub, bases in classes.items() if hub in HUB_CLASSES}
    bad = {hub: bases for hub, bases in sorted(real.items()) if len(bases) > 1 or any(b not in HUB_BASES for b in bases)}
    assert bad == {}, ("hub classes built from features (hold a collaborator in a typed field instead, or name "
                       f"the abstraction in HUB_BASES): {bad}")


def test_no_library_class_is_built_from_feature_mixins() -> None:
    classes = _library_classes()
    assert all(MULTIPLE_BASES.values()), "every class allowed several bases says why"
    stale = sorted(set(MULTIPLE_BASES) - set(classes))
    assert stale == [], f"MULTIPLE_BASES names classes that are gone: {stale}"
    mixed = {c: bases for c, bases in sorted(classes.items())
             if len([b for b in bases if b not in TYPING_BASES]) > 1 and c not in MULTIPLE_BASES}
    assert mixed == {}, f"classes with several bases (hold each feature as a collaborator): {mixed}"


def test_the_base_finder_reads_generic_and_dotted_bases() -> None:
    src = "class A(Feature, Other[P]):\n    pass\nclass B(abc.ABC, Generic[T]):\n    pass\nclass C:\n    pass\n"
    assert _bases_of(src) == {"A": ["Feature", "Other"], "B": ["ABC", "Generic"], "C": []}
