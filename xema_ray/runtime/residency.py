"""Weight residency: which DiT blocks live on the device and which on the host, as worker state.

A plan's weight mitigations (block offload, selective HSDP) say which blocks must not stay on
the device. The worker decides that once, at load: ``Residency.of_config`` gives the blocks
homed on (pinned) host memory, ``BuildOptions.host_modules`` places them there while loading,
and the per-batch primitives only arm hooks on weights already placed: block offload streams a
host-homed block through the device while it runs, HSDP cuts this rank's shard from the host
copy. Nothing is copied back to the device when the batch ends.

When two templates of a model group need different residency, ``ResidencyManager.switch``
moves only the difference (blocks newly offloaded go to the host, blocks no longer offloaded
come back) and counts the bytes, which the planner and the simulator cost with
``switch_bytes``.

Example:
    >>> from xema_ray.plan import Mitigation
    >>> a = Residency(host_blocks=(0, 2, 4))
    >>> b = Residency(host_blocks=(2, 4, 6))
    >>> a.difference(b)
    ((0,), (6,))
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.models import ModelSpec
from xema_ray.models.host_pack import close_host_buffers
from xema_ray.placement import COMPUTE_DEVICE_ATTR, WEIGHT_HOME_ATTR, WeightHome
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.platforms import streams as _device


class Residency(BaseModel):
    """The DiT blocks whose weights are homed on the host (the rest are on the device)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host_blocks: tuple[int, ...] = Field(default=(), description="sorted DiT block indices homed on host memory")
    expert_blocks: int = Field(default=0, ge=0, description="a two-expert model's expert switch "
                                                            "(``ExecutionConfig.experts``): the leading DiT blocks of "
                                                            "each expert homed on host memory at load (all of them "
                                                            "for a swap, the split's for a split)")

    @classmethod
    def of_config(cls, config: ExecutionConfig) -> Residency:
        """What ``config`` keeps off the device: its weight mitigations' blocks (block offload and
        HSDP: the device holds an HSDP block only as this rank's shard and, while it runs,
        gathered) and its expert switch's blocks of both experts (``expert_host_blocks``)."""
        blocks: set[int] = set()
        for m in config.mitigations:
            if m.kind in ("block_offload", "hsdp") and m.blocks is not None:
                blocks.update(m.blocks)
        return cls(host_blocks=tuple(sorted(blocks)), expert_blocks=expert_host_blocks(config))

    @classmethod
    def union(cls, residencies: Iterable[Residency]) -> Residency:
        """One residency that serves every template of a group without switching."""
        blocks: set[int] = set()
        experts = 0
        for r in residencies:
            blocks.update(r.host_blocks)
            experts = max(experts, r.expert_blocks)
        return cls(host_blocks=tuple(sorted(blocks)), expert_blocks=experts)

    def difference(self, target: Residency) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(blocks to bring to the device, blocks to send to the host) to go from self to ``target``."""
        cur, new = set(self.host_blocks), set(target.host_blocks)
        return tuple(sorted(cur - new)), tuple(sorted(new - cur))

    def host_modules(self, spec: ModelSpec) -> tuple[str, ...]:
        """``BuildOptions.host_modules`` paths of the host-homed blocks."""
        paths = block_paths(spec)
        return tuple(f"transformer.{paths[i]}" for i in self.host_blocks)


def expert_host_blocks(config: ExecutionConfig) -> int:
    """Leading DiT blocks of each expert ``config``'s expert switch homes on the host (the load's
    ``xema_ray.mitigation.expert_swap.expert_host_modules``): every block for a swap, the split's
    for a split, none to hold both or without a switch."""
    swap = config.experts
    if swap is None or swap.strategy == "hold_both":
        return 0
    return len(block_paths(config.template.spec)) if swap.strategy == "swap_prefetched" else swap.host_blocks


def block_paths(spec: ModelSpec) -> list[str]:
    """DiT block paths (relative to the transformer) from the config, without building it: the
    spec's ``dit_block_paths`` (``tests/models/test_block_paths.py`` holds it to ``dit_blocks`` of
    the built transformer for every registered model)."""
    return spec.dit_block_paths()


def with_residency(config: ExecutionConfig, residency: Residency) -> ExecutionConfig:
    """``config`` streaming every host-homed block: a shared residency may keep blocks on the
    host that this plan alone would not offload, and a block that is not on the device must be
    streamed through it (the planner costs the shared residency with the same rule)."""
    covered = {b for m in config.mitigations if m.kind in ("block_offload", "hsdp") and m.blocks for b in m.blocks}
    extra = [b for b in residency.host_blocks if b not in covered]
    if not extra:
        return config
    mitigations = list(config.mitigations)
    for k, m in enumerate(mitigations):
        if m.kind == "block_offload" and m.blocks is not None:
            blocks = tuple(sorted({*m.blocks, *extra}))
            mitigations[k] = m.model_copy(update={"blocks": blocks, "intensity": len(blocks)})
            break
    else:
        mitigations.insert(0, Mitigation(kind="block_offload", blocks=tuple(extra), intensity=len(extra)))
    return config.model_copy(update={"mitigations": tuple(mitigations)})


def switch_seconds(sizes: list[int], current: Residency, target: Residency, h2d_gbps: float) -> float:
    """Time a switch takes at the host link's bandwidth (blocks leave before others arrive)."""
    return switch_bytes(sizes, current, target) / (h2d_gbps * 1e9)


