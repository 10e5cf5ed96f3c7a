"""Functions stay short: a long one is split along its seams, never squeezed (the reasoned exceptions are data here)."""

from __future__ import annotations

import ast

from tests.source_scan import ROOT

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
