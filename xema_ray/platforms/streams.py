"""Host<->device transfers off the critical path: the mitigation library's only door to ``torch.cuda``.

Transfers run on a side stream on CUDA so they overlap compute, in both directions: weights
and activations come back (host->device) while earlier blocks compute, and activations leave
(device->host) without stalling the compute stream. On CPU and meta there is one stream and
the same calls are plain copies (the logic above them is identical). Where the emulated
asynchronous device is installed (``xema_ray.platforms.async_host``, tests), the side stream is
its queue and device memory its arena, so the CUDA path runs on the CPU.

Stream-ordered memory: a block that a stream other than its allocating one uses must not be
reused before that stream is done with it. ``mark_used(t, stream)`` says so, to torch's caching
allocator (``record_stream``) and to the static allocator (``xema_mark_used``: torch never
forwards ``record_stream`` to a pluggable allocator), which keeps the block in a deferred-free
list until the stream has passed an event recorded at the free.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: the emulated asynchronous device, while one is installed (tests)
_EMULATED: Any = None
#: side streams of the meta device, whose held sources ``synchronize`` lets go of
_META_STREAMS: weakref.WeakSet[TransferStream] = weakref.WeakSet()
#: the static allocator's mark-used hook (``xema_mark_used`` through its binding), when installed
_MARK_USED: Callable[[int, int, int], Any] | None = None
#: ... and its stream-ordered hook (``xema_stream_ordered``: waiter, other, device)
_ORDERED: Callable[[int, int, int], Any] | None = None


def set_emulated_device(device: Any) -> Any:
    """Install (or, with None, remove) the emulated asynchronous device; returns the previous one."""
    global _EMULATED
    previous, _EMULATED = _EMULATED, device
    return previous


def set_mark_used_hook(hook: Callable[[int, int, int], Any] | None,
                       ordered: Callable[[int, int, int], Any] | None = None) -> None:
    """``hook(ptr, stream, device)``: the static allocator's ``mark_used``; ``ordered(waiter, other,
    device)``: its ``stream_ordered`` (both installed with it)."""
    global _MARK_USED, _ORDERED
    _MARK_USED, _ORDERED = hook, ordered


def _ordered(waiter: Any, other: Any, device: torch.device) -> None:
    """Tell the static allocator ``waiter`` now runs after all of ``other``'s work issued so far."""
    if _ORDERED is not None and device.type == "cuda":
        _ORDERED(int(waiter.cuda_stream), int(other.cuda_stream), device.index or 0)


def _emulated(device: torch.device) -> Any:
    return _EMULATED if _EMULATED is not None and device.type == "cpu" else None


def host_is_device(device: torch.device) -> bool:
    """Whether ``device``'s memory is host memory (the plain CPU): a host copy is then the tensor
    itself (or a clone), and nothing is transferred."""
    return device.type == "cpu" and _EMULATED is None


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is in host memory (pinned or not), not on the compute device."""
    if t.device.type != "cpu":
        return False
    return _EMULATED is None or not _EMULATED.is_device_tensor(t)


def is_pinned(t: torch.Tensor) -> bool:
    return _EMULATED is not None or t.is_pinned()


def pin(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned host memory (on a CPU-only build there is none: ``t`` itself)."""
    if _EMULATED is not None or not torch.cuda.is_available():
        return t
    return t if t.is_pinned() else t.pin_memory()


def mark_used(t: torch.Tensor, stream: Any) -> None:
    """``stream`` (a CUDA or emulated stream) uses ``t``, which another stream allocated: its memory
    must not be reused before ``stream`` is done with it (see the module docstring)."""
    if stream is None:
        return
    if _EMULATED is not None and t.device.type == "cpu":
        _EMULATED.mark_used(t, stream)
        return
    if t.device.type != "cuda":
        return
    t.record_stream(stream)  # the caching allocator (a no-op under the pluggable allocator)
    if _MARK_USED is not None:
        _MARK_USED(t.untyped_storage().data_ptr(), int(stream.cuda_stream), t.device.index or 0)


def compute_stream(device: torch.device) -> Any:
    """The stream compute runs on (None where there is only one)."""
    emu = _emulated(device)
    if emu is not None:
        return emu.compute
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return None


