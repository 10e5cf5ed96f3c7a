"""A component's host-homed tensors packed into one exact-size buffer (one per node when shared).

The loader (``xema_ray.models.loading.materialize``) asks ``plan_pack`` where each host-homed
tensor goes before it reads any value: every tensor gets an aligned slot in one buffer of the
pack's exact size (``HostPack.nbytes``), so the process pins what it holds, not the power of two
above each tensor (``xema_ray.platforms.host_memory.torch_pinned_bytes``, ``HostPack.pow2_bytes``:
what pinning tensor by tensor held). With a share key the buffer is a node-wide segment named by
the key and the pack's own layout (``HostPack.key``): the first worker fills it, further workers of
the same model, weights and residency map it filled and read nothing.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from xema_ray.placement import WeightHome
    >>> m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to("meta")
    >>> pack = plan_pack(m, torch.float32, lambda p: WeightHome.HOST if p == "1" else WeightHome.DEVICE)
    >>> [(s.path, s.name, s.offset) for s in pack.slots], pack.nbytes
    ([('1', 'weight', 0), ('1', 'bias', 256)], 264)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from xema_ray.placement import HOST_BUFFER_ATTR, WeightHome
from xema_ray.platforms.host_memory import (DEFAULT_APP, HostBuffer, SegmentHolder, SharedSegments, align, segment_app,
                                            torch_pinned_bytes)


@dataclass(frozen=True)
class HostSlot:
    """Where one host-homed tensor lives in its component's buffer."""

    path: str
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass(frozen=True)
class HostPack:
    """The host-homed tensors of one component, laid out in one buffer."""

    slots: tuple[HostSlot, ...] = ()

    @property
    def nbytes(self) -> int:
        """The buffer's exact size: the last slot's end (slots start at aligned offsets)."""
        return self.slots[-1].offset + self.slots[-1].nbytes if self.slots else 0

    @property
    def tensor_bytes(self) -> int:
        """The tensors' own bytes (what ``PlacementReport.host_bytes`` counts)."""
        return sum(s.nbytes for s in self.slots)

    @property
    def pow2_bytes(self) -> int:
        """What torch's pinned allocator holds when each tensor is pinned on its own."""
        return sum(torch_pinned_bytes(s.nbytes) for s in self.slots)

    def key(self, identity: str) -> str:
        """A segment name for this layout of the weights ``identity`` names (model, component,
        weight source, dtype): two workers get the same key exactly when they would hold the
        same bytes."""
        h = hashlib.sha256(identity.encode())
        for s in self.slots:
            h.update(f"\x00{s.path}.{s.name}:{s.offset}:{s.shape}:{s.dtype}".encode())
        return h.hexdigest()[:24]


def slot_dtype(module: nn.Module, name: str, meta: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is placed in: floating parameters and the floating buffers a weight
    source fills take the load dtype; buffers the constructor computed keep theirs."""
    if not meta.is_floating_point():
        return meta.dtype
    if name in module._parameters or meta.is_meta:
        return dtype
    return meta.dtype


def plan_pack(root: nn.Module, dtype: torch.dtype, home_of: Callable[[str], WeightHome]) -> HostPack:
    """The slots of every host-homed tensor of ``root`` (a meta-built component), in the order the
    loader places them; a tied parameter (one object under two names) gets one slot."""
    slots: list[HostSlot] = []
    seen: set[int] = set()
    offset = 0
    for path, sub in root.named_modules(remove_duplicate=True):
        own = dict(sub.named_parameters(recurse=False)) | dict(sub.named_buffers(recurse=False))
        if not own or home_of(path) is not WeightHome.HOST:
            seen.update(id(t) for t in own.values())
            continue
        for name, meta in own.items():
            if id(meta) in seen:
                continue
            seen.add(id(meta))
            slot = HostSlot(path, name, offset, tuple(meta.shape), slot_dtype(sub, name, meta, dtype))
            slots.append(slot)
            offset = align(offset + slot.nbytes)
    return HostPack(tuple(slots))


def open_host_buffer(pack: HostPack, device: torch.device, key: str | None, app: str = DEFAULT_APP,
                     holder: SegmentHolder | None = None) -> HostBuffer | None:
    """The buffer ``pack``'s tensors will be views into: none on meta (nothing is allocated) or
    for an empty pack; the node's segment named ``key`` of the Serve application ``app`` (filled
    already when another worker of that app made it; another app's is neither used nor swept; a
    new one owned by ``holder``, which keeps it after its last worker, when given); else this
    worker's own."""
    if device.type == "meta" or not pack.slots:
        return None
    if key is None:
        return HostBuffer.private(pack.nbytes)
    owner = holder.owner_record() if holder is not None else None
    return SharedSegments(app=segment_app(app), owner=owner).open(key, pack.nbytes)


def finish_host_buffer(component: nn.Module, buf: HostBuffer, device: torch.device, pinned: bool) -> None:
    """The component's tensors are in ``buf``: publish a segment this worker filled, page-lock the
    buffer for the device's copies, and keep it with the component (``close_host_buffers``)."""
    from xema_ray.platforms import get_platform

    SharedSegments.publish(buf)
    if pinned and device.type == "cuda":
        buf.register(get_platform("cuda"))
    setattr(component, HOST_BUFFER_ATTR, buf)


def release_host_buffer(buf: HostBuffer, failed: bool = False) -> None:
    """Let go of ``buf`` (an unfinished segment is removed so the next worker fills it anew)."""
    if failed:
        SharedSegments.abandon(buf)
    buf.close()


def close_host_buffers(components: Iterable[object]) -> None:
    """Unregister and release the host buffers of a model's components (the worker drops the model)."""
    for c in components:
        buf = getattr(c, HOST_BUFFER_ATTR, None)
        if isinstance(buf, HostBuffer):
            buf.close()
            delattr(c, HOST_BUFFER_ATTR)