def block_sizes(spec: ModelSpec) -> list[int]:
    """Weight bytes of each DiT block at the dtype a worker loads the model in (meta build)."""
    return list(_block_sizes(spec.name))


@cache
def _block_sizes(model: str) -> tuple[int, ...]:
    from xema_ray.models import get_model_spec
    from xema_ray.models.loading import build_on_meta

    spec = get_model_spec(model)
    dtype = torch.bfloat16 if spec.size == "real" else torch.float32
    transformer = build_on_meta(spec.transformer_class(), spec.transformer_config, dtype)
    return tuple(block_weight_bytes(b) for _, b in spec.dit_blocks(transformer))


def residency_host_bytes(spec: ModelSpec, residency: Residency) -> int:
    """Host memory a worker of ``spec`` holds for ``residency``'s blocks (pinned on CUDA): its
    host blocks and the expert switch's leading blocks of both experts (tensor bytes; the loader's
    exact buffers: ``xema_ray.runtime.host_bytes``)."""
    sizes = block_sizes(spec)
    first = set(residency.host_blocks) | set(range(residency.expert_blocks))
    return sum(sizes[i] for i in first) + sum(sizes[:residency.expert_blocks])


def switch_bytes(sizes: list[int], current: Residency, target: Residency) -> int:
    """Bytes a switch moves between host and device (both directions)."""
    up, down = current.difference(target)
    return sum(sizes[i] for i in (*up, *down))


def _block_tensors(block: nn.Module) -> list[torch.Tensor]:
    return [*block.parameters(), *block.buffers()]


def block_weight_bytes(block: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*block.parameters(), *block.buffers()])


@dataclass
class SwitchReport:
    """What one residency switch moved."""

    to_device: tuple[int, ...] = ()
    to_host: tuple[int, ...] = ()
    bytes_moved: int = 0

    @property
    def moved(self) -> bool:
        return bool(self.to_device or self.to_host)


