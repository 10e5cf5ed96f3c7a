"""``bench/compare_plans.py``: the check that planner speed-ups leave plans unchanged flags every
kind of difference (configuration, mitigations, prediction, runner-up) and passes identical tables."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from xema_ray.plan import PlanTable

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "bench/results/planner-reference-main.json"


def _compare_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("compare_plans", ROOT / "bench/compare_plans.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_identical_tables_match_and_changes_are_named(tmp_path: Path) -> None:
    cmp = _compare_module()
    ref = PlanTable.load(str(REFERENCE))
    assert len(ref.entries) == 24
    assert cmp.compare(ref, ref) == []
    key = next(k for k, e in ref.entries.items() if e.prediction.goodput_rps > 0
               and any(m.kind in ("hsdp", "block_offload") and len(m.blocks or ()) > 1 for m in e.config.mitigations))
    e = ref.entries[key]
    m = next(m for m in e.config.mitigations if m.kind in ("hsdp", "block_offload"))
    fewer = m.model_copy(update={"blocks": m.blocks[:-1], "intensity": m.intensity - 1})
    changed = e.model_copy(update={
        "config": e.config.model_copy(update={"mitigations": tuple(fewer if x is m else x
                                                                   for x in e.config.mitigations)}),
        "prediction": e.prediction.model_copy(update={"goodput_rps": e.prediction.goodput_rps * (1 + 1e-9)}),
    })
    new = ref.model_copy(update={"entries": {**ref.entries, key: changed}})
    diffs = cmp.compare(ref, new)
    assert any(d.startswith(f"{key}: configuration") for d in diffs)
    assert any(d.startswith(f"{key}: goodput_rps") for d in diffs)
    assert cmp.compare(ref, new, rel=1e-6) == [f"{key}: configuration {e.config.describe()} (text encoder "
                                               f"{e.config.text_encoder}) -> {changed.config.describe()} "
                                               f"(text encoder {changed.config.text_encoder})"]
    path = tmp_path / "new.json"
    new.save(str(path))
    assert cmp.main([str(REFERENCE), str(path)]) == 1
    assert cmp.main([str(REFERENCE), str(REFERENCE)]) == 0
