"""Start-up of ``python -m planner plan``: the Ray cluster starts while the planner imports.

Both take seconds on a small machine — importing the planner pulls in torch and diffusers (~5 s
on the 2-core CI machine) and starting a local Ray instance waits on its processes (~6 s, mostly
idle) — and neither needs the other, so the imports run on a thread while the main thread
starts (or joins) the cluster. ``planner.pipeline`` then finds Ray initialised. Nothing here imports
torch: this module is what ``python -m planner`` loads first.
"""

from __future__ import annotations

import importlib
import os
import threading


def init_ray() -> None:
    """Join the cluster inside ``ray job submit`` (``RAY_ADDRESS``), else start a local one with
    this machine's CPUs and GPUs."""
    import ray

    if ray.is_initialized():
        return
    from xema_ray.hash_seed import RUNTIME_ENV, seeded

    # the layouts' streams are those of PYTHONHASHSEED=0 processes (xema_ray.hash_seed): a
    # cluster this (seeded) process starts inherits it; the workers of a joined one get it here
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=RUNTIME_ENV)
        return
    # Ray runs its workers at niceness 15 by default: on a machine shared with other jobs the
    # planning tasks (all of this command's work) then only get what those leave
    os.environ.setdefault("RAY_worker_niceness", "0")
    from xema_ray.ray_start import init_local_ray

    # a raylet that misses Ray's fixed registration window on a loaded machine: started again
    init_local_ray(include_dashboard=False, log_to_driver=False, runtime_env=None if seeded() else RUNTIME_ENV)


def uses_ray(argv: list[str]) -> bool:
    """Whether these arguments plan with Ray tasks (not ``--no-ray``, not a help request)."""
    return bool(argv) and argv[0] == "plan" and not {"--no-ray", "-h", "--help"} & set(argv)


def start(argv: list[str], module: str = "planner.cli") -> None:
    """Import ``module`` (and its ``HEAVY_MODULES``) on a thread while Ray starts, when ``argv``
    plans with Ray; else nothing (the caller's own import then does it all)."""
    if not uses_ray(argv):
        return

    def load() -> None:
        try:
            # the CLI module itself is light (help answers at once); what it imports on first
            # use (torch, diffusers, the model specs) is listed in its HEAVY_MODULES
            cli = importlib.import_module(module)
            for name in getattr(cli, "HEAVY_MODULES", ()):
                importlib.import_module(name)
        except BaseException:  # noqa: BLE001, S110 - the caller imports it again and sees the error there
            pass

    loader = threading.Thread(target=load, name="planner-imports", daemon=True)
    loader.start()
    from planner.cluster_fit import NoRoom

    try:
        init_ray()
        check_room(argv)  # before the imports finish: a cluster with no room is said within seconds
    except NoRoom:
        raise  # said at once by the caller (planner.__main__), without waiting for the imports
    except BaseException:
        loader.join()
        raise
    loader.join()


def check_room(argv: list[str]) -> None:
    """Raise ``NoRoom`` (``planner.__main__`` stops with exit 3, the message on stderr) when the
    cluster has no room for one planning task within ``--wait-for-resources`` seconds
    (``planner.cluster_fit``); the pipeline sizes its tasks again when it submits them."""
    import argparse

    from planner.cluster_fit import WAIT_S, fit_tasks

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--hardware", default="a6000")
    p.add_argument("--measure", default="auto")
    p.add_argument("--wait-for-resources", type=float, default=WAIT_S)
    known, _ = p.parse_known_args(argv[1:])
    fit_tasks(known.hardware, known.measure, wait_s=known.wait_for_resources)
