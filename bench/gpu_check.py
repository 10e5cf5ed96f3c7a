"""The GPU check under the name issue #37 gives it: ``python3 bench/gpu_check.py [--list|--dry-run|--part N ...]``
runs gpu_check/run.py with the same arguments (docs/gpu-check.md). Standard library only, like it."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    check = Path(__file__).resolve().parents[1] / "gpu_check" / "run.py"
    sys.argv[0] = str(check)
    runpy.run_path(str(check), run_name="__main__")
