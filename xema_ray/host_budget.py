"""Host memory as a budget: what a worker's weights hold on the host, and what a node's workers hold.

A worker keeps the weights its plan homes off the device (offloaded or HSDP DiT blocks, a streamed
or CPU text encoder) in exact-size host buffers (``xema_ray.platforms.host_memory``), page-locked
where they feed a GPU. Workers of one model on one node share those buffers (one segment per
node), so the first worker of a group pays for them and each further worker only for what it holds
alone. Loading adds a transient: what the loader holds at once beyond the buffers (at most one
module's values; memory-mapped checkpoint pages are page cache, which the kernel reclaims).

``NodeHost.of`` adds a node up: each group's shared bytes once, its private bytes per worker, and,
at load (every worker loading at once), each worker's transient on top. The planner prefers plans
whose node fits ``--host-budget``; ``xema verify`` reports the same figures counted from the
worker's own load; serving refuses at start-up a deployment whose node does not fit.

Example:
    >>> w = HostBytes(resident_bytes=10, pinned_bytes=10, shared_bytes=8, shared_pinned_bytes=8, transient_bytes=1)
    >>> node = NodeHost.of([GroupHost(model="flux2", workers=4, worker=w)], budget_bytes=40)
    >>> node.resident_bytes, node.pinned_bytes, node.load_peak_bytes, node.fits
    (16, 16, 20, True)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field


def fmt_bytes(n: int) -> str:
    """GB (10^9) with one decimal from 0.1 GB, else the byte count: '46.7 GB', '271,104 bytes'."""
    return f"{n / 1e9:.1f} GB" if n >= 10**8 else f"{n:,} bytes"


class HostBytes(BaseModel):
    """One worker's host memory for its weights, in bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    resident_bytes: int = Field(default=0, ge=0, description="host buffers the worker maps (shared ones included)")
    pinned_bytes: int = Field(default=0, ge=0, description="of those, page-locked for device copies")
    shared_bytes: int = Field(default=0, ge=0, description="of the resident bytes, in the node's shared segments")
    shared_pinned_bytes: int = Field(default=0, ge=0, description="of the shared bytes, page-locked")
    transient_bytes: int = Field(default=0, ge=0, description="most anonymous host memory held at once while loading, "
                                                               "beyond the buffers")

    @property
    def private_bytes(self) -> int:
        """What each further worker of the node adds (the shared segments are there already)."""
        return self.resident_bytes - self.shared_bytes

    def max(self, other: HostBytes) -> HostBytes:
        """Field by field the larger (a worker that may run either of two plans)."""
        return HostBytes(**{k: max(getattr(self, k), getattr(other, k)) for k in HostBytes.model_fields})


def host_basis(config_hashes: Iterable[str], shared_residency: bool, share: bool) -> str:
    """What one worker's host figure of a group is counted from, hashed: its plans' configs
    (``ExecutionConfig.config_hash``, in any order), whether its residency is the union of theirs
    (``shared``), whether its workers share the node's segments. The figure is a function of these
    alone (``xema_ray.runtime.host_bytes.group_worker_host_bytes``), so equal bases count equal bytes."""
    payload = ",".join(sorted(set(config_hashes))) + f"|shared={shared_residency}|share={share}"
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class GroupHost(BaseModel):
    """One model group's workers on the node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    workers: int = Field(ge=1)
    worker: HostBytes
    basis: str | None = Field(
        default=None, description="what ``worker`` was counted from, hashed (``host_basis``): start-up takes a "
                                  "table's figure where its own group hashes the same; None: not recorded")

    @property
    def first_worker_bytes(self) -> int:
        """The first worker: its private buffers and the shared segments it fills."""
        return self.worker.resident_bytes

    @property
    def further_worker_bytes(self) -> int:
        """Each further worker: its private buffers only (it maps the segments filled)."""
        return self.worker.private_bytes

    @property
    def resident_bytes(self) -> int:
        return self.first_worker_bytes + (self.workers - 1) * self.further_worker_bytes

    @property
    def pinned_bytes(self) -> int:
        w = self.worker
        return w.pinned_bytes + (self.workers - 1) * (w.pinned_bytes - w.shared_pinned_bytes)


class NodeHost(BaseModel):
    """A node's host memory for the weights of every group on it (one replica of each)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    groups: list[GroupHost] = Field(default_factory=list)
    resident_bytes: int = Field(ge=0, description="host bytes the node's workers hold once loaded")
    pinned_bytes: int = Field(ge=0, description="of those, page-locked")
    load_peak_bytes: int = Field(ge=0, description="resident + every worker's load transient (all loading at once)")
    budget_bytes: int | None = Field(default=None, ge=1, description="the node's host memory (None: not stated)")

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.load_peak_bytes <= self.budget_bytes

    @property
    def shared_bytes(self) -> int:
        """The node's shared weight segments (one copy per group): what its tmpfs must hold."""
        return sum(g.worker.shared_bytes for g in self.groups)

    @classmethod
    def of(cls, groups: list[GroupHost], budget_bytes: int | None = None) -> NodeHost:
        resident = sum(g.resident_bytes for g in groups)
        return cls(groups=groups, resident_bytes=resident, pinned_bytes=sum(g.pinned_bytes for g in groups),
                   load_peak_bytes=resident + sum(g.workers * g.worker.transient_bytes for g in groups),
                   budget_bytes=budget_bytes)

    def describe(self) -> str:
        """E.g. 'flux2: 4 workers x 0 bytes private + 89.9 GB shared; ... = 125.3 GB resident (131.2 GB while loading)'."""
        parts = [f"{g.model}: {g.workers} workers x {fmt_bytes(g.further_worker_bytes)} private + "
                 f"{fmt_bytes(g.worker.shared_bytes)} shared" for g in self.groups]
        return (f"{'; '.join(parts)} = {fmt_bytes(self.resident_bytes)} resident "
                f"({fmt_bytes(self.load_peak_bytes)} while loading)")
