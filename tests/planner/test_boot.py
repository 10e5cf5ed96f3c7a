"""``python -m planner``'s start-up: Ray starts while the planner imports, only for commands
that plan with Ray tasks (the `ray job submit` path is run end to end by test_ray_job)."""

from __future__ import annotations

import sys

import pytest

from planner import boot


@pytest.mark.parametrize(("argv", "expected"), [
    (["plan", "--templates", "paper"], True),
    (["plan", "--templates", "paper", "--no-ray"], False),
    (["plan", "--help"], False),
    (["plan", "-h"], False),
    ([], False),
    (["--help"], False),
])
def test_only_planning_with_ray_starts_ray_early(argv: list[str], expected: bool) -> None:
    assert boot.uses_ray(argv) is expected


def test_start_without_ray_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[str] = []
    monkeypatch.setattr(boot, "init_ray", lambda: called.append("ray"))
    boot.start(["plan", "--no-ray"], module="json")
    assert called == []


def test_start_imports_while_ray_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # the module is imported on a thread while init_ray runs; a module that fails to import is
    # left for the caller's own import to report
    monkeypatch.setattr(boot, "init_ray", lambda: None)
    monkeypatch.setattr(boot, "check_room", lambda argv: None)
    sys.modules.pop("tests.planner.synthetic", None)
    boot.start(["plan"], module="tests.planner.synthetic")
    assert "tests.planner.synthetic" in sys.modules
    boot.start(["plan"], module="tests.planner.no_such_module")  # no exception here
    with pytest.raises(ModuleNotFoundError):
        __import__("tests.planner.no_such_module")


def test_a_cluster_without_room_stops_the_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # boot raises; ``python -m planner`` says it and exits 3 (planner/__main__.py)
    from planner import cluster_fit

    asked: list[tuple[str, str, float]] = []

    def no_room(hardware: str, measure: str, wait_s: float) -> None:
        asked.append((hardware, measure, wait_s))
        raise cluster_fit.NoRoom("planning tasks need at least 0.1 CPU each; ... Held by: placement group X (2 CPU)")

    monkeypatch.setattr(cluster_fit, "fit_tasks", no_room)
    monkeypatch.setattr(boot, "init_ray", lambda: None)
    with pytest.raises(cluster_fit.NoRoom, match="Held by: placement group X"):
        boot.start(["plan", "--hardware", "cpu", "--wait-for-resources", "2", "--templates", "tiny"], module="json")
    assert asked == [("cpu", "auto", 2.0)]
