"""Selective block weight offload (paper §5.1, Figures 4-5).

K chosen DiT blocks keep their weights on the host. When offloaded block ``i`` starts, the
next offloaded block ``j`` begins to arrive on a side stream, so its copy overlaps the compute
of blocks ``i .. j-1``: with the K blocks spread evenly that window is ~N/K blocks instead of
the single block full layerwise offload gets. A block's weights are released as soon as it
has run. At any moment at most two offloaded blocks are on the device (the running one and
the one arriving). ``K = N`` is the layerwise-offload baseline; ``K = 0`` is no offload.

Example:
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> spec = get_model_spec("tiny-flux2")
    >>> pipe = spec.build_pipeline(BuildOptions())
    >>> handle = apply_block_offload(pipe.transformer, spec.dit_blocks(pipe.transformer),
    ...                              BlockOffloadConfig(blocks=(0, 2)))
    >>> handle.remove()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.platforms import streams as _device
from xema_ray.mitigation.hooks import HOOK_NAMES, MitigationHandle, check_blocks, hook_module
from xema_ray.placement import HostCopy, compute_device
from xema_ray.placement import WEIGHT_HOME_ATTR, WeightHome

if TYPE_CHECKING:
    from xema_ray.mitigation.hsdp import Collective
    from xema_ray.models import ModelSpec


class BlockOffloadConfig(BaseModel):
    """Which DiT blocks live on the host, and how they come back."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: tuple[int, ...] = Field(description="indices into ModelSpec.dit_blocks (execution order)")
    prefetch: bool = Field(default=True, description="start the next offloaded block's copy when this one starts")
    pin_memory: bool = Field(default=True, description="pin host copies (CUDA) so copies are asynchronous")


class _OffloadedBlock:
    """One block's weights on the host, onloaded per forward.

    A block the worker homed on the host at load (``WEIGHT_HOME_ATTR``, see
    ``xema_ray.runtime.residency``) is streamed from where it already is: nothing is copied
    when the primitive is applied, and removing it leaves the block on the host. A block that is
    on the device (a pipeline built whole, as the analyzer's) is copied to the host once here and
    put back by ``restore``."""

    def __init__(self, block: nn.Module, stream: _device.TransferStream, pin: bool, device: torch.device) -> None:
        self.block = block
        self.stream = stream
        self.homed_on_host = getattr(block, WEIGHT_HOME_ATTR, None) == WeightHome.HOST.value
        self.tensors: list[tuple[torch.Tensor, HostCopy]] = []
        for t in [*block.parameters(), *block.buffers()]:
            host = HostCopy(t.data, pin=pin, keep=True, device=device)
            self.tensors.append((t, host))
            t.data = host.placeholder()
        self.bytes = sum(t.numel() * t.element_size() for t, _ in self.tensors)
        self.event: Any = None
        self.onloaded = False

    def onload(self) -> None:
        """Issue the copies (on the side stream on CUDA); ``wait`` before use.

        Called on the compute stream: each copy is allocated and issued on the side stream, which
        ``to_device`` first orders after the compute issued so far. That ordering is what gives
        the weights an earlier block released (read by compute, so their free waits for it) back
        to the side stream's pool for these copies, instead of new memory from the driver."""
        if self.onloaded:
            return
        for t, host in self.tensors:
            t.data = host.to_device(self.stream)
        self.event = self.stream.record()
        self.onloaded = True

    def onload_into(self, slot: list[torch.Tensor]) -> None:
        """``onload`` into device tensors that already exist (``slot``, one per tensor of the block,
        in ``tensors`` order; memory another block gave up): the copies are ordered after the
        compute issued so far, which may still read that memory, and allocate nothing."""
        if self.onloaded:
            return
        for (t, host), dst in zip(self.tensors, slot, strict=True):
            t.data = host.into_device(dst, self.stream)
        self.event = self.stream.record()
        self.onloaded = True

    def wait(self) -> None:
        self.onload()
        if self.event is not None:  # None: no side stream (CPU, meta), nothing to wait for
            # the compute stream must not read the weights before the side-stream copy has landed
            self.stream.wait(self.event, [t.data for t, _ in self.tensors])
        self.event = None

    def release(self) -> None:
        for t, host in self.tensors:
            t.data = host.placeholder()
        self.onloaded = False

    def restore(self) -> None:
        """Undo: a block homed on the host stays there (its home is worker state); one that was
        on the device goes back for good."""
        if self.homed_on_host:
            self.release()
            return
        self.onload()
        self.wait()


#: the public name (the expert swap keeps a whole expert's blocks this way, across batches)
OffloadedBlock = _OffloadedBlock


class BlockOffloadHook(ModelHook):
    """On an offloaded block: make sure its weights have arrived, start the next one's copy,
    run, release."""

    def __init__(self, group: _OffloadedBlock, following: _OffloadedBlock | None, prefetch: bool) -> None:
        super().__init__()
        self.group = group
        self.following = following
        self.prefetch = prefetch

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.group.wait()
        if self.prefetch and self.following is not None:
            self.following.onload()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.group.release()
        return output


class _FirstPrefetchHook(ModelHook):
    """On the transformer: start the first offloaded block's copy when the step begins, so it
    overlaps the embedding layers and the blocks before it."""

    def __init__(self, first: _OffloadedBlock) -> None:
        super().__init__()
        self.first = first

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.first.onload()
        return args, kwargs


def apply_block_offload(
    transformer: nn.Module, blocks: list[tuple[str, nn.Module]], config: BlockOffloadConfig
) -> MitigationHandle:
    """Offload ``config.blocks`` of ``blocks`` (``ModelSpec.dit_blocks(transformer)``).

    Args:
        transformer: the DiT (its first parameter's device is the compute device).
        blocks: all DiT blocks in execution order.
        config: which to offload.

    Returns:
        A handle whose ``remove()`` detaches the hooks and returns each block to its home: the
        host for blocks the worker placed there at load, the device for the others.
    """
    check_blocks("block_offload", config.blocks, len(blocks))
    handle = MitigationHandle("block_offload")
    if not config.blocks:
        return handle
    device = compute_device(transformer)
    stream = _device.TransferStream(device)
    order = sorted(config.blocks)
    groups = [_OffloadedBlock(blocks[i][1], stream, config.pin_memory, device) for i in order]
    for g in groups:
        handle.add_undo(g.restore)
    for k, (i, g) in enumerate(zip(order, groups, strict=True)):
        following = groups[k + 1] if k + 1 < len(groups) else None
        hook_module(handle, blocks[i][1], BlockOffloadHook(g, following, config.prefetch), HOOK_NAMES["block_offload"])
    if config.prefetch:
        hook_module(handle, transformer, _FirstPrefetchHook(groups[0]), HOOK_NAMES["block_offload_first"])
    return handle


def apply(pipe: Any, spec: ModelSpec, config: BlockOffloadConfig, comm: Collective | None = None) -> MitigationHandle:
    """The primitive's entry point: ``apply_block_offload`` on ``pipe.transformer``'s DiT blocks
    (``comm`` unused). ``apply_block_offload`` stays for modules that are not a pipeline's DiT
    (the text encoder streamed block by block)."""
    return apply_block_offload(pipe.transformer, spec.dit_blocks(pipe.transformer), config)
