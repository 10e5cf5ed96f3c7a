"""The allocator library's host backend for tests: one arena per device index for the whole
process (the replay uses index 0), so every test takes its index from the one counter
(``claim_host_device``, which CPU workers on the host arena use too) and no test sees another's state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from xema_ray.allocator.host_tensors import claim_host_device
from xema_ray.allocator.runtime import StaticAllocator


@pytest.fixture(scope="module")
def alloc() -> StaticAllocator:
    return StaticAllocator("host")


@pytest.fixture
def device(alloc: StaticAllocator) -> Iterator[int]:
    """A fresh device index; at the end nothing may be left live on it, and its arena is released."""
    d = claim_host_device()  # shared with in-process workers on the host arena
    yield d
    alloc.disarm(device=d)
    live = alloc.stats(device=d).live_blocks
    assert live == 0, f"test left {live} blocks live on device {d}"
    alloc.release(device=d)
