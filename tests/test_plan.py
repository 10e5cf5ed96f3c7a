"""Plan-table validation: a table that cannot be served is refused when it is read, naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from xema_ray.plan import PLAN_TABLE_SCHEMA_VERSION, ExecutionConfig, PlanEntry, PlanPrediction, PlanTable
from xema_ray.templates import RequestTemplate

A = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
B = RequestTemplate(model="tiny-flux2", width=128, height=128, steps=2)


def _entry(t: RequestTemplate, ulysses: int = 1, dp: int = 1, **prediction: float) -> PlanEntry:
    p = {"peak_bytes": 10**7, "latency_s": 0.5, "goodput_rps": 1.0, "slo_s": 30.0, **prediction}
    return PlanEntry(config=ExecutionConfig(template=t, ulysses=ulysses, dp=dp),
                     prediction=PlanPrediction(latency_source="measured", **p))  # type: ignore[arg-type]


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
