"""The planner as an ordered list of named passes (``planner.pipeline``): ``plan()`` prints nothing
and returns a typed ``PlanResult``; a refused request is a typed ``PlanError`` carrying its exit
code; a pass changes only what it declares; the table records its command relative to the checkout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from xema_ray.plan import PlanTable
from xema_ray.templates import RequestTemplate

from planner.cli import ROOT, recorded_command
from planner.driver import PlanOptions
from planner.pipeline import (PASSES, Pass, PlanRefused, PlanRequest, PlanResult, PlanRun, PlanState, Written, plan,
                              run_passes)

TEMPLATES = (RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2),
             RequestTemplate(model="tiny-flux2", width=128, height=64, steps=2))
OPTS = PlanOptions(hardware="a6000", budget=96 * 10**6, gpus=1, measure="never", text_encoder="plan")


def test_plan_prints_nothing_and_returns_a_plan_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, stats = tmp_path / "t.json", tmp_path / "stats.json"
    events: list[object] = []
    result = plan(PlanRequest(TEMPLATES, OPTS, out=str(out), stats=str(stats), layouts=False, use_ray=False,
                              command="python -m planner plan --templates tiny"), on_event=events.append)
    assert capsys.readouterr().out == ""
    assert isinstance(result, PlanResult) and events == []
    assert list(result.table.entries) == [t.shape_key for t in TEMPLATES]
    assert [r.template for r in result.results] == [t.shape_key for t in TEMPLATES]
    assert result.written == Written(table=out, experts=None, stats=stats)
    assert PlanTable.load(str(out)).entries == result.table.entries
    assert json.loads(stats.read_text())["wall_s"] == result.planned_s
    assert result.table.provenance.command == "python -m planner plan --templates tiny"
    assert result.table.residency and set(result.encoders) == set(result.table.entries)
    assert result.layouts is None and result.switches == () and result.total_s >= result.planned_s
    # each model's replica start predicted from the measured figures (a group scaled to zero wakes in it)
    models = {t.model for t in TEMPLATES}
    assert set(result.table.replica_start) == models
    assert all(0 < s.warm_s <= s.cold_s and s.weight_bytes > 0 and "bench_warm_start" in s.basis
               for s in result.table.replica_start.values())
    assert PlanTable.load(str(out)).replica_start == result.table.replica_start


def test_error_raised_if_the_load_names_a_template_not_planned(tmp_path: Path) -> None:
    from planner.load_aware import GroupLoad

    loads = {"tiny-flux2": GroupLoad(rate_per_min=10, mix={"tiny-flux2/999x999x1": 1.0})}
    opts = OPTS.model_copy(update={"loaded_models": ("tiny-flux2",)})
    with pytest.raises(PlanRefused) as e:
        plan(PlanRequest(TEMPLATES[:1], opts, loads=loads, out=str(tmp_path / "t.json"), layouts=False, use_ray=False))
    assert e.value.exit_code == 2 and not (tmp_path / "t.json").exists()


def test_error_raised_if_a_pass_changes_what_it_does_not_write() -> None:
    def sneaky(_run: PlanRun, state: PlanState) -> PlanState:
        return dataclasses.replace(state, planned_s=1.0, total_s=2.0)

    with pytest.raises(RuntimeError, match=r"pass sneaky changed \['total_s'\]"):
        run_passes(None, (Pass("sneaky", sneaky, reads=(), writes=("planned_s",)),))  # type: ignore[arg-type]


def test_the_passes_keep_todays_order() -> None:
    # the host memory is counted after the expert switch (a two-expert model pins both experts);
    # the tiers are priced from the finished entries (their layouts' peaks)
    assert [p.name for p in PASSES] == ["templates", "load_aware", "groups", "expert_switch", "host_memory", "table",
                                        "layouts", "tiers", "write"]


@pytest.mark.parametrize(("argv", "recorded"), [
    ([str(ROOT / "planner" / "__main__.py"), "plan", "--templates", "paper", "--out", "plans/a.json"],
     "python -m planner plan --templates paper --out plans/a.json"),
    (["/opt/venv/bin/xema", "plan", "--deployment", str(ROOT / "deployments" / "x.yaml")],
     "xema plan --deployment deployments/x.yaml"),
    (["/opt/venv/bin/xema", "plan", f"--out={ROOT / 'plans' / 't.json'}", "--stats", "/tmp/s.json"],
     "xema plan --out=plans/t.json --stats /tmp/s.json"),
])
def test_the_command_is_recorded_relative_to_the_checkout(argv: list[str], recorded: str) -> None:
    assert recorded_command(argv) == recorded


@pytest.mark.slow
def test_a_two_expert_template_is_planned_as_its_switch_with_its_layout_and_host_memory(tmp_path: Path) -> None:
    """Under the hold-both peak tiny-wan2.2's entry is the expert swap: its static layout is solved
    for that entry (not the search's), the node's host memory counts both pinned experts (what
    the worker pins, ``config_host_bytes``), and a host budget below it refuses naming the bytes."""
    from planner.expert_switch import plan_expert_switch
    from xema_ray.analyzer.run import trace_template
    from xema_ray.profiling.hardware import get_hardware
    from xema_ray.runtime.host_bytes import config_host_bytes

    t = RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=9, steps=6)
    budget = plan_expert_switch(t, trace_template(t), 64 * 2**20, get_hardware("a6000x8")).cost("hold_both").peak_bytes - 1
    opts = PlanOptions(hardware="a6000", budget=budget, gpus=1, measure="never", text_encoder="plan")
    result = plan(PlanRequest((t,), opts, out=str(tmp_path / "t.json"), use_ray=False))
    e = result.table.entries[t.shape_key]
    assert e.config.experts is not None and e.config.experts.strategy == "swap_prefetched"
    assert result.switched == (t.shape_key,) and result.written.experts is not None
    assert e.config.layout_ref is not None and t.shape_key not in result.table.provenance.layouts_not_armed
    host = result.table.host
    assert host is not None and host.pinned_bytes == config_host_bytes(e.config).pinned_bytes > 0
    with pytest.raises(PlanRefused, match=r"host memory within --host-budget .* pinned") as refused:
        plan(PlanRequest((t,), opts.model_copy(update={"host_budget": host.pinned_bytes // 2}), layouts=False,
                         use_ray=False))
    assert refused.value.exit_code == 2
