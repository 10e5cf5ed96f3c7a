"""A new plan table for a running app, through Ray Serve's in-place config update.

Serve keeps each deployment's ``user_config`` as part of its target state: a config that changes
only deployments' ``user_config`` keeps the application's code version (import path, runtime env,
args: ``serve/_private/deploy_utils.get_app_code_version``), so Serve restarts nothing and calls
``reconfigure(user_config)`` on every running replica of those deployments, and on every replica
it starts later (a replaced or an autoscaled one), before it takes requests. ``xema serve
--reload-plans TABLE`` (``xema_ray/cli_reload.py``) sends each ModelGroup its ``GroupPlans`` and
the Router the table (``RouterPlans``) that way.

A group whose plans are unchanged does nothing. A group whose plans changed swaps them in place
(``ModelGroup.reconfigure`` -> ``_swap_plans``): it keeps admitting and queueing requests, starts
no new batch, lets its running batches finish, replaces its worker set with one loaded for the new
plans (its placement group's bundles are freed first and reused), gives its dispatcher the new
plans with every queued request kept, and dispatches again. Nothing accepted is lost; requests
that arrive during the swap wait in the queue (its ``max_queue`` still applies). A new set that
cannot load (a layout file missing, say) is replaced by one loaded with the previous plans again:
the group keeps serving those and reports why (``plans_reload_error`` in ``/healthz``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.plan import AdmissionPolicy, PlanEntry, PlanTable

logger = logging.getLogger("xema_ray.serving")

#: how a group's Serve deployment is named (``deployments/app.py``)
GROUP_DEPLOYMENT = "ModelGroup:{model}"
ROUTER_DEPLOYMENT = "Router"


def plans_hash(plans: dict[str, PlanEntry]) -> str:
    """A short content hash of a group's plans (what ``/healthz`` reports as ``plans_hash``).

    Example:
        >>> len(plans_hash({}))
        12
    """
    body = json.dumps({k: plans[k].model_dump(mode="json") for k in sorted(plans)}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:12]


class GroupPlans(BaseModel):
    """One ModelGroup's part of a plan table: its ``user_config`` (JSON, kept by Serve's controller)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plans: dict[str, PlanEntry] = Field(description="template shape key -> its plan entry, every served template")
    layouts_dir: str | None = Field(default=None, description="the table's layouts folder (plans with a layout_ref "
                                                              "arm theirs); None: none")
    budget_bytes: int | None = Field(default=None, description="the table's per-GPU budget (the arena's size)")
    admission: AdmissionPolicy | None = Field(default=None, description="the table's admission policy for the group")
    source: str = Field(default="", description="where the table came from (a path), for the log")

    @property
    def hash(self) -> str:
        return plans_hash(self.plans)


class SharedPlans(BaseModel):
    """A ``SharedReplica``'s ``user_config`` (``shared_replicas:``): each of its groups' ``GroupPlans``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    groups: dict[str, GroupPlans] = Field(description="model -> its group's part of the new plan table")


class RouterPlans(BaseModel):
    """The Router's ``user_config``: the table it reports (``/v1/templates``, ``/v1/plans``) and
    predicts job progress with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    table: PlanTable


def group_plans(table: PlanTable, model: str, shape_keys: list[str], source: str | Path | None) -> GroupPlans:
    """``model``'s ``GroupPlans`` in ``table``, for the served ``shape_keys``. Raises ValueError
    naming the templates the table has no plan for."""
    from xema_ray.allocator.artifact import layouts_dir

    missing = [k for k in shape_keys if k not in table.entries]
    if missing:
        raise ValueError(f"{model}: the plan table has no plan for {', '.join(missing)}")
    return GroupPlans(plans={k: table.entries[k] for k in shape_keys},
                      layouts_dir=str(layouts_dir(Path(source).resolve())) if source is not None else None,
                      budget_bytes=table.budget_bytes, admission=table.admission.get(model),
                      source=str(source or ""))


class PlanReload:
    """A group's plan swaps: the latest ``GroupPlans`` asked for, whether new batches are held,
    and the one task that swaps (a second table that arrives during a swap is swapped in after it)."""

    def __init__(self) -> None:
        self.target: GroupPlans | None = None  # asked for, not yet being swapped in
        self.holding = False  # new batches held while the workers are replaced
        self.swaps = 0  # plan tables swapped in since the replica started
        self.failed: str | None = None  # the last swap's failure, if it failed
        self.batch_done = asyncio.Event()  # set by every batch that ends (the swap waits for them)
        self._task: asyncio.Task[None] | None = None
        self._swapping: GroupPlans | None = None

    @property
    def pending(self) -> bool:
        return self.target is not None or (self._task is not None and not self._task.done())

    def target_hash(self, current: str) -> str:
        """The plans the group is on its way to (the newest asked for), else ``current``."""
        latest = self.target or self._swapping
        return latest.hash if latest is not None else current

    def start(self, loop: asyncio.AbstractEventLoop, swap: Callable[[GroupPlans], Awaitable[None]]) -> None:
        """Swap ``target`` in with ``swap`` on ``loop`` (unless a swap task runs: it takes it next)."""
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(swap))

    async def _run(self, swap: Callable[[GroupPlans], Awaitable[None]]) -> None:
        while self.target is not None:
            self._swapping, self.target = self.target, None
            try:
                await swap(self._swapping)
                self.failed = None
            except Exception as e:  # noqa: BLE001 - logged and reported in /healthz; the group keeps serving
                self.failed = f"plans {self._swapping.hash}: {type(e).__name__}: {e}"[:2000]
                logger.exception("plan swap to %s failed", self._swapping.hash)
            finally:
                self._swapping = None

    def swapped(self, new: GroupPlans) -> None:
        self.swaps += 1
        logger.warning("serving new plans %s%s", new.hash, f" from {new.source}" if new.source else "")
