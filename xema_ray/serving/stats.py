"""Request counters kept outside the Router (a Serve deployment of their own), so that
``/v1/stats`` does not restart from 0 when a Router replica is replaced, and ``/v1/stats``'s answer
(``StatsResponse``). Below the API, which answers it, and the console, which builds the operator
view from it; above the groups, whose reports it gathers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, Field

from xema_ray.lora_pool import PoolStats
from xema_ray.serving.group.preemption import PreemptionReport
from xema_ray.serving.messages import GroupLayoutStats
from xema_ray.serving.replica_bind import bind_replica_servers_to_node


#: the Stats counter of requests answered at a quality tier: ``quality.<tier>``
QUALITY_COUNT = "quality."

#: the Stats deployment's counters of requests held for a group waking from zero: ``wake|<model>|<what>``
#: (``api/wake.py``; ``wait_ms`` in milliseconds)
WAKE_COUNTS = ("held", "woke", "timed_out", "queue_full", "wait_ms")


class WakeStats(BaseModel):
    """One group's requests held while it woke, in ``/v1/stats`` (every Router replica's)."""

    held: int = Field(default=0, ge=0, description="requests that arrived while the group was scaled to zero or waking")
    woke: int = Field(default=0, ge=0, description="of those, forwarded once the group served")
    timed_out: int = Field(default=0, ge=0, description="of those, answered 503 `waking` past the wake timeout")
    queue_full: int = Field(default=0, ge=0, description="refused 503 `queue_full`: max_queue requests already held")
    wait_s: float = Field(default=0.0, ge=0, description="seconds held, all requests together")


def wake_stats(counts: dict[str, int], models: list[str]) -> dict[str, WakeStats]:
    """The ``waking`` part of ``/v1/stats`` from the Stats deployment's counters."""
    out = {}
    for m in models:
        got = {k: counts.get(f"wake|{m}|{k}", 0) for k in WAKE_COUNTS}
        out[m] = WakeStats(held=got["held"], woke=got["woke"], timed_out=got["timed_out"],
                           queue_full=got["queue_full"], wait_s=got["wait_ms"] / 1000)
    return out


class StatsResponse(BaseModel):
    """``GET /v1/stats``."""

    received: int = Field(ge=0, description="generation requests received by every Router replica since the app started")
    quality: dict[str, int] = Field(
        default_factory=dict, description="generation requests answered, by the quality tier they were served at "
                                          "(lossless, fast, ...; the X-Xema-Quality header's values)")
    static_layouts: dict[str, GroupLayoutStats] = Field(
        default_factory=dict, description="per model group: the static allocator's status and counters per template")
    preemption: dict[str, PreemptionReport] = Field(
        default_factory=dict, description="per model group (that answered within the probe timeout): step-level "
                                          "preemption per template, and the dispatcher's latest decisions")
    waking: dict[str, WakeStats] = Field(
        default_factory=dict, description="per model group that scales to zero (autoscaling.min_replicas 0): the "
                                          "requests held while it woke, and how each ended")
    adapters: dict[str, list[PoolStats]] = Field(
        default_factory=dict, description="per model group serving LoRA adapters: each worker's pool (resident "
                                          "adapters, copies, evictions, seconds batches waited for copies)")


class Stats:
    """Serve deployment body; wrapped by ``serve.deployment`` in ``deployments/app.py``."""

    def __init__(self) -> None:
        bind_replica_servers_to_node()  # before Serve starts this replica's gRPC server (replica_bind)
        self.counts: dict[str, int] = {}

    async def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    async def get(self) -> dict[str, int]:
        return dict(self.counts)


class BufferedCounts:
    """Counts added in one call per ``flush_s`` instead of one call per event: a Router replica
    counts every generation request in Stats, and a Serve call per request was a second hop on
    every request's path. ``flush`` sends what is pending now (before a reading, so that the
    replica's own requests are in it). A failed send is dropped: a counter never fails, or holds,
    a request.

    Example:
        >>> sent = []
        >>> async def send(name, n): sent.append((name, n))
        >>> async def main():
        ...     c = BufferedCounts(send, flush_s=0.01)
        ...     c.add("received"); c.add("received")
        ...     await asyncio.sleep(0.05)
        >>> asyncio.run(main()); sent
        [('received', 2)]
    """

    def __init__(self, send: Callable[[str, int], Awaitable[None]], flush_s: float, timeout_s: float = 10.0) -> None:
        self.send = send
        self.flush_s = flush_s
        self.timeout_s = timeout_s
        self._pending: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    def add(self, name: str, n: int = 1) -> None:
        """Count ``n`` (needs the running event loop: the send is scheduled on it)."""
        self._pending[name] = self._pending.get(name, 0) + n
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.flush(self.flush_s))

    async def flush(self, delay_s: float = 0.0) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        pending, self._pending = self._pending, {}
        for name, n in pending.items():
            try:
                await asyncio.wait_for(self.send(name, n), timeout=self.timeout_s)
            except Exception:
                pass
