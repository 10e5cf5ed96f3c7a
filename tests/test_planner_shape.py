"""The planner is an ordered list of named passes; only its command line prints or exits."""

from __future__ import annotations

import ast
import re

from tests.source_scan import ROOT


#: the planner's modules that may print or choose the process's exit status, each with its reason
PLANNER_SPEAKERS: dict[str, str] = {
    "planner/cli.py": "the command line: says the PlanResult and PlanError's exit code",
    "planner/__main__.py": "``python -m planner``: the process's entry and its exit status",
}
#: the run's passes in order (``planner.pipeline.PASSES``): a new pass is added here with its place
PLANNER_PASSES = ("templates", "load_aware", "groups", "expert_switch", "host_memory", "table", "layouts", "tiers",
                  "write")
GROUP_PASSES = ("residency", "text_encoder", "expert_switch", "decode_stage")


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
