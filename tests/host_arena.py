"""The allocator library's host backend for tests: one arena per device index for the whole
process (the replay uses index 0), so every test module takes its indices from this one counter
and no test sees another's state."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from xema_ray.allocator.runtime import StaticAllocator

#: device slots the library has (xema_alloc.h: XEMA_MAX_DEVICES)
SLOTS = 64
_devices = itertools.count(1)


@pytest.fixture(scope="module")
def alloc() -> StaticAllocator:
    return StaticAllocator("host")


@pytest.fixture
def device(alloc: StaticAllocator) -> Iterator[int]:
    """A fresh device index; at the end nothing may be left live on it, and its arena is released."""
    d = next(_devices)
    if d >= SLOTS:
        pytest.fail("more host-arena tests than device slots; reuse indices")
    yield d
    alloc.disarm(device=d)
    live = alloc.stats(device=d).live_blocks
    assert live == 0, f"test left {live} blocks live on device {d}"
    alloc.release(device=d)
