"""The demo starts fast (issue #49): the app's processes that run no model import no torch (the
builder of the app imports no model code either), the demo YAML serves from its committed plan table
(no planning, no cache in HOME at start-up), its groups' workers run in their replica (``worker_set:
inprocess``) and its eight groups share one replica process (``shared_replicas: 1``), whose CPU
reservation leaves the planner room on two cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.scenarios.factories import plan_entry
from deployments.app import worker_resources
from deployments.planning import load_or_plan
from xema_ray.plan import PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.startup import served_templates
from xema_ray.templates import RequestTemplate

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "diffusers", "transformers")
#: what the HTTP proxy, the Router, Stats and ``xema serve`` itself import: none runs a model
LIGHT = ("xema_ray.serving.api.middleware", "xema_ray.serving.api.router", "xema_ray.serving.stats",
         "xema_ray.serving.ray_env", "xema_ray.cli", "xema_ray.serving.config", "xema_ray.serving.messages",
         # what Serve's build task and a group's replica import before the group builds its model
         "deployments.app", "xema_ray.serving.group.shared_replica")


def _demo() -> ServeConfig:
    args = yaml.safe_load((ROOT / "deployments" / "xema.yaml").read_text())["applications"][0]["args"]
    return ServeConfig.model_validate(args)


@pytest.mark.parametrize("module", LIGHT)
def test_processes_that_run_no_model_import_no_torch(module: str) -> None:
    code = f"import json, sys, {module}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=ROOT)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], f"{module} imports a heavy module"


def test_the_demo_serves_its_committed_table_without_planning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = _demo()
    assert cfg.plan_table == Path("plans/demo-cpu.json") and cfg.worker_set == "inprocess"
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HOME", str(tmp_path))  # a fresh home: nothing is read or written there

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("start-up planned although the YAML gives a plan table")

    monkeypatch.setattr("deployments.planning.plan_now", refuse)
    templates = served_templates(cfg)
    table, _ = load_or_plan(cfg, templates)
    assert {t.shape_key for t in templates} <= set(table.entries)
    assert all(table.lookup(t).config.sp == 1 for t in templates)  # in-process workers run SP 1
    assert list(tmp_path.iterdir()) == []
    # the deployment's quality tiers priced on the committed entries (nothing measured): lossless and
    # fast everywhere, balanced (int8 weights on the CPU) where the model's spec quantizes its weights
    for t in templates:
        e = table.lookup(t)
        quantizes = t.spec.weight_quant is not None
        assert sorted(e.tiers) == (["balanced"] if quantizes else []) + ["fast", "lossless"]
        assert e.tiers["lossless"].latency_s == e.prediction.latency_s
        assert e.tiers["fast"].latency_s <= e.prediction.latency_s
        if quantizes:
            assert e.tiers["balanced"].weights == "int8" and e.tiers["balanced"].cache is None


def test_the_demo_leaves_the_planner_a_cpu_on_two_cores() -> None:
    cfg = _demo()
    table = PlanTable.load(str(ROOT / "plans" / "demo-cpu.json"))
    held = 0.0
    for g in cfg.models:
        plans = {t.shape_key: table.lookup(t) for t in served_templates(cfg) if t.model == g.model}
        opts = worker_resources(cfg, g, plans)
        assert "placement_group_bundles" not in opts  # no placement group: the replica holds its workers
        held += opts["ray_actor_options"]["num_cpus"]
        if g.decode is not None:  # the decode pool's actors ask for their own CPUs (worker_cpus each)
            held += g.decode.workers * cfg.worker_cpus
    assert held == pytest.approx(0.70)
    assert 2 - held >= 1.0  # planning tasks ask for min(1, free) CPU each (planner.cluster_fit)


def test_the_demos_eight_groups_share_one_replica_process_each_its_own_group(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from deployments.app import build_app

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = _demo()
    assert cfg.shared_replicas == 1 and set(cfg.group_deployments().values()) == {"SharedReplica:0"}
    args = yaml.safe_load((ROOT / "deployments" / "xema.yaml").read_text())["applications"][0]["args"]
    router = build_app(args)._bound_deployment
    groups = router.init_args[0]
    assert list(groups) == [g.model for g in cfg.models]  # every model of the YAML still served
    shared = {id(a) for a in groups.values()}
    assert len(shared) == 1  # one deployment, one replica process
    deployment = next(iter(groups.values()))._bound_deployment
    assert deployment.name == "SharedReplica:0" and deployment.num_replicas == 1
    assert deployment.ray_actor_options["num_cpus"] == pytest.approx(0.65)  # what the eight replicas reserved
    members = deployment.init_args[0]
    assert [m.config.model for m in members] == list(groups)
    table = PlanTable.load(str(ROOT / "plans" / "demo-cpu.json"))
    for m in members:  # each with the plans its own deployment had: the same templates, the same entries
        served = {t.shape_key for t in served_templates(cfg) if t.model == m.config.model}
        assert set(m.plans) == served and all(m.plans[k].config == table.entries[k].config for k in served)
    assert router.init_kwargs["shared"] == {m: "SharedReplica:0" for m in groups}


def test_groups_that_replicate_keep_a_deployment_of_their_own() -> None:
    cfg = _demo()
    models = [cfg.models[0].model_copy(update={"replicas": 2}), *cfg.models[1:4]]
    two = cfg.model_copy(update={"models": models, "shared_replicas": 2})
    assert two.group_deployments() == {"tiny-flux2": "ModelGroup:tiny-flux2", "tiny-cogvideox": "SharedReplica:0",
                                       "tiny-ltx2": "SharedReplica:1", "tiny-cogvideox-i2v": "SharedReplica:0"}
    assert cfg.model_copy(update={"shared_replicas": 0}).group_deployments()["tiny-ltx2"] == "ModelGroup:tiny-ltx2"
    with pytest.raises(ValueError, match="shared_replicas: groups share a replica process only with worker_set: inprocess"):
        ServeConfig.model_validate({"shared_replicas": 1,
                                    "models": [{"model": "tiny-flux2", "templates": [{"width": 64, "height": 64}]}]})


def test_inprocess_workers_refuse_sp2_plans_and_gpus() -> None:
    cfg = _demo()
    g = cfg.models[0]
    t = RequestTemplate(model=g.model, width=64, height=64, steps=4)
    with pytest.raises(ValueError, match="worker_set: inprocess runs plans of SP 1 only.*tiny-flux2/64x64x1"):
        worker_resources(cfg, g, {t.shape_key: plan_entry(t, ulysses=2)})
    ray_cfg = cfg.model_copy(update={"worker_set": "ray"})
    assert worker_resources(ray_cfg, g, {t.shape_key: plan_entry(t, ulysses=2)})["placement_group_bundles"]
    with pytest.raises(ValueError, match="worker_set: inprocess runs on device: cpu only"):
        ServeConfig.model_validate({"device": "cuda", "worker_set": "inprocess",
                                    "models": [{"model": "tiny-flux2", "templates": [{"width": 64, "height": 64}]}]})


def test_a_relative_plan_table_is_found_from_another_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from deployments.planning import resolve_plan_table

    monkeypatch.chdir(tmp_path)
    cfg = resolve_plan_table(_demo())
    assert cfg.plan_table == ROOT / "plans" / "demo-cpu.json"
    missing = _demo().model_copy(update={"plan_table": Path("plans/no-such.json")})
    assert resolve_plan_table(missing).plan_table == Path("plans/no-such.json")  # left to fail, naming it


def test_make_demo_plan_writes_what_start_up_plans_with_the_overhead_recorded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from deployments import planning

    seen: dict[str, object] = {}

    def fake_plan_now(cfg: ServeConfig, templates: list[RequestTemplate], overhead_s: float = 0.0,
                      video_overhead_s: float | None = None) -> PlanTable:
        seen.update(plan_table=cfg.plan_table, cache_dir=cfg.cache_dir, overhead_s=overhead_s, video=video_overhead_s,
                    n=len(templates))
        return PlanTable(hardware="2x cpu", gpus=2, budget_bytes=96 * 10**6,
                         entries={t.shape_key: plan_entry(t) for t in templates})

    monkeypatch.setattr(planning, "plan_now", fake_plan_now)
    out = tmp_path / "demo.json"
    assert planning.main([str(ROOT / "deployments" / "xema.yaml"), "--out", str(out), "--overhead-s", "0.12"]) == 0
    # planned as start-up would (no table given, no cache kept), the serving path's seconds passed on
    assert seen == {"plan_table": None, "cache_dir": None, "overhead_s": 0.12, "video": 0.12, "n": 17}
    table = PlanTable.load(str(out))
    assert table.provenance.notes["serving_overhead_s"] == "0.1200"
    assert "--overhead-s 0.12" in (table.provenance.command or "")


def test_the_load_test_simulator_adds_only_the_overhead_a_table_does_not_price() -> None:
    from loadtests.run import unpriced_overhead

    demo = PlanTable.load(str(ROOT / "plans" / "demo-cpu.json"))
    priced = float(demo.provenance.notes["serving_overhead_s"])
    assert priced > 0  # the demo's table prices the serving path
    assert unpriced_overhead(demo, priced + 0.02) == pytest.approx(0.02)
    assert unpriced_overhead(demo, priced / 2) == 0.0
    plain = demo.model_copy(update={"provenance": demo.provenance.model_copy(update={"notes": {}})})
    assert unpriced_overhead(plain, 0.05) == 0.05  # a table planned without it: the simulator adds it all
