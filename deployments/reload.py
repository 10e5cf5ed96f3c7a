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

from xema_ray.serving.group.plan_reload import GROUP_DEPLOYMENT, ROUTER_DEPLOYMENT, RouterPlans, group_plans

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
    overrides, hashes = [], {}
    for g in cfg.models:
        gp = group_plans(table, g.model, [t.shape_key for t in templates if t.model == g.model], table_path)
        name = GROUP_DEPLOYMENT.format(model=g.model)
        overrides.append({"name": name, "user_config": gp.model_dump(mode="json")})
        hashes[g.model] = gp.hash
    overrides.append({"name": ROUTER_DEPLOYMENT, "user_config": RouterPlans(table=table).model_dump(mode="json")})
    named = {o["name"] for o in overrides}
    kept = [d for d in ours.get("deployments", []) if d.get("name") not in named]
    apps = [{**cfg_, "deployments": kept + overrides} if n == app_name else cfg_ for n, cfg_ in deployed.items()]
    top = {k: v for k, v in raw.items() if k != "applications"}
    return {**top, "applications": apps}, hashes


def reload_plans(config_path: str, table_path: str, dashboard: str = DEFAULT_DASHBOARD, app_name: str | None = None,
                 timeout_s: float = 600.0, out: TextIO | None = None) -> int:
    """Serve ``table_path`` in the running app of ``config_path`` (module docstring). Returns the
    exit status: 0 served, 1 not within ``timeout_s``, 2 refused (the message says why)."""
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
        if all(groups.get(m, {}).get("plans_hash") == h and not groups.get(m, {}).get("plans_swapping")
               for m, h in hashes.items()):
            w(f"serving {table_path} after {time.monotonic() - t0:.1f} s (no restart)\n")
            return 0
        time.sleep(1.0)
    w(f"not every group serves {table_path} after {timeout_s:.0f} s: {json.dumps(groups)[:2000]}\n")
    return 1
