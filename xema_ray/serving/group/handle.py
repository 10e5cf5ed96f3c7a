"""A model group as the rooms above it call it (the Router, its health probes, the video job API,
the adapter admin endpoints, the operator view): ``GroupHandle``, the group deployment's Serve
handle behind one typed method per ``ModelGroup`` method they call.

Serve's ``DeploymentHandle`` answers ``handle.method.remote(...)`` with a ``DeploymentResponse``
whatever the method; this class states each call's arguments and answer once, so a caller reads
``await group.estimate(key) -> float`` instead of an untyped attribute chain. Tests hand it an
in-process stand-in with the same ``method.remote(...)`` shape.

A group that a ``SharedReplica`` holds (``shared_replicas:``: several groups in one replica process) is
called through the host's handle with the group's model first; ``member`` says so, and every
method below passes it, so a caller never knows where the group lives.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from xema_ray.lora import AdapterInfo, AdapterSource, PoolStats
    from xema_ray.serving.group.load_metrics import GroupLoad
    from xema_ray.serving.group.preemption import PreemptionReport
    from xema_ray.serving.messages import GenerateResult, GroupLayoutStats, GroupRequest

T_co = TypeVar("T_co", covariant=True)


class Reply(Protocol[T_co]):
    """A call in flight (Serve's ``DeploymentResponse``): awaited for its answer, or cancelled."""

    def __await__(self) -> Generator[Any, None, T_co]: ...

    def cancel(self) -> Any: ...


class GroupHandle:
    """One model group's deployment, called (see the module docstring).

    Args:
        handle: the group's Serve deployment handle (or a stand-in answering ``method.remote(...)``).
        member: the group's model where ``handle`` is a ``SharedReplica``'s (it holds several groups);
            None: the handle is the group's own deployment.
        deployment: the Serve deployment that runs the group, whose replicas are the group's (None: not known).
    """

    def __init__(self, handle: DeploymentHandle, member: str | None = None, deployment: str | None = None) -> None:
        self.handle = handle
        self.member = member
        self.deployment = deployment

    def _remote(self, method: str, *args: Any) -> Any:
        """``method.remote(*args)`` on the group (the host's method with the member first)."""
        call = getattr(self.handle, method)
        return call.remote(self.member, *args) if self.member is not None else call.remote(*args)

    # ------------------------------------------------------------------ requests and jobs
    def generate(self, req: GroupRequest) -> Reply[GenerateResult]:
        """Queue one request; the reply (awaited for its result, or cancelled) is Serve's."""
        reply: Reply[GenerateResult] = self._remote("generate", req)
        return reply

    async def submit_job(self, req: GroupRequest) -> bool:
        return bool(await self._remote("submit_job", req))

    async def cancel_job(self, job_id: str) -> bool:
        return bool(await self._remote("cancel_job", job_id))

    async def estimate(self, template: str) -> float:
        return float(await self._remote("estimate", template))

    # ------------------------------------------------------------------ state and reports
    async def status(self) -> dict[str, Any]:
        """The group's ``GroupStatus`` as JSON (its health answer)."""
        out: dict[str, Any] = await self._remote("status")
        return out

    async def layout_stats(self) -> GroupLayoutStats:
        out: GroupLayoutStats = await self._remote("layout_stats")
        return out

    async def preemption_stats(self) -> PreemptionReport:
        out: PreemptionReport = await self._remote("preemption_stats")
        return out

    async def replica_summary(self) -> dict[str, Any]:
        """One replica's ``ReplicaSummary`` as JSON (Serve picks the replica)."""
        out: dict[str, Any] = await self._remote("replica_summary")
        return out

    async def load_stats(self) -> GroupLoad:
        out: GroupLoad = await self._remote("load_stats")
        return out

    # ------------------------------------------------------------------ adapters
    async def add_adapter(self, source: AdapterSource) -> AdapterInfo:
        out: AdapterInfo = await self._remote("add_adapter", source)
        return out

    async def remove_adapter(self, name: str) -> bool:
        return bool(await self._remote("remove_adapter", name))

    async def list_adapters(self) -> list[AdapterInfo]:
        return list(await self._remote("list_adapters"))

    async def adapter_stats(self) -> list[PoolStats]:
        return list(await self._remote("adapter_stats"))