@dataclass
class ResidencyManager:
    """The worker's residency: places blocks at load (through ``BuildOptions.host_modules``)
    and switches between residencies moving only the difference.

    Args:
        spec: the model.
        transformer: its DiT, built with ``current``'s host modules.
        current: the residency it was built with.
    """

    spec: ModelSpec
    transformer: nn.Module
    current: Residency
    switches: int = 0
    bytes_moved: int = 0
    _pin: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.blocks = self.spec.dit_blocks(self.transformer)
        self.device = getattr(self.transformer, COMPUTE_DEVICE_ATTR, None) or next(self.transformer.parameters()).device
        self._pin = not _device.host_is_device(self.device)
        #: the host tensors of the blocks homed on the host at load (views into the load's buffer,
        #: shared by the node's workers where it is a segment): a block sent back to the host
        #: points at them again instead of taking new host memory (weights never change)
        self._load_host: dict[int, list[torch.Tensor]] = {}
        for i in self.current.host_blocks:
            setattr(self.blocks[i][1], WEIGHT_HOME_ATTR, WeightHome.HOST.value)
            if self.device.type != "meta":
                self._load_host[i] = [t.data for t in _block_tensors(self.blocks[i][1])]

    def host_bytes(self) -> int:
        """Host memory the host-homed blocks hold (pinned on CUDA)."""
        return sum(block_weight_bytes(self.blocks[i][1]) for i in self.current.host_blocks)

    def _move(self, index: int, home: WeightHome) -> int:
        block = self.blocks[index][1]
        tensors = _block_tensors(block)
        moved = sum(t.numel() * t.element_size() for t in tensors)
        if self.device.type == "meta":
            from xema_ray.placement import placeholder

            for t in tensors:
                t.data = (torch.empty(t.shape, dtype=t.dtype, device="meta") if home is WeightHome.DEVICE
                          else placeholder(t.shape, t.dtype, self.device))
        elif home is WeightHome.DEVICE:
            for t in tensors:
                # on the compute stream, allocated there (platforms.streams: the arena on the
                # emulated device), ordered after the work issued so far; asynchronous from a
                # registered buffer, which ``switch`` frees only once the copies have read it
                t.data = _device.to_device(t.data.detach(), self.device, None)
        elif index in self._load_host:
            for t, host in zip(tensors, self._load_host[index], strict=True):
                t.data = host  # its load-time host copy: no new host memory, no copy back
        elif _device.host_is_device(self.device):
            for t in tensors:
                t.data = t.data.detach().clone()  # on CPU the "host" is the same memory: the clone stands for the copy
        else:
            self._to_new_host_buffer(block, tensors)
        if home is WeightHome.HOST:
            setattr(block, WEIGHT_HOME_ATTR, WeightHome.HOST.value)
        elif hasattr(block, WEIGHT_HOME_ATTR):
            delattr(block, WEIGHT_HOME_ATTR)
        return moved

    def _to_new_host_buffer(self, block: nn.Module, tensors: list[torch.Tensor]) -> None:
        """The block's tensors copied into one exact-size host buffer of this worker, page-locked on
        CUDA so block offload's host->device copies are asynchronous (on CPU the "host" is the
        same memory, and the copy stands for the one a GPU makes)."""
        from xema_ray.placement import HOST_BUFFER_ATTR
        from xema_ray.platforms import get_platform
        from xema_ray.platforms.host_memory import HostBuffer, align

        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end = align(end + t.numel() * t.element_size())
        if self.device.type == "cpu":  # not host memory on the CPU: the tests' emulated device, its own host copies
            for t in tensors:
                t.data = _device.to_host(t.data.detach(), pin=self._pin)[0]
            return
        buf = HostBuffer.private(end)
        for t, off in zip(tensors, offsets, strict=True):
            view = buf.view(off, t.shape, t.dtype)
            # synchronous (the CPU waits for the copy), so the device block may go at once
            view.copy_(t.data.detach())
            t.data = view
        if self._pin:
            buf.register(get_platform("cuda"))
        setattr(block, HOST_BUFFER_ATTR, buf)

    def _free_switch_buffers(self, blocks: list[nn.Module]) -> None:
        """Unregister and free the host buffers an earlier switch made for ``blocks``, which just
        came back to the device (the load's buffers stay with their component)."""
        from xema_ray.placement import HOST_BUFFER_ATTR

        made = [b for b in blocks if getattr(b, HOST_BUFFER_ATTR, None) is not None]
        if not made:
            return
        # the host->device copies from these page-locked buffers are non_blocking: the CPU waits
        # for them before the pages are unregistered and freed under the DMA still reading them
        _device.host_ready(_device.compute_done(self.device))
        close_host_buffers(made)

    def switch(self, target: Residency) -> SwitchReport:
        """Make ``target`` the residency, moving only the blocks whose home changes. Blocks
        leave the device before others arrive, so the switch never holds both."""
        up, down = self.current.difference(target)
        report = SwitchReport(to_device=up, to_host=down)
        for i in down:
            report.bytes_moved += self._move(i, WeightHome.HOST)
        for i in up:
            report.bytes_moved += self._move(i, WeightHome.DEVICE)
        self._free_switch_buffers([self.blocks[i][1] for i in up])
        if report.moved:
            self.switches += 1
            self.bytes_moved += report.bytes_moved
        self.current = target
        return report
