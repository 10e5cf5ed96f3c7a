"""`xema plan` solves every entry's static layout unless told not to, and `xema layouts` rebuilds
exactly the files a table names (the solve is deterministic): the reference table can be committed
without its ~5 MB-per-entry layout folder."""

from __future__ import annotations

from pathlib import Path

from xema_ray.cli import main as xema
from xema_ray.plan import PlanTable
from xema_ray.runtime.layouts import layouts_dir, load_artifact

from planner.cli import main as planner

PLAN = ["plan", "--templates", "tiny-flux2:64x64", "--steps", "2", "--gpus", "1", "--budget", "96MB",
        "--hardware", "a6000", "--measure", "never", "--no-ray", "--text-encoder", "none"]


def test_layouts_by_default_and_rebuilt_identically(tmp_path: Path, capsys) -> None:
    out = tmp_path / "t.json"
    assert planner([*PLAN, "--out", str(out)]) == 0
    table = PlanTable.load(str(out))
    entry = table.entries["tiny-flux2/64x64x1"]
    ref = entry.config.layout_ref
    assert ref is not None and table.provenance["layouts_gpu"] == "NVIDIA RTX A6000"
    folder = layouts_dir(out)
    art = load_artifact(folder, ref, gpu="NVIDIA RTX A6000")
    # the predicted peak is what the static allocator holds, from the solver's figure
    assert entry.prediction.peak_bytes >= art.loaded_bytes + art.reserved_bytes
    original = art.model_dump(exclude={"layout": {"solve_seconds"}})

    (folder / f"{ref}.json").unlink()
    assert xema(["verify", "--plan-table", str(out)]) == 2  # a missing layout is refused, naming the command
    assert "xema layouts --plan-table" in capsys.readouterr().err
    assert xema(["layouts", "--plan-table", str(out)]) == 0
    again = load_artifact(folder, ref, gpu="NVIDIA RTX A6000")  # its content hashes to the id the table names
    assert again.model_dump(exclude={"layout": {"solve_seconds"}}) == original  # all but the solve's own time
    assert xema(["layouts", "--plan-table", str(out)]) == 0
    assert "present" in capsys.readouterr().out


def test_no_layouts(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert planner([*PLAN, "--no-layouts", "--out", str(out)]) == 0
    assert PlanTable.load(str(out)).entries["tiny-flux2/64x64x1"].config.layout_ref is None
    assert not layouts_dir(out).exists()
