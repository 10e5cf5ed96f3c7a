"""Where a tensor lives: its weights' home, the device a module computes on, host copies and
placeholders.

Models (the loader homes weights) and mitigation (offloads move them) both need these facts, and
neither may depend on the other (diffusers keeps its hooks above its models, never the reverse):
so they live here, beside ``platforms``, under both.

Where tensors live is decided per device. On CUDA the host copy is pinned CPU memory and
transfers run on a side stream; on CPU the "device" is host memory, so the host copy is the
tensor itself and transfers are copies on the one stream; on the meta device (shape-only
analysis) a host copy holds only the tensor's shape and dtype: nothing is allocated anywhere,
and bringing it back allocates a fresh meta tensor, which is exactly the allocation the analyzer
must see. This is how a 32 B-parameter model is analysed with K blocks "on host" without 64 GB
of host RAM.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from xema_ray.platforms import streams as _device

class WeightHome(str, Enum):
    """Where a module's weights live between uses."""

    DEVICE = "device"
    HOST = "host"


#: attribute set on a module whose weights the loader (or a residency switch) homed on the host;
#: the block-offload primitive reads it to stream those weights instead of moving them
WEIGHT_HOME_ATTR = "_xema_weight_home"
#: attribute on a component: the device it computes on (a host-homed block's tensors are on the CPU)
COMPUTE_DEVICE_ATTR = "_xema_compute_device"
#: attribute on a component: its ``PlacementReport`` (bytes placed per home at load)
PLACEMENT_ATTR = "_xema_placement"


#: attribute on a component: the ``HostBuffer`` its host-homed tensors are views into (closed with the model)
HOST_BUFFER_ATTR = "_xema_host_buffer"


@dataclass
class PlacementReport:
    """Bytes placed per home while loading one component (or, added up, one worker's model).

    Host figures: ``host_bytes`` are the host-homed tensors' own bytes; ``host_buffer_bytes`` the
    exact-size buffer they are views into, ``host_pinned_bytes`` the part of it page-locked
    (all of it on CUDA, none for a component that computes on the host CPU); ``host_pow2_bytes`` what
    torch's pinned allocator would hold had each tensor been pinned on its own (its power-of-two
    rounding; the loader before exact buffers); ``host_shared_bytes`` the part of the buffers that
    is one node-wide segment (paid once per node, by the first worker that fills it);
    ``host_attached_bytes`` the part this worker found filled by another (it read nothing for it);
    ``transient_bytes`` the most anonymous host memory the load held at once beyond those buffers
    (values read or generated before they reached their home; memory-mapped checkpoint pages are
    page cache, not counted).

    With the node's host copy (``materialize(host_copy=True)``) the device-homed tensors have slots
    in the shared buffer too: ``host_copy_bytes`` are their bytes, copied to the device from it.
    The weight phase's seconds: ``source_s`` values read or generated into their host slot (or
    straight to their home without a host copy), ``device_copy_s`` host copy -> device (zero when
    nothing was copied). A CPU device keeps a memory-mapped checkpoint's tensors as they are read
    (no copy): their pages are read when first touched, after ``source_s``.
    """

    device_bytes: int = 0
    host_bytes: int = 0
    tensors: int = 0
    host_buffer_bytes: int = 0
    host_pinned_bytes: int = 0
    host_pow2_bytes: int = 0
    host_shared_bytes: int = 0
    host_attached_bytes: int = 0
    transient_bytes: int = 0
    host_copy_bytes: int = 0
    source_s: float = 0.0
    device_copy_s: float = 0.0

    def add(self, other: PlacementReport) -> None:
        """Add a component loaded after this one (transients are not held together: the larger counts)."""
        self.device_bytes += other.device_bytes
        self.host_bytes += other.host_bytes
        self.tensors += other.tensors
        self.host_buffer_bytes += other.host_buffer_bytes
        self.host_pinned_bytes += other.host_pinned_bytes
        self.host_pow2_bytes += other.host_pow2_bytes
        self.host_shared_bytes += other.host_shared_bytes
        self.host_attached_bytes += other.host_attached_bytes
        self.transient_bytes = max(self.transient_bytes, other.transient_bytes)
        self.host_copy_bytes += other.host_copy_bytes
        self.source_s += other.source_s
        self.device_copy_s += other.device_copy_s


# ---------------------------------------------------------------------------- compute device
def compute_device(module: nn.Module) -> torch.device:
    """The device ``module`` computes on: recorded by the loader (a host-homed block's tensors
    are on the CPU while the model computes on CUDA), else its first parameter's."""
    recorded = getattr(module, COMPUTE_DEVICE_ATTR, None)
    return recorded if recorded is not None else next(module.parameters()).device


