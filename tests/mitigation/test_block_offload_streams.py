"""Block offload's copies on the emulated asynchronous device (``pytest -m streams``): each onload
is ordered after compute from the compute stream, and the weights a block released (read by the
compute stream, freed stream-ordered) go back to the side stream's pool as soon as the next copy
is ordered after that compute. In steady state the onloads then take nothing from the driver — on
a GPU, no ``cudaMalloc`` and no device-synchronising ``cudaFree`` between steps."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tests.host_arena import alloc, device  # noqa: F401 - fixtures
from xema_ray.allocator.emulated import locate
from xema_ray.allocator.runtime import StaticAllocator
from xema_ray.mitigation.block_offload import BlockOffloadConfig, apply_block_offload
from xema_ray.platforms.async_host import AsyncHostDevice

pytestmark = pytest.mark.streams

WIDTH = 256
BLOCKS = 6
#: one block's weights in the arena (weight + bias, each rounded up to 512 bytes)
BLOCK_BYTES = WIDTH * WIDTH * 4 + WIDTH * 4


class Stack(nn.Module):
    """A tiny DiT stand-in: ``BLOCKS`` linear blocks run in order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


@pytest.fixture
def emulated(alloc: StaticAllocator, device: int) -> Iterator[AsyncHostDevice]:
    # room for the two blocks offload keeps on the device (running, arriving), one released block
    # not yet reused and the activations: not for all six blocks at once
    alloc.reserve(0, 4 * BLOCK_BYTES + (128 << 10), device=device)
    dev = AsyncHostDevice(str(alloc.library_path), device, lambda p: locate(alloc, p, device))
    with dev.installed():
        yield dev
    gc.collect()
    alloc.poll(device=device)


def test_onloads_take_nothing_from_the_driver_in_steady_state(
        emulated: AsyncHostDevice, alloc: StaticAllocator, device: int) -> None:
    model = Stack()
    x = torch.randn(8, WIDTH)
    with torch.no_grad():
        expected = model(x)
    handle = apply_block_offload(model, list(model.blocks.named_children()),
                                 BlockOffloadConfig(blocks=tuple(range(BLOCKS))))
    outs = []
    with torch.no_grad(), emulated.running():
        outs.append(model(x))  # the first step: the side stream's pool is built
        warm = alloc.stats(device=device)
        outs += [model(x) for _ in range(3)]  # steps of one batch: no synchronisation between them
        steady = alloc.stats(device=device)
        emulated.synchronize()
        results = [o.clone() for o in outs]
    del outs
    handle.remove()
    assert emulated.hazards == []
    assert all(torch.equal(r, expected) for r in results)
    assert steady.driver_allocs == warm.driver_allocs, (warm.driver_allocs, steady.driver_allocs)
    # the released weights were deferred (the compute stream read them) and went back by the ordering
    assert steady.deferred_frees > warm.deferred_frees
    assert steady.peak_active_bytes <= 4 * BLOCK_BYTES + (128 << 10)
