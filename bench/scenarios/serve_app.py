"""The Serve application on this machine for a test module: Ray with local-only ports and the
proxy's JSON errors (as ``make serve`` starts it), the app built from ``args`` with a plan table,
everything torn down afterwards."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ray import serve
from ray.exceptions import RayActorError

from xema_ray.net import free_port
from xema_ray.plan import PlanTable
from xema_ray.serving.ray_env import apply_ray_env, init_local_ray, shutdown_serve_and_ray
from xema_ray.serving.api.ready import wait_ready


@contextlib.contextmanager
def running_app(args: dict, table: PlanTable, plans_dir: Path, num_cpus: int = 4,
                metrics_report_ms: int | None = None) -> Iterator[str]:
    """Serve the app of ``args`` with ``table`` (saved under ``plans_dir``); yields its base URL.
    ``metrics_report_ms``: how often Ray's processes send their metrics to the node's Prometheus
    endpoint (None: Ray's default, 10 s; a test that watches a figure move wants it short)."""
    from deployments.app import build_app

    path = plans_dir / "table.json"
    table.save(str(path))
    args = {**args, "plan_table": str(path)}
    port = free_port()
    saved_env = dict(os.environ)
    apply_ray_env(open_ports=False)
    system = {} if metrics_report_ms is None else {"metrics_report_interval_ms": metrics_report_ms}
    init_local_ray(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _system_config=system or None)
    try:
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        except RayActorError:
            # on a loaded machine Serve's controller can find its first proxy unhealthy before it
            # is ready and start another; the controller is up, so connect to it again, and
            # wait_ready below waits for the new proxy's first answer
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="xema", route_prefix="/")
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=300)  # /healthz 200: every group answers
        yield f"http://127.0.0.1:{port}"
    finally:
        shutdown_serve_and_ray()
        os.environ.clear()
        os.environ.update(saved_env)