# ---------------------------------------------------------------------------- host copies
_SCALARS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` backed by one shared element (a stride-0 expand): what a
    parameter points to while its real data lives elsewhere. Modules that read
    ``.shape``/``.dtype`` outside ``forward`` keep working; the hooks guarantee the real data
    is back before ``forward`` reads values. One scalar per (dtype, device) backs them all, so
    the analyzer counts it once (512 B), not once per parameter."""
    key = (dtype, torch.device(device))
    base = _SCALARS.get(key)
    if base is None:
        base = _SCALARS[key] = torch.zeros((), dtype=dtype, device=device)
    return base.expand(shape)


def forget_placeholders(device_type: str) -> None:
    """Drop the shared scalars of ``device_type``: the next placeholder made there allocates
    its scalar again. A worker's load traced on meta starts with this (``xema_ray.measure.verify``),
    so its weight bytes are those of a process's first load whatever the process did before."""
    for key in [k for k in _SCALARS if k[1].type == device_type]:
        del _SCALARS[key]


def placeholder_like(t: torch.Tensor) -> torch.Tensor:
    return placeholder(t.shape, t.dtype, t.device)


class HostCopy:
    """A tensor's data kept off the compute device (see the module docstring per device).

    Args:
        t: the device tensor to copy.
        pin: pin the CUDA host copy (needed for asynchronous copies; done once here).
        keep: on CPU, keep ``t`` itself as the host copy instead of cloning it (weights, whose
            storage nobody else frees).
        device: the compute device the copy returns to (default ``t.device``; given when ``t``
            is already on the host, e.g. a block the worker homed there at load).
    """

    __slots__ = ("shape", "dtype", "device", "data", "pending")

    def __init__(self, t: torch.Tensor, pin: bool = True, keep: bool = False, device: torch.device | None = None,
                 stream: _device.TransferStream | None = None) -> None:
        self.shape = t.shape
        self.dtype = t.dtype
        self.device = device if device is not None else t.device
        #: event of an asynchronous device->host copy still in flight (CUDA with a ``stream``)
        self.pending: object | None = None
        if self.device.type == "meta":
            self.data: torch.Tensor | None = None  # nothing to hold: meta has no values
            if stream is not None and t.device.type == "meta":
                stream.hold(t)  # the copy's source stays until compute is ordered after it
        elif _device.host_is_device(self.device):
            self.data = t if keep else t.clone()
        elif _device.on_host(t):
            # already on the host: keep it (pinned once, at load, for asynchronous copies)
            self.data = t if (_device.is_pinned(t) or not pin) else _device.pin(t)
        else:
            self.data, self.pending = _device.to_host(t, pin=pin, stream=stream)

    def to_device(self, stream: _device.TransferStream | None = None) -> torch.Tensor:
        """A fresh device tensor with the host data (allocated now, on ``stream`` if given)."""
        if self.data is None:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if _device.host_is_device(self.device):
            return self.data.clone()
        return _device.to_device(self.data, self.device, stream, self.pending)

    def into_device(self, dst: torch.Tensor, stream: _device.TransferStream | None = None) -> torch.Tensor:
        """``dst`` (a device tensor of this shape and dtype that already exists) filled with the
        host data, on ``stream`` if given (``streams.copy_into``: allocates nothing)."""
        if dst.shape != self.shape or dst.dtype != self.dtype:
            raise ValueError(f"a {tuple(self.shape)} {self.dtype} host copy cannot fill a {tuple(dst.shape)} {dst.dtype} tensor")
        if self.data is not None:
            _device.copy_into(dst, self.data, stream, self.pending)
        return dst

    def placeholder(self) -> torch.Tensor:
        """What the original tensor object points to while offloaded: the host data itself on
        CPU and CUDA (so a stray read fails loudly with a device mismatch on CUDA and still
        sees the right values on CPU), a storage-less stand-in on meta."""
        if self.data is None:
            return placeholder(self.shape, self.dtype, self.device)
        return self.data

    @classmethod
    def empty(cls, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> HostCopy:
        """An uninitialised host buffer for a tensor of ``device`` (pinned on CUDA, nothing on
        meta): the target of band-wise writes (``copy_rows``) that never exist whole on the device."""
        obj = cls.__new__(cls)
        obj.shape, obj.dtype, obj.device = torch.Size(shape), dtype, torch.device(device)
        obj.pending = None
        if obj.device.type == "meta":
            obj.data = None
        else:
            obj.data = torch.empty(obj.shape, dtype=dtype, pin_memory=obj.device.type == "cuda")
        return obj

    def narrow(self, dim: int, start: int, length: int) -> HostCopy:
        """The rows ``[start, start + length)`` along ``dim``: a view of the host data, no copy."""
        obj = HostCopy.__new__(HostCopy)
        shape = list(self.shape)
        shape[dim] = length
        obj.shape, obj.dtype, obj.device = torch.Size(shape), self.dtype, self.device
        obj.pending = self.pending
        obj.data = None if self.data is None else self.data.narrow(dim, start, length)
        return obj

    def copy_rows(self, dim: int, start: int, src: HostCopy, src_start: int, length: int) -> None:
        """Host-to-host: ``self[start:start+length] = src[src_start:src_start+length]`` along ``dim``."""
        if self.data is not None and src.data is not None:
            _device.host_ready(src.pending)  # a CPU read: the asynchronous copy must have landed
            self.data.narrow(dim, start, length).copy_(src.data.narrow(dim, src_start, length))


class OffloadedTensor:
    """A tensor waiting on the host in place of the tensor itself (e.g. a conv cache in the
    caller's dict); ``load()`` brings it back. Primitives that restructure calls (VAE bands)
    load these before slicing and offload their reassembled results again."""

    __slots__ = ("host", "stream")

    def __init__(self, t: torch.Tensor, stream: _device.TransferStream | None = None) -> None:
        self.host = HostCopy(t, stream=stream)  # asynchronous on CUDA: the cache leaves on the side stream
        self.stream = stream

    @classmethod
    def from_host(cls, host: HostCopy, stream: _device.TransferStream | None = None) -> OffloadedTensor:
        """Wrap a host copy that is already there (a band of a whole cache, a buffer written band by band)."""
        obj = cls.__new__(cls)
        obj.host, obj.stream = host, stream
        return obj

    @property
    def shape(self) -> torch.Size:
        return self.host.shape

    def load(self) -> torch.Tensor:
        t = self.host.to_device(self.stream)
        if self.stream is not None:
            # the tensor is read right away: order compute after the copy
            self.stream.wait(self.stream.record(), [t])
        return t