class TransferStream:
    """A side stream for host<->device copies on CUDA (or the emulated device); a no-op stand-in elsewhere.

    ``record()`` returns an event marking the copies issued so far; ``wait(event)`` makes the
    compute stream wait for them before it reads the copied tensors.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.emulated = _emulated(device)
        #: meta (shape-only analysis): the sources of copies not yet ordered before compute. A
        #: stream-ordered allocator holds their memory until the side stream passed them; the
        #: analyzer must count it, so they stay alive until compute waits on this stream or the
        #: device synchronises (the latest the allocator can learn the copies are done)
        self._held: list[torch.Tensor] = []
        if device.type == "meta":
            _META_STREAMS.add(self)
        self._last: Any = None  # the latest event recorded: waiting on it orders after everything issued
        #: the streams that were current when ``context()`` was entered (innermost last): inside
        #: it the current stream is this side stream, and compute is the one it was entered from
        self._outer: list[Any] = []
        if self.emulated is not None:
            self.stream: Any = self.emulated.new_stream()
        else:
            self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Make the side stream the current one (a no-op where there is none)."""
        if self.stream is None:
            yield
            return
        self._outer.append(self._current())
        try:
            with self.emulated.stream(self.stream) if self.emulated is not None else torch.cuda.stream(self.stream):
                yield
        finally:
            self._outer.pop()

    def _current(self) -> Any:
        return self.emulated.current_stream() if self.emulated is not None else torch.cuda.current_stream(self.device)

    def compute_stream(self) -> Any:
        """The stream compute issues on: the current stream, or inside this side stream's own
        ``context()`` the one that was current when it was entered (ordering the side stream after
        the current one there would order it after itself: nothing)."""
        current = self._current()
        if current == self.stream and self._outer:
            return self._outer[-1]
        return current

    def hold(self, t: torch.Tensor) -> None:
        """Meta: a copy on this stream reads ``t`` (see ``_held``)."""
        if self.device.type == "meta":
            self._held.append(t)

    def record(self) -> Any:
        if self.stream is None:
            return None
        if self.emulated is not None:
            return self.emulated.record(self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        self._last = event
        return event

    def after_compute(self) -> None:
        """Order the side stream after the compute issued so far: copies issued next read what it
        wrote, and write memory it may still be reading (a block freed to this stream)."""
        if self.stream is None:
            return
        compute = self.compute_stream()
        if self.emulated is not None:
            self.emulated.wait_stream(self.stream, compute)
        else:
            self.stream.wait_stream(compute)
            _ordered(self.stream, compute, self.device)

    def wait(self, event: Any, tensors: list[torch.Tensor]) -> None:
        """Order the compute stream after ``event`` and mark ``tensors`` (allocated on the side
        stream) used by the compute stream, so their memory is not reused by the side stream
        while compute still reads it."""
        self._held.clear()  # meta: compute is ordered after the copies, their sources may go
        if event is None or self.stream is None:
            return
        if self.emulated is not None:
            current = self.emulated.current_stream()
            self.emulated.wait_event(current, event)
        else:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            if event is self._last:  # after everything issued on the side stream so far
                _ordered(current, self.stream, self.device)
        for t in tensors:
            mark_used(t, current)


def to_host(t: torch.Tensor, pin: bool, stream: TransferStream | None = None) -> tuple[torch.Tensor, object | None]:
    """A host copy of a device tensor, pinned so later host->device copies can be asynchronous.

    With a side ``stream`` the copy is asynchronous: it is issued on the side stream after the
    work that wrote ``t``, into a buffer pinned once (no second, pinning copy), and the returned
    event marks its end: wait on it (``host_ready``) before reading the host data on the CPU.
    ``t``'s block is marked used by the side stream, so the caller may drop ``t`` at once: the
    allocator keeps the block until the copy has read it. Without a stream the copy is
    synchronous and the event is None."""
    emu = _emulated(t.device)
    if emu is not None:
        with emu.suspended():
            host = torch.empty(t.shape, dtype=t.dtype)
        if not emu.is_device_tensor(t):
            with emu.suspended():
                host.copy_(t.detach())
            return host, None
        if stream is None or stream.stream is None or not pin:
            emu.synchronize()  # a synchronous copy: the CPU waits for the device
            with emu.suspended():
                host.copy_(t.detach())
            return host, None
        stream.after_compute()  # the copy reads what the compute stream wrote
        emu.copy_to_host(t.detach(), host, stream.stream)
        mark_used(t, stream.stream)
        return host, stream.record()
    if stream is None or stream.stream is None or not pin:
        host = t.detach().to("cpu")
        return (host.pin_memory() if pin else host), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    stream.after_compute()  # the copy reads what the compute stream wrote
    with torch.cuda.stream(stream.stream):
        host.copy_(t.detach(), non_blocking=True)
    mark_used(t, stream.stream)
    return host, stream.record()


def compute_done(device: torch.device) -> object | None:
    """An event after the work issued so far on ``device``'s current (compute) stream, for the CPU
    to wait on with ``host_ready`` before it frees host memory an asynchronous copy there reads;
    None where copies are synchronous (CPU, meta)."""
    emu = _emulated(device)
    if emu is not None:
        return emu.record(emu.current_stream())
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def host_ready(event: object | None) -> None:
    """Block the CPU until an asynchronous device->host copy has landed (before reading it)."""
    if event is not None:
        event.synchronize()  # type: ignore[attr-defined]


def to_device(host: torch.Tensor, device: torch.device, stream: TransferStream | None,
              pending: object | None = None) -> torch.Tensor:
    """A device copy of ``host`` (allocated on ``stream``, or the compute stream); ``pending`` is
    the event of the device->host copy that filled it, which the host->device copy is ordered
    after. A copy on a side stream is ordered after the compute issued so far (the memory it
    gets may have been freed to that stream by compute work still reading it); the caller
    orders compute after the copy (``TransferStream.wait``) before reading the result."""
    side = stream is not None and stream.stream is not None
    emu = _emulated(device)
    if emu is not None:
        if pending is not None:
            emu.wait_event(stream.stream if side else emu.current_stream(), pending)  # type: ignore[union-attr]
        if side:
            stream.after_compute()  # type: ignore[union-attr]
        return emu.copy_to_device(host, stream.stream if side else emu.current_stream())  # type: ignore[union-attr]
    if pending is not None:
        # on the side stream the two copies are ordered already; on the compute stream wait for it
        if not side:
            torch.cuda.current_stream(device).wait_event(pending)  # type: ignore[arg-type]
        else:
            stream.stream.wait_event(pending)  # type: ignore[union-attr,arg-type]
    if side:
        stream.after_compute()  # type: ignore[union-attr]
        with torch.cuda.stream(stream.stream):  # type: ignore[union-attr]
            return host.to(device, non_blocking=host.is_pinned())
    return host.to(device, non_blocking=host.is_pinned())


def copy_into(dst: torch.Tensor, host: torch.Tensor, stream: TransferStream | None, pending: object | None = None) -> None:
    """Write ``host``'s data into ``dst``, a device tensor that already exists (memory another
    tensor just gave up, still possibly read by compute work queued before now): on ``stream``,
    ordered after the compute issued so far, so the write waits for those reads; the caller
    orders compute after the copy (``TransferStream.wait``) before reading ``dst``. Allocates
    nothing. ``pending``: the event of the device->host copy that filled ``host``."""
    side = stream is not None and stream.stream is not None
    emu = _emulated(dst.device) if dst.device.type != "meta" else None
    if emu is not None and emu.is_device_tensor(dst):
        if pending is not None:
            emu.wait_event(stream.stream if side else emu.current_stream(), pending)  # type: ignore[union-attr]
        if not side:
            emu.synchronize()
            with emu.suspended():
                dst.copy_(host)
            return
        stream.after_compute()  # type: ignore[union-attr]
        emu.copy_into(dst, host, stream.stream)  # type: ignore[union-attr]
        return
    if dst.device.type != "cuda":
        dst.copy_(host)  # meta (shape only) and a CPU "device": nothing is queued
        return
    if pending is not None:
        (stream.stream if side else torch.cuda.current_stream(dst.device)).wait_event(pending)  # type: ignore[union-attr,arg-type]
    if side:
        stream.after_compute()  # type: ignore[union-attr]
        with torch.cuda.stream(stream.stream):  # type: ignore[union-attr]
            dst.copy_(host, non_blocking=host.is_pinned())
        return
    dst.copy_(host, non_blocking=host.is_pinned())


def synchronize(device: torch.device) -> None:
    """The CPU waits for ``device``'s queued work (the emulated device's queues run)."""
    emu = _emulated(device)
    if emu is not None:
        emu.synchronize()
    elif device.type == "meta":
        for s in list(_META_STREAMS):
            s._held.clear()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
