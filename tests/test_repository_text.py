"""The repository as a user meets it: a broken install fails instead of skipping, the project speaks of itself alone, and fault tests wait on facts."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.source_scan import ROOT


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
WORKPLACE_EXEMPT = ("tests/test_repository_text.py",)


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
