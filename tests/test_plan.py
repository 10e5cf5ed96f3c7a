"""Plan-table validation: a table that cannot be served is refused when it is read, naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from bench.scenarios.factories import plan_entry
from xema_ray.plan import PLAN_TABLE_SCHEMA_VERSION, PlanEntry, PlanProvenance, PlanTable, TextEncoderChoice
from xema_ray.templates import RequestTemplate

ROOT = Path(__file__).resolve().parents[1]
A = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
B = RequestTemplate(model="tiny-flux2", width=128, height=128, steps=2)


def _entry(t: RequestTemplate, ulysses: int = 1, dp: int = 1, **prediction: float) -> PlanEntry:
    return plan_entry(t, ulysses=ulysses, dp=dp, **prediction)  # type: ignore[arg-type]


def _table(**overrides: object) -> dict:
    table = PlanTable(hardware="cpu:2", gpus=2, budget_bytes=10**9, entries={A.shape_key: _entry(A)})
    return {**json.loads(table.model_dump_json()), **overrides}


def _write(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_valid_table_round_trips(tmp_path: Path) -> None:
    table = PlanTable.load(_write(tmp_path, _table()))
    assert table.schema_version == PLAN_TABLE_SCHEMA_VERSION and list(table.entries) == [A.shape_key]


@pytest.mark.parametrize("version", [None, "1", 1.0, True])
def test_error_raised_if_schema_version_is_missing_or_not_an_integer(tmp_path: Path, version: object) -> None:
    data = _table()
    if version is None:
        del data["schema_version"]
    else:
        data["schema_version"] = version
    with pytest.raises(ValueError, match="schema_version"):
        PlanTable.load(_write(tmp_path, data))


def test_error_raised_if_schema_version_is_unknown(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="schema 2 is not supported"):
        PlanTable.load(_write(tmp_path, _table(schema_version=2)))


def test_error_raised_if_a_key_holds_another_templates_plan(tmp_path: Path) -> None:
    data = _table()
    data["entries"] = {B.shape_key: data["entries"][A.shape_key]}
    with pytest.raises(ValidationError, match=r"tiny-flux2/128x128x1.*holds the plan of 'tiny-flux2/64x64x1'"):
        PlanTable.load(_write(tmp_path, data))


@pytest.mark.parametrize(("field", "value"), [
    ("latency_s", float("nan")), ("latency_s", -1.0), ("latency_s", float("inf")),
    ("peak_bytes", -5), ("slo_s", 0.0), ("slo_s", float("nan")), ("goodput_rps", -0.1),
])
def test_error_raised_if_a_prediction_is_not_finite_and_non_negative(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=field):
        _entry(A, **{field: value})


def test_error_raised_if_nan_comes_from_a_file(tmp_path: Path) -> None:
    # json.dumps writes NaN and json.loads reads it: the file form must be refused too
    data = _table()
    data["entries"][A.shape_key]["prediction"]["latency_s"] = float("nan")
    with pytest.raises(ValidationError, match="latency_s"):
        PlanTable.load(_write(tmp_path, data))


def test_error_raised_if_a_partial_batch_latency_is_bad() -> None:
    with pytest.raises(ValidationError, match="latency_by_batch"):
        _entry(A, latency_by_batch={1: float("nan")})  # type: ignore[arg-type]


def test_error_raised_if_a_plan_needs_more_gpus_than_the_table(tmp_path: Path) -> None:
    data = _table(gpus=1)
    data["entries"] = {A.shape_key: json.loads(_entry(A, ulysses=2).model_dump_json())}
    with pytest.raises(ValidationError, match=r"needs 2 GPUs \(SP 2 x DP 1\) but the table is for 1"):
        PlanTable.load(_write(tmp_path, data))


#: a provenance as tables written before it was typed hold it: every value a string
LEGACY_PROVENANCE = {
    "command": "xema plan --templates tiny", "planned_at": "2026-12-02T03:04:49Z", "wall_s": "68.5", "total_s": "100.9",
    "tasks_cpu_s": "87.8", "profiled": "1859", "measured": "0", "estimated": "1859", "infeasible": "",
    "text_encoders": "tiny-flux2/64x64x1: streamed (+1.89 s per batch); tiny-flux2/128x128x1: cpu (+0.05 s per batch)",
    "layouts_gpu": "NVIDIA RTX A6000", "layouts_dynamic_bytes": '{"tiny-flux2": 253691904}',
    "layouts_not_armed": "tiny-flux2/128x128x1: weights 1.00 GB exceed the 0.10 GB budget",
    "emulated_time_scale": '{"tiny-flux2": 4.0}', "build": "abc123",
}


def test_an_earlier_tables_string_provenance_is_read_into_typed_fields(tmp_path: Path) -> None:
    p = PlanTable.load(_write(tmp_path, _table(provenance=LEGACY_PROVENANCE))).provenance
    assert (p.wall_s, p.total_s, p.tasks_cpu_s, p.profiled, p.measured, p.estimated) == (68.5, 100.9, 87.8, 1859, 0, 1859)
    assert p.infeasible == () and p.layouts_gpu == "NVIDIA RTX A6000"
    assert p.text_encoders == {"tiny-flux2/64x64x1": TextEncoderChoice(placement="streamed", seconds_per_batch=1.89),
                               "tiny-flux2/128x128x1": TextEncoderChoice(placement="cpu", seconds_per_batch=0.05)}
    assert p.text_encoders["tiny-flux2/64x64x1"].describe() == "streamed (+1.89 s per batch)"
    assert p.layouts_dynamic_bytes == {"tiny-flux2": 253691904} and p.emulated_time_scale == {"tiny-flux2": 4.0}
    assert p.layouts_not_armed == {"tiny-flux2/128x128x1": "weights 1.00 GB exceed the 0.10 GB budget"}
    assert p.notes == {"build": "abc123"}  # a key this build has no field for is kept


def test_provenance_is_written_typed_and_read_back_the_same(tmp_path: Path) -> None:
    table = PlanTable.load(_write(tmp_path, _table(provenance=LEGACY_PROVENANCE)))
    table.save(str(tmp_path / "again.json"))
    raw = json.loads((tmp_path / "again.json").read_text())["provenance"]
    assert raw["wall_s"] == 68.5 and raw["layouts_dynamic_bytes"] == {"tiny-flux2": 253691904}  # no JSON in a string
    assert PlanTable.load(str(tmp_path / "again.json")).provenance == table.provenance


def test_error_raised_if_a_typed_provenance_has_an_unknown_field() -> None:
    with pytest.raises(ValidationError, match="no_such_field"):
        PlanProvenance.model_validate({"no_such_field": 3})


def test_every_committed_plan_table_loads() -> None:
    """plans/, the benchmarks' tables and the load tests' keep their string provenance (read as above)."""
    paths = [*ROOT.glob("plans/*.json"), *(p for p in ROOT.glob("bench/results/plans/*.json") if p.name != "slos.json"),
             ROOT / "bench/results/planner-reference-main.json", ROOT / "loadtests/results/plans.json"]
    assert len(paths) >= 30
    for path in paths:
        PlanTable.load(str(path))
    p = PlanTable.load(str(ROOT / "plans/a6000x8.json")).provenance
    assert set(p.layouts_dynamic_bytes) == {"cogvideox-5b", "flux2", "ltx2"} and len(p.text_encoders) == 24
    assert p.layouts_gpu == "NVIDIA RTX A6000" and p.notes == {}
