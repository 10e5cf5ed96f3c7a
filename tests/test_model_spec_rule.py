"""A model is known in its spec only (docs/architecture.md, "Where a model is known")."""

from __future__ import annotations

import ast

from tests.source_scan import ROOT

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
