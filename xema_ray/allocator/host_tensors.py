"""A CPU worker's tensors mirrored into the host arena, so its batches meet a device's limits.

On CUDA every tensor's memory comes from ``xema_torch_malloc``; a CPU tensor's never reaches the
library (torch has no pluggable CPU allocator). ``HostArenaTensors`` closes that gap for tests and
CPU serving: a ``TorchDispatchMode`` that, for every new CPU storage an op makes, allocates as
many bytes in the host arena (stream 0, the plan's stream) and frees them when the storage dies
(a ``weakref`` on it, as the analyzer's tracer sees frees). The bytes torch computes in stay
torch's; the arena holds a same-sized block for as long, so its plan cursor, regions, fallbacks,
limit (``StaticAllocator.set_limit``) and out-of-memory record follow the batch as they would on
a device. An allocation the arena refuses raises ``ArenaOutOfMemory`` in the op that asked — where
torch raises on CUDA.

Example:
    >>> import torch
    >>> from xema_ray.allocator.runtime import StaticAllocator
    >>> alloc = StaticAllocator("host")
    >>> alloc.set_limit(1 << 20, device=9)
    >>> with HostArenaTensors(alloc, device=9):
    ...     x = torch.ones(1024) * 2
    >>> alloc.stats(device=9).active_bytes
    4096
    >>> del x
    >>> alloc.stats(device=9).active_bytes
    0
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from xema_ray.allocator.runtime import StaticAllocator


class HostArenaTensors(TorchDispatchMode):
    """Mirror every new CPU storage made inside the mode into the host arena of ``device``.

    Args:
        allocator: a host-backend ``StaticAllocator``.
        device: the arena's device index.
    """

    def __init__(self, allocator: StaticAllocator, device: int = 0) -> None:
        super().__init__()
        if allocator.backend != "host":
            raise ValueError(f"HostArenaTensors mirrors CPU tensors into the host arena; got a {allocator.backend} allocator")
        self.allocator = allocator
        self.device = device
        self._live: dict[int, tuple[weakref.ref[Any], int]] = {}  # id(storage) -> (its ref, arena address)
        self._lock = threading.Lock()  # frees arrive on whichever thread drops the last reference

    def _free(self, key: int, ptr: int) -> Callable[[weakref.ref[Any]], None]:
        def on_free(ref: weakref.ref[Any]) -> None:
            with self._lock:
                entry = self._live.get(key)
                if entry is not None and entry[0] is ref:
                    del self._live[key]
            self.allocator.free(ptr, device=self.device)

        return on_free

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse / nested layouts own no plain storage
            return
        key = id(storage)
        with self._lock:
            hit = self._live.get(key)
            if hit is not None and hit[0]() is storage:
                return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        ptr = self.allocator.malloc(nbytes, device=self.device)  # ArenaOutOfMemory: the batch fails here
        with self._lock:
            self._live[key] = (weakref.ref(storage, self._free(key, ptr)), ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view shares its base's storage: nothing new
            return out
        for t in (out,) if type(out) is torch.Tensor else tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t)
        return out




_slots = itertools.count(1)  # 0 is layout_replay's
_slots_lock = threading.Lock()


def claim_host_device() -> int:
    """A host-arena device index nobody in this process has used (the library keeps one arena, with
    its counters, per index for the whole process: in-process workers and tests each need a fresh one)."""
    from xema_ray.allocator.runtime import MAX_DEVICES

    with _slots_lock:
        d = next(_slots)
    if d >= MAX_DEVICES:
        raise RuntimeError(f"all {MAX_DEVICES - 1} host-arena device indices of this process are taken")
    return d
