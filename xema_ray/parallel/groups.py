"""Process groups for sequence parallelism, created once per worker set.

A *worker set* is ``world_size`` worker processes (one per GPU, or per CPU slot in tests) that
join one torch.distributed job at start-up. Every SP layout a plan table may ask for,
``(ulysses, ring)`` with ``ulysses * ring`` dividing the world size, gets its groups here, once:
each block of ``sp`` consecutive ranks is one SP group; inside it, consecutive runs of
``ulysses`` ranks form the Ulysses (all-to-all) groups and ranks ``ulysses`` apart form the ring
groups, as in yunchang/xDiT's USP. A batch then *selects* its group (``ProcessGroups.select``):
changing the SP degree between batches is a dictionary lookup, never a reload or a new group.

``torch.distributed.new_group`` is collective over the whole job (every rank must call it for
every group, in the same order), which is why all groups are made eagerly in ``init``, and why
every group carries a timeout: a failed collective otherwise hangs the next one forever.
"""

from __future__ import annotations

import datetime
import socket
import urllib.parse
from dataclasses import dataclass, field

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator

from xema_ray.platforms import current_platform


class SPLayout(BaseModel):
    """One sequence-parallel shape: Ulysses degree x ring degree."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ulysses: int = Field(default=1, ge=1, description="all-to-all (head split) degree")
    ring: int = Field(default=1, ge=1, description="ring-attention degree")

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring


class ParallelConfig(BaseModel):
    """How one worker joins its worker set. Crosses the Ray actor boundary, hence pydantic.

    Example:
        >>> cfg = ParallelConfig(rank=0, world_size=2, init_method="tcp://127.0.0.1:29500")
        >>> [(l.ulysses, l.ring) for l in cfg.resolved_layouts()]
        [(1, 2), (2, 1)]
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0, description="this worker's rank in the worker set")
    world_size: int = Field(ge=1, description="workers in the set")
    init_method: str | None = Field(
        default=None, description="torch.distributed rendezvous URL (tcp://host:port or file://); None when world_size is 1"
    )
    layouts: tuple[SPLayout, ...] | None = Field(
        default=None, description="SP layouts to create groups for; None = every (ulysses, ring) whose product divides world_size"
    )
    timeout_s: float = Field(default=120.0, gt=0, description="timeout of the job and of every group")
    backend: str | None = Field(default=None, description="torch.distributed backend; None = the platform's (nccl / gloo)")

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        if self.world_size > 1 and not self.init_method:
            raise ValueError(f"world_size {self.world_size} > 1 needs an init_method (e.g. tcp://127.0.0.1:PORT)")
        for layout in self.layouts or ():
            if self.world_size % layout.sp:
                raise ValueError(
                    f"SP layout ulysses={layout.ulysses} x ring={layout.ring} = {layout.sp} does not divide "
                    f"world_size {self.world_size}"
                )
        return self

    def resolved_layouts(self) -> list[SPLayout]:
        """Layouts with SP > 1 that get groups (SP = 1 needs none), deduplicated and sorted."""
        if self.layouts is not None:
            chosen = {lay for lay in self.layouts if lay.sp > 1}
        else:
            chosen = {
                SPLayout(ulysses=u, ring=sp // u)
                for sp in range(2, self.world_size + 1)
                if self.world_size % sp == 0
                for u in range(1, sp + 1)
                if sp % u == 0
            }
        return sorted(chosen, key=lambda lay: (lay.sp, lay.ulysses))


@dataclass(frozen=True)
class SPGroup:
    """The SP group a batch runs on, as seen from one of its ranks.

    Attributes:
        layout: its (ulysses, ring) shape.
        ranks: global ranks of the whole group, in sequence-shard order.
        rank: this worker's index in ``ranks`` (which sequence shard it holds).
        group: process group over ``ranks`` (sequence split/gather).
        ulysses_group: this rank's all-to-all group (a single-rank group when ulysses == 1,
            so GPU backends that always expect both groups, like yunchang's, get one).
        ring_group: this rank's ring group (single-rank when ring == 1).
    """

    layout: SPLayout
    ranks: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup
    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.layout.ulysses

    @property
    def ring_rank(self) -> int:
        return self.rank // self.layout.ulysses


@dataclass
class ProcessGroups:
    """Every SP group of a worker set, created once by ``init_process_groups``."""

    config: ParallelConfig
    _by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    _selected: dict[tuple[int, int], SPGroup] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def select(self, ulysses: int, ring: int) -> SPGroup | None:
        """The SP group this rank belongs to under layout (ulysses, ring); None for SP = 1.

        Raises:
            ValueError: the layout was not created at start-up (listing those that were).
        """
        if ulysses * ring == 1:
            return None
        try:
            return self._selected[(ulysses, ring)]
        except KeyError:
            known = sorted(self._selected)
            raise ValueError(
                f"SP layout ulysses={ulysses} x ring={ring} has no process groups on this worker set "
                f"(world_size {self.world_size}); created at start-up: {known}"
            ) from None

    def shutdown(self) -> None:
        """Destroy the job's groups (the default group last, as torch requires)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._by_ranks.clear()
        self._selected.clear()


def _rendezvous_store(config: ParallelConfig, timeout: datetime.timedelta) -> dist.TCPStore | None:
    """The job's rendezvous store for a ``tcp://HOST:PORT`` init method; None for any other.

    torch's own ``tcp://`` rendezvous makes rank 0's store listen on every interface (``[::]``)
    whatever HOST says. Here rank 0 binds the socket to HOST itself (127.0.0.1 for a one-node
    worker set) and hands it to the store, so the rendezvous port is reachable only where HOST is.
    """
    url = urllib.parse.urlparse(config.init_method or "")
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        return None
    fd = None
    if config.rank == 0:
        family = socket.AF_INET6 if ":" in url.hostname else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((url.hostname, url.port))
        sock.listen(max(128, config.world_size))
        fd = sock.detach()  # the store's server owns the descriptor from here on
    return dist.TCPStore(url.hostname, url.port, config.world_size, config.rank == 0, timeout,
                         master_listen_fd=fd, use_libuv=True)


def init_process_groups(config: ParallelConfig) -> ProcessGroups:
    """Join the worker set and create the groups of every SP layout (collective: all ranks call it).

    Args:
        config: this worker's rank, the set's size, the rendezvous URL and the layouts.

    Example (two processes, each with its own rank)::

        groups = init_process_groups(ParallelConfig(rank=r, world_size=2, init_method="tcp://127.0.0.1:29511"))
        sp = groups.select(ulysses=2, ring=1)
    """
    groups = ProcessGroups(config=config)
    if config.world_size == 1:
        return groups
    timeout = datetime.timedelta(seconds=config.timeout_s)
    backend = config.backend or current_platform().dist_backend
    if not dist.is_initialized() and backend == "fake":
        # shape-only verification (``xema verify``): one process stands for one rank of the set;
        # torch's fake backend completes every collective without moving data (meta tensors)
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group(backend="fake", store=FakeStore(), rank=config.rank, world_size=config.world_size)
    elif not dist.is_initialized():
        store = _rendezvous_store(config, timeout)
        dist.init_process_group(
            backend=backend,
            init_method=None if store is not None else config.init_method,
            store=store,
            rank=config.rank,
            world_size=config.world_size,
            timeout=timeout,
        )
    elif dist.get_world_size() != config.world_size or dist.get_rank() != config.rank:
        raise ValueError(
            f"torch.distributed is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
            f"but this worker was configured as rank {config.rank}/{config.world_size}"
        )

    def group_of(ranks: tuple[int, ...]) -> dist.ProcessGroup:
        # identical rank sets (e.g. the SP group and the Ulysses group of u=sp) share one group;
        # new_group is still called in the same order on every rank because the dict is filled
        # in the same deterministic order everywhere
        if ranks not in groups._by_ranks:
            groups._by_ranks[ranks] = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        return groups._by_ranks[ranks]

    for layout in config.resolved_layouts():
        u, r, sp = layout.ulysses, layout.ring, layout.sp
        for start in range(0, config.world_size, sp):
            block = tuple(range(start, start + sp))
            sp_pg = group_of(block)
            ulysses_pgs = [group_of(block[j * u : (j + 1) * u]) for j in range(r)]
            ring_pgs = [group_of(block[i::u]) for i in range(u)]
            if config.rank in block:
                local = block.index(config.rank)
                groups._selected[(u, r)] = SPGroup(
                    layout=layout,
                    ranks=block,
                    rank=local,
                    group=sp_pg,
                    ulysses_group=ulysses_pgs[local // u],
                    ring_group=ring_pgs[local % u],
                )
    return groups
