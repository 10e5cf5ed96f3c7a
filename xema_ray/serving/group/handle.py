"""A model group as the rooms above it call it (the Router, its health probes, the video job API,
the adapter admin endpoints, the operator view): ``GroupHandle``, the group deployment's Serve
handle behind one typed method per ``ModelGroup`` method they call.

Serve's ``DeploymentHandle`` answers ``handle.method.remote(...)`` with a ``DeploymentResponse``
whatever the method; this class states each call's arguments and answer once, so a caller reads
``await group.estimate(key) -> float`` instead of an untyped attribute chain. Tests hand it an
in-process stand-in with the same ``method.remote(...)`` shape.
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
    """

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    # ------------------------------------------------------------------ requests and jobs
    def generate(self, req: GroupRequest) -> Reply[GenerateResult]:
        """Queue one request; the reply (awaited for its result, or cancelled) is Serve's."""
        reply: Reply[GenerateResult] = self.handle.generate.remote(req)
        return reply

    async def submit_job(self, req: GroupRequest) -> bool:
        return bool(await self.handle.submit_job.remote(req))

    async def cancel_job(self, job_id: str) -> bool:
        return bool(await self.handle.cancel_job.remote(job_id))

    async def estimate(self, template: str) -> float:
        return float(await self.handle.estimate.remote(template))

    # ------------------------------------------------------------------ state and reports
    async def status(self) -> dict[str, Any]:
        """The group's ``GroupStatus`` as JSON (its health answer)."""
        out: dict[str, Any] = await self.handle.status.remote()
        return out

    async def layout_stats(self) -> GroupLayoutStats:
        out: GroupLayoutStats = await self.handle.layout_stats.remote()
        return out

    async def preemption_stats(self) -> PreemptionReport:
        out: PreemptionReport = await self.handle.preemption_stats.remote()
        return out

    async def replica_summary(self) -> dict[str, Any]:
        """One replica's ``ReplicaSummary`` as JSON (Serve picks the replica)."""
        out: dict[str, Any] = await self.handle.replica_summary.remote()
        return out

    async def load_stats(self) -> GroupLoad:
        out: GroupLoad = await self.handle.load_stats.remote()
        return out

    # ------------------------------------------------------------------ adapters
    async def add_adapter(self, source: AdapterSource) -> AdapterInfo:
        out: AdapterInfo = await self.handle.add_adapter.remote(source)
        return out

    async def remove_adapter(self, name: str) -> bool:
        return bool(await self.handle.remove_adapter.remote(name))

    async def list_adapters(self) -> list[AdapterInfo]:
        return list(await self.handle.list_adapters.remote())

    async def adapter_stats(self) -> list[PoolStats]:
        return list(await self.handle.adapter_stats.remote())
