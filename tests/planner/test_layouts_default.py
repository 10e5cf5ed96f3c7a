"""`xema plan` solves every entry's static layout unless told not to, and `xema layouts` rebuilds
exactly the files a table names (the solve is deterministic): the reference table can be committed
without its ~5 MB-per-entry layout folder."""

from __future__ import annotations

from pathlib import Path

from xema_ray.cli import main as xema
from xema_ray.plan import PlanTable
from xema_ray.allocator.artifact import layouts_dir, load_artifact

from planner.cli import main as planner

PLAN = ["plan", "--templates", "tiny-flux2:64x64", "--steps", "2", "--gpus", "1", "--budget", "96MB",
        "--hardware", "a6000", "--measure", "never", "--no-ray", "--text-encoder", "none"]


def test_layouts_by_default_and_rebuilt_identically(tmp_path: Path, capsys) -> None:
    out = tmp_path / "t.json"
    assert planner([*PLAN, "--out", str(out)]) == 0
    table = PlanTable.load(str(out))
    entry = table.entries["tiny-flux2/64x64x1"]
    ref = entry.config.layout_ref
    assert ref is not None and table.provenance.layouts_gpu == "NVIDIA RTX A6000"
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


def test_each_group_is_finished_as_soon_as_its_last_template_is_planned(monkeypatch) -> None:
    """``xema plan`` places a group's residency and text encoders, and starts its layouts, when the
    group's last template is planned, while the others still plan (``plan_all``'s ``on_group``)."""
    from types import SimpleNamespace

    import planner.driver as driver
    from xema_ray.templates import RequestTemplate

    templates = [RequestTemplate(model=m, width=w, height=64) for m, w in
                 (("tiny-flux2", 64), ("tiny-ltx2", 64), ("tiny-flux2", 128), ("tiny-ltx2", 128))]
    planned: list[str] = []
    monkeypatch.setattr(driver, "plan_one", lambda t, _opts: planned.append(t.shape_key)
                        or SimpleNamespace(template=planned[-1]))
    calls: list[tuple[str, list[str], int]] = []
    opts = driver.PlanOptions(hardware="a6000", budget=10**8, gpus=1)
    results = driver.plan_all(templates, opts, use_ray=False,
                              on_group=lambda model, group: calls.append((model, [r.template for r in group], len(planned))))
    assert [r.template for r in results] == [t.shape_key for t in templates]
    assert calls == [("tiny-flux2", ["tiny-flux2/64x64x1", "tiny-flux2/128x64x1"], 3),
                     ("tiny-ltx2", ["tiny-ltx2/64x64x1", "tiny-ltx2/128x64x1"], 4)]
