"""The environment a Ray cluster started for the app gets: local-only ports by default, and the
proxy middleware that turns Ray Serve's own error answers into the API's JSON errors.

And ``PYTHONHASHSEED=0``, under which the workers' allocation streams are the ones their static
layouts were solved from (``xema_ray.hash_seed``). All are settings Ray reads from its processes' environment when they start (the raylet passes
its environment to the workers, the Serve controller and the HTTP proxy), so they must be in
the environment of whatever starts Ray: ``make serve`` (``serve run``), ``ray start``, or a
test's ``ray.init``. Measured on Ray 2.60 (docs/operations.md "Ports"): by default the GCS, the raylet, every
worker and replica and the dashboard agent listen on all interfaces; with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` Ray takes 127.0.0.1 as the node address and every one
of them listens on 127.0.0.1 only. A cluster of several machines needs them reachable: open them
with ``open_ports=True`` (``make serve XEMA_RAY_OPEN_PORTS=1``) and firewall them instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from xema_ray.hash_seed import HASH_SEED, HASH_SEED_ENV
from xema_ray.ray_start import RAYLET_TIMEOUT, init_local_ray  # noqa: F401  (its users import it from here too)
from xema_ray.serving.api.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV

#: Ray's switch: "0" makes a node use 127.0.0.1 as its address, so its servers bind only there
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: our setting: "1" leaves Ray's ports on all interfaces (a multi-node cluster)
OPEN_PORTS_ENV = "XEMA_RAY_OPEN_PORTS"
PATH_ENV = "PATH"



def ray_env(open_ports: bool | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) plus the app's Ray settings.

    Args:
        open_ports: leave Ray's internal ports on all interfaces; None reads ``XEMA_RAY_OPEN_PORTS``.
        base: the environment to extend.

    Example:
        >>> ray_env(open_ports=False, base={})["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]
        '0'
    """
    env = dict(os.environ if base is None else base)
    # jobs (`ray job submit -- python -m planner ...`) run their entry point with the cluster's
    # PATH: this environment's interpreter first, so that `python` is the one with Ray and the app
    env[PATH_ENV] = with_bin_first(env.get(PATH_ENV, ""), str(Path(sys.executable).parent))
    if open_ports is None:
        open_ports = env.get(OPEN_PORTS_ENV, "0") == "1"
    env.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    # the workers' allocation streams are the ones their static layouts were solved from only
    # with string hashing unsalted (xema_ray.hash_seed)
    env[HASH_SEED_ENV] = HASH_SEED
    if open_ports:
        env.pop(LOCAL_ONLY_ENV, None)
    else:
        env[LOCAL_ONLY_ENV] = "0"
    return env


def serve_run_config(config: str, env: Mapping[str, str], serve_args: Sequence[str] = ()) -> str:
    """The config ``xema serve`` hands ``serve run``: ``config`` itself, or, where the Ray cluster
    ``serve run`` starts gets every variable of the YAML's ``controller_options.runtime_env`` from
    ``env`` already (the proxy's JSON errors, ``ray_env``), the same config without
    ``controller_options``, written to the temporary folder (one file per content).

    Why: a runtime environment on Serve's controller is inherited by everything Serve starts (its
    HTTP proxy, the build task, every replica), and a process with a runtime environment of its own
    cannot be one of the workers Ray started ahead: each starts afresh. On the 2-core VM the demo
    answered 4-5 s sooner without it (BENCHMARKS.md "Start-up"). The YAML keeps the block for a
    plain ``serve run``, which gets the middleware from it.

    Kept as it is when ``serve run`` may attach to a running cluster (``--address``, ``-a`` or
    ``RAY_ADDRESS``: that cluster's environment is not ``env``), or when the block holds anything
    else.
    """
    import hashlib
    import tempfile

    import yaml

    if "RAY_ADDRESS" in env or any(a in ("--address", "-a") or a.startswith("--address=") for a in serve_args):
        return config
    try:
        raw = yaml.safe_load(Path(config).read_text())
    except (OSError, yaml.YAMLError):
        return config  # serve run reads it and says what is wrong
    options = raw.get("controller_options") if isinstance(raw, dict) else None
    if not isinstance(options, dict) or set(options) != {"runtime_env"}:
        return config
    runtime_env = options["runtime_env"]
    if not isinstance(runtime_env, dict) or set(runtime_env) != {"env_vars"} or not isinstance(runtime_env["env_vars"], dict):
        return config
    if any(env.get(k) != str(v) for k, v in runtime_env["env_vars"].items()):
        return config
    text = (f"# {Path(config).resolve()} as `xema serve` runs it: controller_options dropped, this cluster's "
            "environment sets them (xema_ray/serving/ray_env.py serve_run_config)\n"
            + yaml.safe_dump({k: v for k, v in raw.items() if k != "controller_options"}, sort_keys=False))
    out = Path(tempfile.gettempdir()) / f"xema-serve-{Path(config).stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    if not out.is_file() or out.read_text() != text:
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(out)
    return str(out)


