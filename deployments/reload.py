"""``xema serve CONFIG --reload-plans TABLE``: a running app serves a new plan table, no restart.

What it does, with Ray Serve's own declarative API (what ``serve deploy`` calls):

1. loads TABLE and checks it as start-up would (``load_or_plan``): every served template planned,
   the hardware the table was made for, every plan runnable by its group;
2. reads the running application's config from Serve (the dashboard's REST API) and refuses if it
   is not CONFIG's (its ``args`` differ: the app would be rebuilt, not updated);
3. deploys the same config with each ModelGroup's plans and the Router's table as the
   deployments' ``user_config``: the application's code version is unchanged, so Serve restarts
   nothing and calls ``reconfigure`` on the replicas in place (``xema_ray.serving.group.plan_reload``:
   a group whose plans changed swaps them with nothing accepted lost; the others do nothing);
4. waits until ``/healthz`` shows every group on the new plans, and says which groups changed.

The new plans stay the deployments' target: a replica Serve replaces later gets them too. A
restart of the app (``xema serve CONFIG``) starts from CONFIG's ``plan_table`` again: set it there
to keep the new table across restarts.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import yaml

from xema_ray.plan import PlanTable
from xema_ray.serving.group.plan_reload import ROUTER_DEPLOYMENT, SharedPlans, RouterPlans, group_plans

APP_IMPORT = "deployments.app:build_app"
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


def _app_of(raw: dict[str, Any], name: str | None) -> dict[str, Any]:
    apps = [a for a in raw.get("applications", []) if (a.get("name") == name if name else a.get("import_path") == APP_IMPORT)]
    if len(apps) != 1:
        raise ValueError(f"the config has {len(apps)} applications {'named ' + name if name else 'of ' + APP_IMPORT}; "
                         "name one with --app")
    return apps[0]


def _healthz(url: str) -> dict[str, Any]:
    import requests

    r = requests.get(f"{url}/healthz", timeout=30)
    return dict(r.json())


def missing_layout_files(table: PlanTable, table_path: Path, keys: list[str]) -> list[str]:
    """The layout files the served entries name that are not next to the table (the workers would
    fail to load them: ``xema_ray.allocator.artifact.load_artifact``)."""
    from xema_ray.allocator.artifact import layouts_dir

    folder = layouts_dir(table_path)
    refs = sorted({ref for k in keys if (ref := table.entries[k].config.layout_ref) is not None})
    return [str(folder / f"{ref}.json") for ref in refs if not (folder / f"{ref}.json").is_file()]


def new_config(raw: dict[str, Any], app_name: str, deployed: dict[str, dict[str, Any]], table_path: Path
               ) -> tuple[dict[str, Any], dict[str, str]]:
    """The config to deploy (the running apps as they are, ours with the new table's
    ``user_config``s) and each of our groups' new plans hash. Raises ValueError."""
    from deployments.planning import load_or_plan
    from xema_ray.serving.config import ServeConfig
    from xema_ray.serving.startup import served_templates

    ours = deployed.get(app_name)
    if ours is None:
        raise ValueError(f"no application {app_name!r} is running (running: {', '.join(deployed) or 'none'})")
    mine = _app_of(raw, app_name)
    if json.dumps(ours.get("args"), sort_keys=True, default=str) != json.dumps(mine.get("args"), sort_keys=True, default=str):
        raise ValueError(f"the running {app_name!r} was started with other args than this config's: a new table goes "
                         "to the app it was made for (restart it with the new config instead)")
    cfg = ServeConfig.model_validate({**(mine.get("args") or {}), "plan_table": str(table_path)})
    if cfg.device == "emulated":
        raise ValueError("an emulated box's groups run on scaled plans: restart it with the new plan_table")
    templates = served_templates(cfg)
    table, _ = load_or_plan(cfg, templates)  # the checks start-up makes: coverage, hardware, runnable
    missing_layouts = missing_layout_files(table, table_path, [t.shape_key for t in templates])
    if missing_layouts:
        raise ValueError(f"the table's layout files are missing: {', '.join(missing_layouts[:5])} "
                         f"(`xema layouts --plan-table {table_path}` writes them)")
    overrides, hashes, shared = [], {}, {}
    where = cfg.group_deployments()  # a group's own deployment, or the SharedReplica holding it (shared_replicas)
    for g in cfg.models:
        gp = group_plans(table, g.model, [t.shape_key for t in templates if t.model == g.model], table_path)
        hashes[g.model] = gp.hash
        if where[g.model].startswith("SharedReplica:"):
            shared.setdefault(where[g.model], {})[g.model] = gp
            continue
        overrides.append({"name": where[g.model], "user_config": gp.model_dump(mode="json")})
    overrides += [{"name": n, "user_config": SharedPlans(groups=gs).model_dump(mode="json")} for n, gs in shared.items()]
    overrides.append({"name": ROUTER_DEPLOYMENT, "user_config": RouterPlans(table=table).model_dump(mode="json")})
    named = {o["name"] for o in overrides}
    kept = [d for d in ours.get("deployments", []) if d.get("name") not in named]
    apps = [{**cfg_, "deployments": kept + overrides} if n == app_name else cfg_ for n, cfg_ in deployed.items()]
    top = {k: v for k, v in raw.items() if k != "applications"}
    return {**top, "applications": apps}, hashes


