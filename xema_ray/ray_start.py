"""Starting a local Ray cluster on a small, shared machine: one retry rule for the app, its tests,
the benchmarks and the planner (``python -m planner plan`` starts its own when not inside a job).

Light on purpose (no torch, no Serve): ``planner.boot`` imports it before anything else.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)


#: what ``ray.init`` raises when the new node's raylet did not register with the GCS within Ray's
#: fixed 30 s (``ray._private.node``; not configurable): a loaded 2-core machine, once in a while
RAYLET_TIMEOUT = "timed out during startup"


def init_local_ray(attempts: int = 3, pause_s: float = 5.0, **kwargs: Any) -> None:
    """``ray.init(**kwargs)`` of a new local cluster, started again when its raylet misses Ray's
    fixed registration window (``RAYLET_TIMEOUT``; seen once in CI, at the start of a test module
    right after another module's two-node cluster went away). What the failed start left running
    (its GCS, raylet and agents: children of this process that were not there before) is killed
    first, then the start waits ``pause_s`` × the attempt number. Any other error is raised at once.

    Example::

        init_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    """
    import time

    import psutil
    import ray

    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            ray.init(**kwargs)
            return
        except Exception as e:  # Ray raises a bare Exception for this
            if RAYLET_TIMEOUT not in str(e) or attempt == attempts:
                raise
            log.warning("local Ray did not start (%s); starting it again (attempt %d of %d)", e, attempt + 1, attempts)
        ray.shutdown()
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(left, timeout=10)
        time.sleep(pause_s * attempt)
