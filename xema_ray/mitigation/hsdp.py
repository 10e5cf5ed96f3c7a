"""Selective HSDP (paper §5.1): only chosen DiT blocks have their weights sharded.

Each chosen block's parameters (per dtype) are flattened into one buffer, padded to a
multiple of the group size, and each rank keeps only its 1/W slice. Before the block runs the
full buffer is all-gathered and the parameters become views into it; after the block it is
freed. As with offload, the next sharded block's gather is issued (asynchronously) when the
current one starts, so communication overlaps ~N/K blocks of compute. Works over any
``torch.distributed`` process group (gloo on CPU, NCCL on GPU). For shape-only analysis on
the meta device, ``ShapeOnlyGroup`` stands in for the group: same buffers, same order, no
communication.

Example (one process, a shape-only group of 2):
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> spec = get_model_spec("tiny-flux2")
    >>> pipe = spec.build_pipeline(BuildOptions(device="meta"))
    >>> h = apply_hsdp(pipe.transformer, spec.dit_blocks(pipe.transformer), HSDPConfig(blocks=(1,)),
    ...                ShapeOnlyGroup(world_size=2, rank=0))
    >>> h.remove()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.mitigation.hooks import HOOK_NAMES, MitigationHandle, check_blocks, hook_module
from xema_ray.placement import compute_device, placeholder, placeholder_like
from xema_ray.placement import WEIGHT_HOME_ATTR, WeightHome

if TYPE_CHECKING:
    from xema_ray.models import ModelSpec


class HSDPConfig(BaseModel):
    """Which DiT blocks are sharded across the group."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: tuple[int, ...] = Field(description="indices into ModelSpec.dit_blocks")
    prefetch: bool = Field(default=True, description="issue the next sharded block's all-gather when this one starts")


class Collective(Protocol):
    world_size: int
    rank: int

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Any:
        """Start gathering every rank's ``shard`` into ``out``; return something to ``wait()`` on."""


@dataclass
class ProcessGroupCollective:
    """All-gather over a ``torch.distributed`` group (gloo or NCCL)."""

    group: Any = None  # None: the default group

    def __post_init__(self) -> None:
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Any:
        return dist.all_gather_into_tensor(out, shard, group=self.group, async_op=True)


@dataclass
class ShapeOnlyGroup:
    """For meta-device analysis: allocates what a gather allocates, moves nothing."""

    world_size: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 2 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShapeOnlyGroup needs world_size >= 2 and 0 <= rank < world_size, got {self.world_size}, {self.rank}")

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        return None