def reload_plans(config_path: str, table_path: str, dashboard: str = DEFAULT_DASHBOARD, app_name: str | None = None,
                 timeout_s: float = 600.0, out: TextIO | None = None) -> int:
    """Serve ``table_path`` in the running app of ``config_path`` (module docstring). Returns the
    exit status: 0 served, 1 a group could not load it (it keeps its previous plans) or not within
    ``timeout_s``, 2 refused before anything was deployed (the message says why)."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    w = (out or sys.stdout).write
    raw = yaml.safe_load(Path(config_path).read_text())
    try:
        name = _app_of(raw, app_name)["name"]
        client = ServeSubmissionClient(dashboard)
        details = client.get_serve_details()
        deployed = {n: a["deployed_app_config"] for n, a in (details.get("applications") or {}).items()
                    if a.get("deployed_app_config")}
        config, hashes = new_config(raw, name, deployed, Path(table_path).resolve())
    except (ValueError, OSError) as e:
        print(f"xema serve --reload-plans: {e}", file=sys.stderr)
        return 2
    http = raw.get("http_options") or {}
    url = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"
    before = {m: g.get("plans_hash") for m, g in _healthz(url).get("groups", {}).items()}
    changed = sorted(m for m, h in hashes.items() if before.get(m) != h)
    w(f"plan table {table_path}: groups whose plans change: {', '.join(changed) or 'none'}; "
      f"unchanged: {', '.join(sorted(set(hashes) - set(changed))) or 'none'}\n")
    t0 = time.monotonic()
    client.deploy_applications(config)
    while time.monotonic() - t0 < timeout_s:
        groups = _healthz(url).get("groups", {})
        failed = {m: g.get("plans_reload_error") for m, g in groups.items()
                  if m in hashes and g.get("plans_reload_error") and hashes[m] in g["plans_reload_error"]}
        if failed:
            w(f"not served: {json.dumps(failed)[:2000]}; those groups keep serving their previous plans\n")
            return 1
        if all(groups.get(m, {}).get("plans_hash") == h and not groups.get(m, {}).get("plans_swapping")
               for m, h in hashes.items()):
            w(f"serving {table_path} after {time.monotonic() - t0:.1f} s (no restart)\n")
            return 0
        time.sleep(1.0)
    w(f"not every group serves {table_path} after {timeout_s:.0f} s: {json.dumps(groups)[:2000]}\n")
    return 1
