"""What each planning task asks the Ray cluster for: sized to what the cluster can spare.

A planning run often joins a cluster that serves already (``ray job submit`` against the cluster
``xema serve`` started): the app's placement groups hold most of its CPUs and every GPU. A task
that asked for a whole CPU, or for a GPU whenever the cluster has one, would then wait for as
long as anyone lets it, and Ray says only "N+ pending tasks". So the tasks ask for:

* CPU: what is free, at most one per task and at least ``MIN_TASK_CPU`` (Ray's CPUs are logical:
  a fraction lets the task run beside the app, one at a time, instead of not at all);
* GPU: one per task only where measuring needs it (``--hardware`` names a GPU, not ``cpu``, and
  ``--measure`` is not ``never``) and one is free; where none is free the tasks plan on the cost
  model and say so, unless ``--measure always`` asked for the GPU.

A run that cannot get that much waits ``wait_s`` for it, then stops with one message: what it
asked for, what is free, and who holds the rest (placement groups by name, actors by class).

Example:
    >>> shape = task_shape({"CPU": 2.0}, {"CPU": 0.5}, hardware="cpu", measure="auto")
    >>> (shape.num_cpus, shape.num_gpus)
    (0.5, 0.0)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field

#: the least CPU a planning task runs with: below it the run waits (or stops) instead
MIN_TASK_CPU = 0.1
#: how long a run waits for room before it stops and says why (``--wait-for-resources``)
WAIT_S = 10.0


class TaskShape(BaseModel):
    """What every planning (and layout) task of one run asks for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_cpus: float = Field(gt=0, le=1, description="logical CPUs per task")
    num_gpus: float = Field(ge=0, le=1, description="GPUs per task: 1 to measure on a GPU, else 0")
    note: str = Field(description="one line for the log: what the tasks ask for and why")

    def request(self) -> dict[str, float]:
        return {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}


class NoRoom(RuntimeError):
    """The cluster cannot give a planning task what it needs; the message says what and who holds it."""


def _floor(x: float, step: float = 0.01) -> float:
    return math.floor(x / step + 1e-9) * step


def wants_gpu(hardware: str, measure: str) -> bool:
    """Whether the tasks measure on a GPU when they can (a GPU profile, measuring not off)."""
    return hardware != "cpu" and measure != "never"


def task_shape(total: Mapping[str, float], free: Mapping[str, float], hardware: str, measure: str) -> TaskShape | None:
    """The task shape that fits ``free`` now, or None when none does (too little CPU, or no free
    GPU for ``--measure always``).

    Args:
        total: the cluster's resources (``ray.cluster_resources()``).
        free: what is free now (``ray.available_resources()``).
        hardware, measure: the run's ``--hardware`` and ``--measure``.
    """
    cpu = round(min(1.0, _floor(free.get("CPU", 0.0))), 2)
    if cpu < MIN_TASK_CPU:
        return None
    gpus_total, gpus_free = total.get("GPU", 0.0), free.get("GPU", 0.0)
    asked = measure == "always" and hardware != "cpu"
    if wants_gpu(hardware, measure) and gpus_total >= 1:
        if gpus_free >= 1:
            return TaskShape(num_cpus=cpu, num_gpus=1.0,
                             note=f"{cpu:g} CPU + 1 GPU per task ({free.get('CPU', 0):g} of {total.get('CPU', 0):g} "
                                  f"CPUs, {gpus_free:g} of {gpus_total:g} GPUs free)")
        if asked:
            return None
        return TaskShape(num_cpus=cpu, num_gpus=0.0,
                         note=f"{cpu:g} CPU per task, no GPU: all {gpus_total:g} of the cluster's GPUs are held, so "
                              f"candidates are estimated by the cost model (--measure always waits for one)")
    return TaskShape(num_cpus=cpu, num_gpus=0.0,
                     note=f"{cpu:g} CPU per task ({free.get('CPU', 0):g} of {total.get('CPU', 0):g} CPUs free)")


def _amounts(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU") and v}
    return ", ".join(f"{v:g} {k}" for k, v in sorted(shown.items())) or "nothing"


def holders() -> list[str]:
    """Who holds the cluster's CPUs and GPUs: placement groups (Serve names its replicas' groups
    ``SERVE_REPLICA::app#deployment#id``) and actors outside them, largest first."""
    import ray

    rows: list[tuple[float, str]] = []
    for pg in ray.util.placement_group_table().values():
        if pg.get("state") not in ("CREATED", "RESCHEDULING", "PREPARED"):
            continue
        held: dict[str, float] = {}
        for bundle in pg.get("bundles", {}).values():
            for k, v in bundle.items():
                held[k] = held.get(k, 0.0) + float(v)
        if held.get("CPU", 0) or held.get("GPU", 0):
            name = pg.get("name") or pg["placement_group_id"][:12]
            rows.append((held.get("GPU", 0) * 1000 + held.get("CPU", 0), f"placement group {name} ({_amounts(held)})"))
    try:  # actors outside placement groups (the state API: the dashboard of the cluster)
        from ray.util.state import list_actors

        for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True, raise_on_missing_output=False):
            req = dict(getattr(a, "required_resources", None) or {})
            if (req.get("CPU") or req.get("GPU")) and not getattr(a, "placement_group_id", None):
                rows.append((req.get("GPU", 0) * 1000 + req.get("CPU", 0), f"actor {a.class_name} ({_amounts(req)})"))
    except Exception:  # noqa: BLE001 - no dashboard: the placement groups are what a serving app holds
        pass
    return [text for _, text in sorted(rows, key=lambda r: -r[0])]


def shortfall(total: Mapping[str, float], free: Mapping[str, float], hardware: str, measure: str, waited_s: float,
              held_by: list[str]) -> str:
    """The message a run that found no room stops with."""
    need = f"at least {MIN_TASK_CPU:g} CPU"
    if measure == "always" and hardware != "cpu":
        need += " and 1 GPU (--measure always)"
    who = "; ".join(held_by[:8]) + (f"; and {len(held_by) - 8} more" if len(held_by) > 8 else "") if held_by else \
        "no placement group or actor (other tasks?)"
    return (f"planning tasks need {need} each; after {waited_s:.0f} s the cluster has "
            f"{free.get('CPU', 0):g} of {total.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} of "
            f"{total.get('GPU', 0):g} GPUs free. Held by: {who}. Free some (scale the app down or `serve shutdown`), "
            "add a node, or plan outside the cluster (`python -m planner plan ... --no-ray`).")


def fit_tasks(hardware: str, measure: str, wait_s: float = WAIT_S, poll_s: float = 0.5,
              now: Callable[[], float] = time.monotonic) -> TaskShape:
    """The shape the planning tasks ask for, waiting up to ``wait_s`` for room. Raises ``NoRoom``."""
    import ray

    start = now()
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        shape = task_shape(total, free, hardware, measure)
        if shape is not None:
            return shape
        waited = now() - start
        if waited >= wait_s:
            raise NoRoom(shortfall(total, free, hardware, measure, waited, holders()))
        time.sleep(poll_s)
