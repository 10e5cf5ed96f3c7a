"""The planning driver: its tasks return typed results (``TemplateResult``, pickled by Ray as they
are), the table's provenance and the ``--stats`` file are built from them."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.templates import RequestTemplate

from planner.cli import main as planner
from planner.driver import PlanOptions, TemplateResult, plan_one

TEMPLATE = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
OPTS = PlanOptions(hardware="a6000", budget=96 * 10**6, gpus=2, measure="never", text_encoder="plan")


def test_a_task_returns_a_typed_result_that_pickles_as_it_is() -> None:
    result = plan_one(TEMPLATE, OPTS)
    assert isinstance(result, TemplateResult) and isinstance(result.entry, PlanEntry)
    assert result.template == TEMPLATE.shape_key and result.device == "none" and result.finished
    assert result.encoder_facts is not None and result.encoder_facts.model == "tiny-flux2"
    assert result.measured == 0 and result.estimated == result.profiled > 0
    assert result.candidates == ()  # no load expected for its group
    assert pickle.loads(pickle.dumps(result)) == result  # what a Ray task sends back


def test_a_loaded_group_sends_its_other_candidates() -> None:
    result = plan_one(TEMPLATE, OPTS.model_copy(update={"loaded_models": ("tiny-flux2",)}))
    assert result.candidates and all(c.config != result.entry.config for c in result.candidates)  # type: ignore[union-attr]


def test_a_baseline_run_writes_typed_provenance_and_stats(tmp_path: Path) -> None:
    out, stats = tmp_path / "t.json", tmp_path / "stats.json"
    assert planner(["plan", "--templates", "tiny-flux2:64x64,tiny-flux2:128x128", "--steps", "2", "--gpus", "2",
                    "--budget", "96MB", "--hardware", "a6000", "--measure", "never", "--no-ray", "--no-layouts",
                    "--planner", "heuristic", "--out", str(out), "--stats", str(stats)]) == 0
    table = PlanTable.load(str(out))
    rows = json.loads(stats.read_text())["results"]
    results = [TemplateResult.model_validate(r) for r in rows]  # the stats file holds the results as they are
    assert [r.template for r in results] == list(table.entries)
    # the table's entries are the tasks' with the text encoder placed when their group was finished
    assert all(table.entries[r.template].config.model_copy(update={"text_encoder": None}) == r.entry.config  # type: ignore[union-attr]
               for r in results)
    p = table.provenance
    assert table.planner == "heuristic" and table.residency == {}  # a baseline: no residency choice
    assert p.profiled == sum(r.profiled for r in results) and p.infeasible == ()
    assert set(p.text_encoders) == set(table.entries) and p.wall_s is not None and p.total_s is not None
    assert p.layouts_gpu is None and p.layouts_dynamic_bytes == {}  # --no-layouts