class _ShardedBlock:
    """One block's parameters, grouped by dtype into flat buffers; this rank keeps its slice.

    A block the worker homed on the host at load (``WEIGHT_HOME_ATTR``) is cut from its host
    copy: only this rank's shard reaches the device, and removing the primitive leaves the
    block on the host. A block on the device is sharded in place and re-gathered by ``restore``."""

    def __init__(self, block: nn.Module, comm: Collective, device: torch.device) -> None:
        self.comm = comm
        self.homed_on_host = getattr(block, WEIGHT_HOME_ATTR, None) == WeightHome.HOST.value
        self.groups: list[tuple[list[torch.Tensor], int, torch.Tensor]] = []  # params, padded numel, shard
        self.host_data: list[torch.Tensor] = []
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in block.parameters():
            by_dtype.setdefault(p.dtype, []).append(p)
        w = comm.world_size
        for params in by_dtype.values():
            numel = sum(p.numel() for p in params)
            padded = -(-numel // w) * w
            n = padded // w
            start, stop = comm.rank * n, min((comm.rank + 1) * n, numel)
            shard = torch.zeros(n, dtype=params[0].dtype, device=device)
            if device.type != "meta" or not self.homed_on_host:
                # a meta host copy has no values to cut (and concatenating it would be counted
                # as a device allocation that a GPU never makes)
                flat = torch.cat([p.data.reshape(-1) for p in params])
                if stop > start:
                    shard[: stop - start].copy_(flat[start:stop])
                del flat
            self.groups.append((params, padded, shard))
            for p in params:
                if self.homed_on_host:
                    self.host_data.append(p.data)
                p.data = placeholder(p.shape, p.dtype, device)
        self.bytes_full = sum(padded * s.element_size() for _, padded, s in self.groups)
        self.pending: list[Any] = []
        self.gathered = False

    def gather(self) -> None:
        if self.gathered:
            return
        for params, padded, shard in self.groups:
            full = torch.empty(padded, dtype=shard.dtype, device=shard.device)
            self.pending.append(self.comm.all_gather(full, shard))
            offset = 0
            for p in params:
                p.data = full[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
        self.gathered = True

    def wait(self) -> None:
        self.gather()
        for work in self.pending:
            if work is not None:
                work.wait()  # the block must not read weights before every rank's slice arrived
        self.pending.clear()

    def release(self) -> None:
        for params, _, _ in self.groups:
            for p in params:
                p.data = placeholder_like(p.data)
        self.gathered = False

    def restore(self) -> None:
        """Undo: a host-homed block points at its host copy again; a device block is gathered
        once more into full, independent parameter storage."""
        if self.homed_on_host:
            self.pending.clear()
            params = [p for ps, _, _ in self.groups for p in ps]
            for p, host in zip(params, self.host_data, strict=True):
                p.data = host
            self.gathered = False
            return
        self.wait()
        for params, _, _ in self.groups:
            for p in params:
                p.data = p.data.clone()


class HSDPHook(ModelHook):
    """On a sharded block: wait for its gather, issue the next block's, run, free."""

    def __init__(self, block: _ShardedBlock, following: _ShardedBlock | None, prefetch: bool) -> None:
        super().__init__()
        self.block = block
        self.following = following
        self.prefetch = prefetch

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.block.wait()
        if self.prefetch and self.following is not None:
            self.following.gather()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.block.release()
        return output


class _FirstGatherHook(ModelHook):
    def __init__(self, first: _ShardedBlock) -> None:
        super().__init__()
        self.first = first

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.first.gather()
        return args, kwargs


def apply_hsdp(
    transformer: nn.Module, blocks: list[tuple[str, nn.Module]], config: HSDPConfig, comm: Collective
) -> MitigationHandle:
    """Shard ``config.blocks`` across ``comm``'s ranks.

    Every rank must call this with the same blocks and identical weights (the same seed or
    checkpoint): each keeps the slice it owns.

    Args:
        transformer: the DiT.
        blocks: all DiT blocks in execution order (``ModelSpec.dit_blocks``).
        config: which blocks to shard.
        comm: ``ProcessGroupCollective(group)`` to run, ``ShapeOnlyGroup(W)`` to analyse.
    """
    check_blocks("hsdp", config.blocks, len(blocks))
    if comm.world_size < 2:
        raise ValueError(f"hsdp needs a group of at least 2 ranks, got {comm.world_size}")
    handle = MitigationHandle("hsdp")
    order = sorted(config.blocks)
    device = compute_device(transformer)
    sharded = [_ShardedBlock(blocks[i][1], comm, device) for i in order]
    for i, s in zip(order, sharded, strict=True):
        handle.add_undo(s.restore)
        for g, (_, _, shard) in enumerate(s.groups):
            handle.resident[f"hsdp_shard.{blocks[i][0]}.{g}"] = shard
    for k, (i, s) in enumerate(zip(order, sharded, strict=True)):
        following = sharded[k + 1] if k + 1 < len(sharded) else None
        hook_module(handle, blocks[i][1], HSDPHook(s, following, config.prefetch), HOOK_NAMES["hsdp"])
    if sharded and config.prefetch:
        hook_module(handle, transformer, _FirstGatherHook(sharded[0]), HOOK_NAMES["hsdp_first"])
    return handle


def apply(pipe: Any, spec: ModelSpec, config: HSDPConfig, comm: Collective | None = None) -> MitigationHandle:
    """The primitive's entry point: ``apply_hsdp`` on ``pipe.transformer``'s DiT blocks over ``comm``
    (required: ``ProcessGroupCollective(group)`` to run, ``ShapeOnlyGroup(W)`` to analyse)."""
    if comm is None:
        raise ValueError("hsdp needs a process group (comm)")
    return apply_hsdp(pipe.transformer, spec.dit_blocks(pipe.transformer), config, comm)
