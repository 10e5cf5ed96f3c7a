"""Start an emulated box and serve a deployment on it: ``make serve-emulated``.

``python -m deployments.emulated_box deployments/xema-a6000x8-emulated.yaml [--port P] [--time-scale S]``

The process owns its Ray cluster: a fresh local head (``ray.init(address="local")``, its own temp
dir, no dashboard) that declares the deployment's GPUs (``num_gpus``: one per worker, 8 for the
A6000 box) though the machine has none, so the model groups' placement groups (``STRICT_PACK``,
one ``GPU`` bundle per worker) are placed as on the real box. Ctrl-C (or SIGTERM) shuts the app
and the cluster down; no other cluster on the machine is touched.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml


#: the environment start_box changed, as it was (restored by stop_box)
_SAVED_ENV: dict[str, str | None] = {}


def read_deployment(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(http_options, the first application's args) of a ``serve run`` YAML."""
    doc = yaml.safe_load(path.read_text())
    apps = doc.get("applications") or []
    if not apps:
        raise ValueError(f"{path}: no applications")
    return dict(doc.get("http_options") or {}), dict(apps[0].get("args") or {})


def start_box(args: dict[str, Any], host: str = "127.0.0.1", port: int = 8000, num_cpus: int | None = None,
              app_name: str = "xema", num_gpus: int | None = None) -> None:
    """Start a local Ray cluster with the deployment's emulated GPUs (or ``num_gpus``, room for
    more apps: ``serve_app``) and run the app on it (returns once it is ready; ``stop_box`` ends both)."""
    from ray import serve

    from xema_ray.serving.config import ServeConfig
    from xema_ray.serving.ray_env import apply_ray_env, init_local_ray, ray_env

    cfg = ServeConfig.model_validate(args)
    if cfg.device != "emulated":
        raise ValueError(f"this launcher serves device: emulated deployments; got device: {cfg.device}")
    gpus = num_gpus or sum(g.workers * g.replicas for g in cfg.models)
    # the settings are for the cluster this call starts: stop_box gives this process its own back,
    # so that a later multi-node cluster started from it is not local-only
    _SAVED_ENV.clear()
    _SAVED_ENV.update({k: os.environ.get(k) for k in (*ray_env(base={}), "RAY_USAGE_STATS_ENABLED")})
    apply_ray_env()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # CPUs: what the worker bundles reserve, plus room for the router, groups and Serve's actors
    cpus = num_cpus or max(os.cpu_count() or 1, int(gpus * cfg.worker_cpus) + 2)
    init_local_ray(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="xr-emu-", dir="/tmp"), log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve_app(args, app_name, "/")


def serve_app(args: dict[str, Any], name: str, route_prefix: str) -> None:
    """Run one more app on the box (its own emulated GPUs must be free) under ``route_prefix``."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(args), name=name, route_prefix=route_prefix)


def stop_box() -> None:
    from xema_ray.serving.ray_env import shutdown_serve_and_ray

    try:
        shutdown_serve_and_ray()
    finally:
        _restore_env()


def _restore_env() -> None:
    """This process's environment (and Ray's reading of the local-only switch) as before start_box."""
    import sys

    from xema_ray.serving.ray_env import LOCAL_ONLY_ENV

    for k, v in _SAVED_ENV.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    constants = sys.modules.get("ray._private.ray_constants")
    if _SAVED_ENV and constants is not None:
        constants.ENABLE_RAY_CLUSTER = os.environ.get(LOCAL_ONLY_ENV) != "0"
    _SAVED_ENV.clear()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path, help="serve run YAML with device: emulated")
    ap.add_argument("--port", type=int, default=None, help="HTTP port (default: the YAML's)")
    ap.add_argument("--time-scale", type=float, default=None, help="override the YAML's time_scale")
    a = ap.parse_args(argv)
    http, args = read_deployment(a.config)
    if a.time_scale is not None:
        args["time_scale"] = a.time_scale
    host, port = http.get("host", "127.0.0.1"), a.port or int(http.get("port", 8000))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    t0 = time.monotonic()
    start_box(args, host, port)
    print(f"emulated box ready on http://{host}:{port} in {time.monotonic() - t0:.0f} s "
          f"(time_scale {args.get('time_scale', 1.0)}); Ctrl-C stops it", flush=True)
    try:
        stop.wait()
    finally:
        stop_box()
    sys.exit(0)


if __name__ == "__main__":
    main()
