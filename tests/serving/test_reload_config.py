"""`xema serve CONFIG --reload-plans TABLE` deploys a config that Serve applies in place: the same
application code version (so no replica restarts; Serve calls `reconfigure`), each group's plans
and the Router's table as the deployments' `user_config`; and it refuses what start-up would refuse.
No Ray cluster: the config is computed and checked with Serve's own schema and version function."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.serve._private.deploy_utils import get_app_code_version
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from bench.scenarios.factories import plan_entry
from deployments.planning import machine_fingerprint
from deployments.reload import new_config
from xema_ray.plan import PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.group.plan_reload import GroupPlans, RouterPlans
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
ARGS = {"device": "cpu", "budget": "96MB",
        "models": [{"model": "tiny-flux2", "workers": 1, "templates": [{"width": 64, "height": 64, "steps": 2}]}]}
APP = {"name": "xema", "route_prefix": "/", "import_path": "deployments.app:build_app", "args": ARGS}
RAW = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8000}, "applications": [APP]}


def _table(path: Path, batch: int = 2) -> Path:
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(ARGS), 1), gpus=1, budget_bytes=96 * 10**6,
                      entries={FLUX.shape_key: plan_entry(FLUX, batch=batch)})
    table.save(str(path))
    return path


def test_the_new_config_is_applied_in_place_with_each_groups_plans(tmp_path: Path) -> None:
    path = _table(tmp_path / "tiny.json")
    config, hashes = new_config(RAW, "xema", {"xema": dict(APP), "other": {"name": "other", "route_prefix": "/other", "import_path": "x:y"}}, path)
    ServeDeploySchema.model_validate(config)  # what Serve's REST API validates
    ours = next(a for a in config["applications"] if a["name"] == "xema")
    # the code version Serve compares is unchanged: a lightweight update, no replica restarted
    assert get_app_code_version(ServeApplicationSchema.model_validate(ours)) == \
        get_app_code_version(ServeApplicationSchema.model_validate(APP))
    by_name = {d["name"]: d["user_config"] for d in ours["deployments"]}
    group = GroupPlans.model_validate(by_name["ModelGroup:tiny-flux2"])
    assert group.hash == hashes["tiny-flux2"] and group.plans[FLUX.shape_key].config.batch == 2
    assert group.layouts_dir == str(tmp_path / "tiny.layouts")
    assert RouterPlans.model_validate(by_name["Router"]).table.entries[FLUX.shape_key].config.batch == 2
    assert [a["name"] for a in config["applications"]] == ["xema", "other"]  # the other app kept as it runs


def test_error_raised_if_the_running_app_has_other_args(tmp_path: Path) -> None:
    path = _table(tmp_path / "tiny.json")
    running = {**APP, "args": {**ARGS, "budget": "48GB"}}
    with pytest.raises(ValueError, match="other args"):
        new_config(RAW, "xema", {"xema": running}, path)
    with pytest.raises(ValueError, match="no application 'xema' is running"):
        new_config(RAW, "xema", {}, path)


def test_error_raised_if_the_table_lacks_a_served_template(tmp_path: Path) -> None:
    other = RequestTemplate(model="tiny-flux2", width=128, height=128, steps=2)
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(ARGS), 1), gpus=1, budget_bytes=96 * 10**6,
                      entries={other.shape_key: plan_entry(other)})
    table.save(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="no plan for tiny-flux2/64x64x1"):
        new_config(RAW, "xema", {"xema": dict(APP)}, tmp_path / "t.json")


def test_error_raised_if_the_tables_layout_files_are_missing(tmp_path: Path) -> None:
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(ARGS), 1), gpus=1, budget_bytes=96 * 10**6,
                      entries={FLUX.shape_key: plan_entry(FLUX, layout_ref="7ac23b0e57b84838")})
    table.save(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match=r"t.layouts/7ac23b0e57b84838.json.*xema layouts --plan-table"):
        new_config(RAW, "xema", {"xema": dict(APP)}, tmp_path / "t.json")


def test_groups_in_a_shared_replica_get_their_plans_through_it(tmp_path: Path) -> None:
    from xema_ray.serving.group.plan_reload import SharedPlans

    args = {**ARGS, "worker_set": "inprocess", "shared_replicas": 1}
    app = {**APP, "args": args}
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(args), 1), gpus=1, budget_bytes=96 * 10**6,
                      entries={FLUX.shape_key: plan_entry(FLUX, batch=2)})
    table.save(str(tmp_path / "t.json"))
    config, hashes = new_config({**RAW, "applications": [app]}, "xema", {"xema": dict(app)}, tmp_path / "t.json")
    ServeDeploySchema.model_validate(config)
    by_name = {d["name"]: d["user_config"] for d in config["applications"][0]["deployments"]}
    assert "ModelGroup:tiny-flux2" not in by_name  # the group has no deployment of its own
    shared = SharedPlans.model_validate(by_name["SharedReplica:0"])
    assert shared.groups["tiny-flux2"].hash == hashes["tiny-flux2"]
    assert shared.groups["tiny-flux2"].plans[FLUX.shape_key].config.batch == 2
