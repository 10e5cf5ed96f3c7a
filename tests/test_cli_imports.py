"""The command line answers at once: ``xema --help`` and every subcommand's help import neither
torch, diffusers, transformers nor Ray (seconds each on a small machine); those load only when a
command runs (the planner's Ray start-up imports them while the cluster starts)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "diffusers", "transformers", "ray")
SUBCOMMANDS = ("analyze", "plan", "verify", "layouts", "serve")

# a fresh interpreter: this test process has imported everything already
PROBE = """
import json, sys
from xema_ray.cli import main
for argv in {argvs!r}:
    try:
        main(argv)
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _heavy_after(argvs: list[list[str]]) -> list[str]:
    code = PROBE.format(argvs=argvs, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_help_imports_no_heavy_module() -> None:
    assert _heavy_after([["--help"], *([c, "--help"] for c in SUBCOMMANDS)]) == []


def test_planner_module_help_imports_no_heavy_module() -> None:
    code = ("import json, sys\nfrom planner.cli import main\ntry:\n    main(['plan', '--help'])\nexcept SystemExit:\n"
            f"    pass\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_bad_argument_is_answered_without_heavy_imports() -> None:
    # argparse refuses an unknown model before any model code loads
    assert _heavy_after([["analyze", "--model", "no-such-model", "--height", "64", "--width", "64"]]) == []


def test_static_names_match_the_registries() -> None:
    """The CLI's choices are static tuples (so help stays cheap); they are the registries' names."""
    from planner.baselines import BASELINES
    from planner.cli import PLANNERS
    from xema_ray.models import MODEL_NAMES, get_model_spec

    assert PLANNERS == ("xema", *BASELINES)
    assert all(get_model_spec(m).name == m for m in MODEL_NAMES)
