"""Several model groups in one replica process: ``SharedReplica`` (``shared_replicas:`` in the app's YAML).

A replica process of a CPU group spends most of its start-up importing torch, diffusers and
transformers (~5 CPU s on the 2-core VM) and far less building its tiny model (0.2-0.8 CPU s):
eight groups in eight processes import them eight times. A ``SharedReplica`` is one Serve
deployment whose replica holds several ``ModelGroup`` objects, each still its own collaborator
(its own dispatcher and queues, its own in-process workers, its own job owner and metrics): the
shared replica only hands each call to the group it names. Serve still routes to its replica,
health-checks it and replaces it; the Router reaches each member through a ``GroupHandle`` that
names it (``GroupHandle.member``), so nothing above the handle changes.

What a shared replica may hold: groups of one replica (no ``replicas:`` above 1, no
``autoscaling:``: Serve scales deployments, and the members would have to scale together) whose
workers run in the replica (``worker_set: inprocess``: no placement group per group).
``ServeConfig.group_deployments`` deals the groups over the shared replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.plan import PlanEntry
from xema_ray.serving.group.model_group import ModelGroup
from xema_ray.serving.group.plan_reload import SharedPlans
from xema_ray.serving.group.settings import GroupSettings, ModelGroupConfig
from xema_ray.serving.messages import GenerateResult, GroupLayoutStats, GroupRequest

if TYPE_CHECKING:
    from xema_ray.lora import AdapterInfo, AdapterSource, PoolStats
    from xema_ray.serving.group.load_metrics import GroupLoad
    from xema_ray.serving.group.preemption import PreemptionReport


class SharedMember(BaseModel):
    """One member of a shared replica: what its own deployment's constructor would have been given."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: ModelGroupConfig
    plans: dict[str, PlanEntry] = Field(description="template shape key -> its plan entry")
    settings: GroupSettings


class SharedReplica:
    """Serve deployment body holding several model groups (module docstring).

    Args:
        members: the groups this replica holds, in this order; built one at a time (model building
            patches process-wide state, so two never build at once), those with a decode pool first.
        make_group: builds one member (``deployments/app.py`` gives the served ``ModelGroup``).
    """

    def __init__(self, members: list[SharedMember],
                 make_group: Callable[[SharedMember], ModelGroup] | None = None) -> None:
        if not members:
            raise ValueError("a shared replica needs at least one group")
        names = [m.config.model for m in members]
        if len(set(names)) != len(names):
            raise ValueError(f"a shared replica holds each model once, got {names}")
        make = make_group or (lambda m: ModelGroup(m.config, m.plans, m.settings))
        # the members with a decode pool first: a pool starts its workers' processes before its
        # group imports the model code, so they import and load beside the rest of this replica's
        # start-up rather than after it; the members are kept in the given order all the same
        built = {m.config.model: make(m) for m in sorted(members, key=lambda m: m.config.decode is None)}
        self.groups: dict[str, ModelGroup] = {name: built[name] for name in names}

    def group(self, model: str) -> ModelGroup:
        """The member serving ``model``; ``KeyError`` naming the members otherwise."""
        try:
            return self.groups[model]
        except KeyError:
            raise KeyError(f"this shared replica holds {', '.join(self.groups)}, not {model!r}") from None

    # ------------------------------------------------------------------ requests and jobs (GroupHandle's calls)
    async def generate(self, model: str, req: GroupRequest) -> GenerateResult:
        return await self.group(model).generate(req)

    async def submit_job(self, model: str, req: GroupRequest) -> bool:
        return await self.group(model).submit_job(req)

    async def cancel_job(self, model: str, job_id: str) -> bool:
        return await self.group(model).cancel_job(job_id)

    async def estimate(self, model: str, template: str) -> float:
        return await self.group(model).estimate(template)

    # ------------------------------------------------------------------ state and reports
    async def status(self, model: str) -> dict[str, Any]:
        return await self.group(model).status()

    async def layout_stats(self, model: str) -> GroupLayoutStats:
        return await self.group(model).layout_stats()

    async def preemption_stats(self, model: str) -> PreemptionReport:
        return await self.group(model).preemption_stats()

    async def replica_summary(self, model: str) -> dict[str, Any]:
        return await self.group(model).replica_summary()

    async def load_stats(self, model: str) -> GroupLoad:
        return await self.group(model).load_stats()

    async def probe_workers(self, model: str, timeout_s: float = 1.0) -> list[str]:
        return await self.group(model).probe_workers(timeout_s)

    async def kill_worker(self, model: str, index: int) -> None:
        await self.group(model).kill_worker(index)

    async def decode_pool_report(self, model: str) -> dict[str, Any] | None:
        return await self.group(model).decode_pool_report()

    async def kill_decode_worker(self, model: str, index: int) -> None:
        await self.group(model).kill_decode_worker(index)

    # ------------------------------------------------------------------ adapters
    async def add_adapter(self, model: str, source: AdapterSource) -> AdapterInfo:
        return await self.group(model).add_adapter(source)

    async def remove_adapter(self, model: str, name: str) -> bool:
        return await self.group(model).remove_adapter(name)

    async def list_adapters(self, model: str) -> list[AdapterInfo]:
        return await self.group(model).list_adapters()

    async def adapter_stats(self, model: str) -> list[PoolStats]:
        return await self.group(model).adapter_stats()

    # ------------------------------------------------------------------ Serve's calls on the replica
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """A new plan table (``SharedPlans``): each member named swaps its own plans (``ModelGroup.reconfigure``)."""
        new = SharedPlans.model_validate(user_config)
        unknown = sorted(set(new.groups) - set(self.groups))
        if unknown:
            raise ValueError(f"this shared replica holds {', '.join(self.groups)}; the new plans name {unknown}")
        for model, plans in new.groups.items():
            await self.groups[model].reconfigure(plans.model_dump(mode="json"))

    def check_health(self) -> None:
        """Serve's health check: fails when any member can no longer serve (its dispatch loop ended),
        so that Serve replaces the replica and with it every member."""
        for g in self.groups.values():
            g.check_health()

    async def drain(self, budget_s: float) -> dict[str, dict[str, int]]:
        """Every member's ``drain`` at once, within the same budget."""
        answers = await asyncio.gather(*(g.drain(budget_s) for g in self.groups.values()))
        return dict(zip(self.groups, answers, strict=True))