def with_bin_first(path: str, bin_dir: str) -> str:
    """``path`` (a PATH value) with ``bin_dir`` first, once.

    Example:
        >>> with_bin_first("/usr/bin:/repo/.venv/bin", "/repo/.venv/bin")
        '/repo/.venv/bin:/usr/bin'
    """
    rest = [p for p in path.split(os.pathsep) if p and p != bin_dir]
    return os.pathsep.join([bin_dir, *rest])


def apply_ray_env(open_ports: bool | None = None) -> None:
    """Put ``ray_env``'s settings into this process's environment, before it starts Ray
    (``ray.init`` of a new local cluster). Never at import: callers do it explicitly."""
    import sys

    env = ray_env(open_ports)
    if LOCAL_ONLY_ENV not in env:
        os.environ.pop(LOCAL_ONLY_ENV, None)
    os.environ.update(env)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        # Ray read the switch when it was imported, and the driver picks the node address it
        # hands to the GCS and raylet from that reading (services.get_node_ip_address)
        constants.ENABLE_RAY_CLUSTER = LOCAL_ONLY_ENV not in env


def exposed_ports_warning() -> str | None:
    """Why this Ray node's ports are reachable from other machines, if they are and nobody said
    so (``XEMA_RAY_OPEN_PORTS=1`` in the cluster's environment); None when they listen on
    127.0.0.1 only. Called where the app is built (``deployments.app.build_app``), inside the
    cluster: by then Ray's processes are bound, so the app can only tell, not fix."""
    import ipaddress

    import ray

    if not ray.is_initialized() or os.environ.get(OPEN_PORTS_ENV) == "1":
        return None
    ip = ray.util.get_node_ip_address()
    try:
        if ipaddress.ip_address(ip).is_loopback:
            return None
    except ValueError:
        return None
    return (f"Ray on this node uses {ip} as its address: its GCS, raylet, workers and agents listen on all "
            "interfaces. The cluster was started without the app's settings (plain `serve run` or `ray start`). "
            "Start the app with `xema serve deployments/xema.yaml` (or `make serve`) for 127.0.0.1-only ports, or "
            f"set {OPEN_PORTS_ENV}=1 where Ray is started if a multi-node cluster needs them open "
            "(docs/serving.md \"Ports\").")


def shutdown_serve_and_ray(settle_s: float = 1.0) -> None:
    """Stop Serve, then Ray, in a process that started both (tests, benchmarks, the emulated box).

    Serve's handles run their routers on threads of this process; one still winding down when
    ``ray.shutdown()`` destroys the core worker touches it, and Ray then ends the whole process
    ("The core worker has already been shutdown ... The process will exit", exit status 1; seen
    at a test module's teardown). So the app's handles and object refs are collected and Serve's
    threads get ``settle_s`` seconds to end while the core worker can still answer them.
    """
    import gc
    import time

    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        gc.collect()
        time.sleep(settle_s)
        gc.collect()
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    """``python -m xema_ray.serving.ray_env COMMAND...``: run COMMAND (``serve run ...``,
    ``ray start ...``) with the app's Ray settings in its environment."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m xema_ray.serving.ray_env COMMAND [ARGS...]")
    os.execvpe(args[0], args, ray_env())


if __name__ == "__main__":
    main()
