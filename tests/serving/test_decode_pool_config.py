"""A model group's ``decode:`` block (issue #54): refused at start naming the field when it is
bad, and start-up serves a table whose entries hand their decode to a pool only where the group
has one (a pooled plan on a group without one is refused, saying why)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from xema_ray.plan import DecodeStage, PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.startup import PlanNotRunnable, ShmSpace, check_runnable, gpu_shortfall, served_templates

ROOT = Path(__file__).resolve().parents[2]
SHM = ShmSpace(directory=Path("/dev/shm"), free_bytes=10**12)
TEMPLATES = [{"width": 64, "height": 64, "frames": 9, "steps": 4}]


def _cfg(decode: dict | None = None, device: str = "cpu", **extra: object) -> ServeConfig:  # type: ignore[type-arg]
    group: dict[str, object] = {"model": "tiny-cogvideox", "workers": 2, "templates": TEMPLATES}
    if decode is not None:
        group["decode"] = decode
    args: dict[str, object] = {"device": device, "models": [group], **extra}
    if device == "emulated":
        args["plan_table"] = "plans/demo-cpu.json"
    return ServeConfig.model_validate(args)


@pytest.mark.parametrize(("block", "field", "why"), [
    ({"workers": 0}, "models.0.decode.workers", "greater than or equal to 1"),
    ({"workers": 1, "gpus_per_worker": 0.3}, "models.0.decode.gpus_per_worker", "does not divide a GPU"),
    ({"workers": 1, "gpus_per_worker": 1.5}, "models.0.decode.gpus_per_worker", "whole number"),
    ({"workers": 1, "gpus_per_worker": 0}, "models.0.decode.gpus_per_worker", "greater than 0"),
    ({"workers": 1, "gpu": 1}, "models.0.decode.gpu", "Extra inputs"),
])
def test_a_bad_decode_block_is_refused_naming_the_field(block: dict, field: str, why: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValidationError) as e:
        _cfg(block)
    assert field in str(e.value) and why in str(e.value)


def test_a_good_block_reads_as_its_pool() -> None:
    for share in (1, 2, 0.5, 0.25, 0.125):
        pool = _cfg({"workers": 3, "gpus_per_worker": share}).models[0].decode
        assert pool is not None and pool.workers == 3 and pool.gpus == pytest.approx(3 * share)
    assert _cfg().models[0].decode is None  # no block: every decode in place


def test_a_model_that_decodes_in_place_only_refuses_a_pool_at_start() -> None:
    with pytest.raises(ValidationError, match=r"models\.0\n.*decode: tiny-ltx2 decodes in place only"):
        ServeConfig.model_validate({"models": [{"model": "tiny-ltx2", "templates": TEMPLATES, "decode": {"workers": 1}}]})


def test_an_emulated_box_refuses_a_pool_naming_the_group() -> None:
    with pytest.raises(ValidationError, match=r"models\[0\]\.decode: a decode pool runs on device: cpu or cuda"):
        _cfg({"workers": 1}, device="emulated")


def test_the_gpu_shortfall_counts_the_pool() -> None:
    cfg = _cfg({"workers": 2, "gpus_per_worker": 0.5}, device="cuda")
    assert gpu_shortfall(cfg, 3.0) is None  # 2 DiT workers + 2 x 0.5
    assert "ask for 3 GPUs" in (gpu_shortfall(cfg, 2.0) or "")


def _pooled_table(share: float = 1.0) -> PlanTable:
    table = PlanTable.load(str(ROOT / "plans" / "demo-cpu.json"))
    entries = dict(table.entries)
    for k, e in entries.items():
        if e.config.template.model == "tiny-cogvideox":
            stage = DecodeStage(workers=1, gpus_per_worker=share)
            entries[k] = e.model_copy(update={"config": e.config.model_copy(update={"decode": stage})})
    # planned for the group's 2 DiT workers and, on top of them, a pool of one GPU
    return table.model_copy(update={"entries": entries, "group_gpus": {**table.group_gpus, "tiny-cogvideox": 3}})


def test_a_pooled_table_is_served_by_a_group_with_a_pool_and_refused_without() -> None:
    table = _pooled_table()
    cfg = _cfg({"workers": 1})
    assert check_runnable(table, cfg, served_templates(cfg), shm=SHM) > 0
    bare = _cfg()
    with pytest.raises(PlanNotRunnable, match=r"tiny-cogvideox/64x64x9.*hands its decode to a decode pool of 1 "
                                              r"worker\(s\).*the tiny-cogvideox group has no decode: block.*dropped "
                                              r"the VAE mitigations"):
        check_runnable(table, bare, served_templates(bare), shm=SHM)


def test_a_cuda_pool_with_a_smaller_gpu_share_than_planned_is_refused() -> None:
    table = _pooled_table(share=0.5)
    small = _cfg({"workers": 2, "gpus_per_worker": 0.25}, device="cuda", host_memory="1TB")
    with pytest.raises(PlanNotRunnable, match=r"decodes on 0.5 GPU per decode worker, the tiny-cogvideox group's "
                                              r"decode.gpus_per_worker is 0.25"):
        check_runnable(table, small, served_templates(small), shm=SHM, host_memory_bytes=10**12)
    same = _cfg({"workers": 2, "gpus_per_worker": 0.5}, device="cuda")
    assert check_runnable(table, same, served_templates(same), shm=SHM, host_memory_bytes=10**12) > 0


def test_the_demo_serves_tiny_cogvideox_with_the_pool_its_plan_table_chose() -> None:
    """``make serve``'s YAML gives tiny-cogvideox a decode pool, and the committed table's entries for
    it come from the planner's decode-stage pass (``--stages split``): each carries ``config.decode``
    and its choice with the reason; no other group's entry plans a pool, and start-up serves it."""
    import yaml

    args = yaml.safe_load((ROOT / "deployments" / "xema.yaml").read_text())["applications"][0]["args"]
    cfg = ServeConfig.model_validate(args)
    table = PlanTable.load(str(ROOT / "plans" / "demo-cpu.json"))
    pooled = {k for k, e in table.entries.items() if e.config.decode is not None}
    assert {g.model for g in cfg.models if g.decode is not None} == {"tiny-cogvideox"}
    assert pooled == {"tiny-cogvideox/64x64x9", "tiny-cogvideox/128x96x17"}
    for k in pooled:
        choice = table.provenance.decode_stages[k]
        assert choice.stage == "pool" and choice.asked == "split" and choice.reason
    templates = served_templates(cfg)
    assert check_runnable(table, cfg, templates, shm=SHM, host_memory_bytes=10**12) > 0
