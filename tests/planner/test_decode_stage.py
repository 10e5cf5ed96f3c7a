"""A decode stage of its own (``planner.decode_stage``, ``ExecutionConfig.decode``): the config's
``decode`` block is validated and hashed only when set; the ``decode_stage`` group pass keeps the
decode in place for ``--stages joint``, puts it on a pool for ``split`` wherever one fits and
chooses per template for ``auto``; ``xema verify`` counts the DiT workers' and the decode workers'
peaks apart."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from xema_ray.plan import DecodeStage, ExecutionConfig, PlanEntry, PlanPrediction, PlanTable
from xema_ray.templates import RequestTemplate

from planner.decode_stage import DecodeFacts, DitStage, choose_decode, dit_stage_configs, pool_options
from planner.driver import PlanOptions
from planner.latency import LatencyModel
from planner.pipeline import PlanRequest, plan

COG = RequestTemplate(model="cogvideox-5b", width=1280, height=720, frames=49)
GB = 10**9


@pytest.mark.parametrize(("block", "field", "rule"), [
    ({"workers": 0, "gpus_per_worker": 1}, "workers", "greater than or equal to 1"),
    ({"workers": 1, "gpus_per_worker": 0.3}, "gpus_per_worker", "does not divide a GPU"),
    ({"workers": 1, "gpus_per_worker": 1.5}, "gpus_per_worker", "whole number"),
    ({"workers": 1, "gpus_per_worker": 0}, "gpus_per_worker", "greater than 0"),
])
def test_error_raised_if_a_decode_block_is_bad_naming_the_field(block: dict[str, float], field: str, rule: str) -> None:
    with pytest.raises(ValidationError) as e:
        DecodeStage.model_validate(block)
    assert e.value.errors()[0]["loc"] == (field,) and rule in str(e.value)


def test_decode_pool_gpus_pack_fractions_and_count_in_the_table() -> None:
    assert DecodeStage(workers=3, gpus_per_worker=0.5).gpus == 2
    assert DecodeStage(workers=2, gpus_per_worker=2).gpus == 4
    cfg = ExecutionConfig(template=COG, ulysses=2, dp=3, decode=DecodeStage(workers=2, gpus_per_worker=1))
    assert (cfg.gpus, cfg.total_gpus) == (6, 8) and cfg.describe().endswith("decode pool 2x1 GPU")
    pred = PlanPrediction(peak_bytes=1, latency_s=1.0, goodput_rps=1.0, slo_s=2.0, latency_source="estimated")
    PlanTable(hardware="x", gpus=8, budget_bytes=1, entries={COG.shape_key: PlanEntry(config=cfg, prediction=pred)})
    with pytest.raises(ValidationError, match="a decode pool of 2"):
        PlanTable(hardware="x", gpus=7, budget_bytes=1, entries={COG.shape_key: PlanEntry(config=cfg, prediction=pred)})


def test_a_config_without_a_decode_stage_hashes_as_before_and_one_with_it_differs() -> None:
    plain = ExecutionConfig(template=COG, dp=2)
    assert plain.config_hash() == "e46012b63d5f0746"  # the hash every stored profile and layout was keyed by
    pooled = plain.model_copy(update={"decode": DecodeStage(workers=1, gpus_per_worker=1)})
    assert pooled.config_hash() != plain.config_hash()


def test_error_raised_if_an_image_model_is_given_a_decode_stage() -> None:
    t = RequestTemplate(model="flux2", width=1024, height=1024)
    with pytest.raises(ValidationError, match="no decoder a decode stage could hold"):
        ExecutionConfig(template=t, decode=DecodeStage(workers=1, gpus_per_worker=1))


def _entry(cfg: ExecutionConfig, latency: LatencyModel, slo: float) -> PlanEntry:
    s = latency.seconds(cfg)
    return PlanEntry(config=cfg, prediction=PlanPrediction(
        peak_bytes=40 * GB, latency_s=s, goodput_rps=cfg.dp * cfg.batch / s if s <= slo else 0.0, slo_s=slo,
        latency_source="estimated"))


def _facts(cfg: ExecutionConfig, dit: int = 14 * GB, decode: int = 30 * GB) -> DecodeFacts:
    peaks = {1: dit + 10 * GB, 2: dit + 4 * GB, cfg.sp: dit}
    stages = tuple(DitStage(config=c, peak_bytes=peaks.get(c.sp, dit)) for c in dit_stage_configs(cfg, 8))
    return DecodeFacts(template=cfg.template.shape_key, config=cfg, dit_peak_bytes=dit, dit_stages=stages,
                       decode_peak_bytes=decode, latent_bytes=10**7)


def test_joint_keeps_the_entry_as_planned_and_records_nothing() -> None:
    lat = LatencyModel("a6000")
    cfg = ExecutionConfig(template=COG, ulysses=2, dp=4)
    e = _entry(cfg, lat, 1e6)
    assert choose_decode(e, _facts(cfg), lat, 8, 48 * GB, "joint") == (e, None)


def test_split_puts_the_decode_on_a_pool_with_the_dit_peak_without_the_decode() -> None:
    lat = LatencyModel("a6000")
    cfg = ExecutionConfig(template=COG, ulysses=2, dp=4)
    entry, choice = choose_decode(_entry(cfg, lat, 1e6), _facts(cfg), lat, 8, 48 * GB, "split")
    assert choice is not None and choice.stage == "pool" and choice.asked == "split"
    c, p = entry.config, entry.prediction
    assert c.decode is not None and c.total_gpus <= 8 and c.decode == choice.pool
    assert p.peak_bytes == choice.dit_peak_bytes and p.decode_peak_bytes == 30 * GB and p.decode_s and p.decode_s > 0
    assert entry.runner_up and entry.runner_up.startswith("decode in place")


def test_split_stays_in_place_saying_why_when_no_pool_fits() -> None:
    lat = LatencyModel("a6000")
    cfg = ExecutionConfig(template=COG)
    e = _entry(cfg, lat, 1e6)
    entry, choice = choose_decode(e, _facts(cfg), lat, 1, 48 * GB, "split")
    assert entry == e and choice is not None and choice.stage == "in_place" and "leave none" in choice.reason
    entry, choice = choose_decode(e, _facts(cfg, decode=60 * GB), lat, 2, 48 * GB, "split")
    assert entry == e and choice is not None and "no pool fits beside a DiT SP group" in choice.reason


def test_a_decode_that_fits_half_a_gpu_offers_fractional_workers() -> None:
    lat = LatencyModel("a6000")
    cfg = ExecutionConfig(template=COG, ulysses=2, dp=4)
    fractions = {o.pool.gpus_per_worker for o in pool_options(_entry(cfg, lat, 1e6), _facts(cfg, decode=20 * GB),
                                                               lat, 8, 48 * GB)}
    assert fractions == {1.0, 0.5}


def test_auto_keeps_the_decode_in_place_where_the_pool_serves_less_and_a_load_caps_both() -> None:
    lat = LatencyModel("a6000")
    cfg = ExecutionConfig(template=COG, ulysses=1, dp=2)  # the reference box's group: 2 GPUs, SP 1
    e = _entry(cfg, lat, 1e6)
    entry, choice = choose_decode(e, _facts(cfg), lat, 2, 48 * GB, "auto")
    assert entry == e and choice is not None and choice.stage == "in_place"
    assert choice.pool_goodput_rps is not None and choice.pool_goodput_rps < choice.in_place_goodput_rps
    assert "cost more goodput" in choice.reason
    # at a load below both capacities, both are simulated there: the pool's one DiT worker queues
    # what the in-place plan's two serve at once, so in place still meets more
    tight = _entry(cfg, lat, 1.5 * lat.seconds(cfg))
    load = choice.pool_goodput_rps * 0.7
    _, loaded = choose_decode(tight, _facts(cfg), lat, 2, 48 * GB, "auto", load_rps=load)
    assert loaded is not None and loaded.load_rps == load and loaded.stage == "in_place"
    assert "cost more goodput" in loaded.reason


def test_plan_split_records_config_decode_and_verify_holds_both_peaks(tmp_path: Path) -> None:
    """The issue's command, ``xema plan --templates cogvideox-5b:1280x720x49 --gpus 8 --budget 48GB
    --hardware a6000 --stages split`` (in this process), then ``xema verify`` on its table."""
    from xema_ray.measure.verify import verify_table

    opts = PlanOptions(hardware="a6000", budget=48 * 10**9, gpus=8, measure="never",
                       text_encoder="plan", stages="split")
    out = tmp_path / "split.json"
    result = plan(PlanRequest((COG,), opts, out=str(out), layouts=False, use_ray=False))
    e = result.table.entries[COG.shape_key]
    assert e.config.decode is not None and e.config.total_gpus <= 8
    choice = result.table.provenance.decode_stages[COG.shape_key]
    assert choice.stage == "pool" and choice.dit_peak_bytes == e.prediction.peak_bytes
    # the decode is where this template peaks: without it the DiT workers hold far less
    assert e.prediction.peak_bytes < choice.in_place_peak_bytes / 2
    table = PlanTable.load(str(out))
    assert table.entries[COG.shape_key].config.decode == e.config.decode
    report = verify_table(table, path=str(out))
    v = report.entries[0]
    assert v.error is None and v.fits and v.decode_peak_bytes is not None and v.decode_budget_bytes == 48 * 10**9
    assert v.device_peak_bytes <= v.budget_bytes and v.decode_peak_bytes <= v.decode_budget_bytes
    assert v.device_peak_bytes < v.decode_peak_bytes  # counted apart: the decode is not in the DiT's peak
    # the planner's predictions hold the worker's counts (margins on top)
    assert v.device_peak_bytes <= e.prediction.peak_bytes * 1.05
    assert v.decode_peak_bytes <= (e.prediction.decode_peak_bytes or 0) * 1.05


def test_plan_auto_records_a_choice_per_template_and_joint_none(tmp_path: Path) -> None:
    templates = (COG, RequestTemplate(model="ltx2", width=864, height=480, frames=49),
                 RequestTemplate(model="flux2", width=512, height=512))
    opts = PlanOptions(hardware="a6000", budget=48 * 10**9, gpus=2, group_gpus={"cogvideox-5b": 2, "ltx2": 2, "flux2": 2},
                       measure="never", stages="auto")
    result = plan(PlanRequest(templates, opts, layouts=False, use_ray=False))
    decodes = result.table.provenance.decode_stages
    assert set(decodes) == {COG.shape_key, templates[1].shape_key}  # video templates; an image model offers none
    for key, d in decodes.items():
        assert d.asked == "auto" and d.reason
        assert (result.table.entries[key].config.decode is not None) == (d.stage == "pool")
    joint = plan(PlanRequest(templates[:1], opts.model_copy(update={"stages": "joint"}), layouts=False, use_ray=False))
    assert joint.table.provenance.decode_stages == {} and joint.table.entries[COG.shape_key].config.decode is None


def test_deployment_pool_comes_on_top_of_the_dit_workers(tmp_path: Path) -> None:
    """``xema plan --deployment`` with a group of 2 DiT workers and ``decode: {workers: 1}``: the
    group counts 3 GPUs (as serving runs them), each template's search plans on the 2 DiT workers,
    and ``--stages split`` puts the decode on that pool, no other."""
    from planner.cli import deployment_decode_pools, deployment_groups
    from xema_ray.deployment import DecodePoolConfig

    yaml_path = tmp_path / "serve.yaml"
    yaml_path.write_text("applications:\n  - args:\n      models:\n        - model: cogvideox-5b\n          workers: 2\n"
                         "          decode: {workers: 1}\n          templates: [{width: 1280, height: 720, frames: 49}]\n")
    group_gpus, served, _ = deployment_groups(yaml_path)
    pools = deployment_decode_pools(yaml_path)
    assert group_gpus == {"cogvideox-5b": 3} and pools == {"cogvideox-5b": DecodePoolConfig(workers=1)}
    opts = PlanOptions(hardware="a6000", budget=48 * 10**9, gpus=3, group_gpus=group_gpus, decode_pools=pools,
                       measure="never", stages="split")
    assert opts.dit_gpus("cogvideox-5b") == 2 and opts.group_size("cogvideox-5b") == 3
    table = plan(PlanRequest(tuple(served), opts, layouts=False, use_ray=False)).table
    assert table.group_gpus == {"cogvideox-5b": 3}
    config = table.entries[served[0].shape_key].config
    assert config.decode is not None and (config.decode.workers, config.decode.gpus_per_worker) == (1, 1.0)
    assert config.gpus <= 2 and config.total_gpus <= 3  # the DiT on its workers, the pool on top
    joint = plan(PlanRequest(tuple(served), opts.model_copy(update={"stages": "joint"}), layouts=False,
                             use_ray=False)).table
    assert joint.entries[served[0].shape_key].config.gpus <= 2  # in place: the DiT workers only


def test_error_raised_if_a_baseline_is_asked_for_a_decode_stage(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    assert main(["plan", "--templates", "tiny-cogvideox:64x64x9", "--planner", "grid", "--stages", "split"]) == 2
    assert "--stages split plans Xema's decode stage" in capsys.readouterr().err


def test_verify_counts_one_requests_decode_whatever_the_dit_batch() -> None:
    from xema_ray.measure.verify import verify_stages

    t = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2)
    four = ExecutionConfig(template=t, batch=4, decode=DecodeStage(workers=1, gpus_per_worker=0.5))
    one = four.model_copy(update={"batch": 1})
    v4, v1 = verify_stages(four, 10**9), verify_stages(one, 10**9)
    assert v4.error is None and v1.error is None and v4.fits and v4.decode_budget_bytes == 5 * 10**8
    assert v4.decode_peak_bytes == v1.decode_peak_bytes  # a decode worker decodes one request
    assert v4.device_peak_bytes > v1.device_peak_bytes  # the DiT workers run the batch of four
