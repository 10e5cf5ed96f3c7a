"""Layering (issue #16): no library module of ``xema_ray`` imports ``planner``; only the CLI entry
point composes them (``xema plan``), and serving's start-up planning is composed in
``deployments/``. The planner's analytic estimates live in ``planner.estimates``, not in the
mitigation library."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {ROOT / "xema_ray" / "cli.py"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_no_library_module_of_xema_ray_imports_planner() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "xema_ray").rglob("*.py"))
                 if p not in ENTRY_POINTS and "planner" in _imports(p)]
    assert offenders == [], f"these xema_ray modules import planner: {offenders}"


def test_estimates_left_the_mitigation_library() -> None:
    import xema_ray.mitigation as mitigation

    for name in ("estimate_saving", "evenly_spread", "MemorySaving"):
        assert not hasattr(mitigation, name), name
    from planner.estimates import estimate_block_offload, estimate_saving, evenly_spread  # noqa: F401


def test_cuda_is_touched_only_by_the_platforms_and_the_allocator_binding() -> None:
    import re

    allowed = (ROOT / "xema_ray" / "platforms", ROOT / "xema_ray" / "allocator")
    pattern = re.compile(r"torch\.(cuda|backends\.(cuda|cudnn))\b")
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "xema_ray").rglob("*.py"))
                 if not any(a in p.parents for a in allowed) and pattern.search(p.read_text())]
    assert offenders == [], f"these modules reach CUDA outside xema_ray/platforms/ and xema_ray/allocator/: {offenders}"
