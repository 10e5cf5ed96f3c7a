"""Host<->device transfers off the critical path: the mitigation library's only door to ``torch.cuda``.

Transfers run on a side stream on CUDA so they overlap compute, in both directions: weights
and activations come back (host->device) while earlier blocks compute, and activations leave
(device->host) without stalling the compute stream. On CPU and meta there is one stream and
the same calls are plain copies (the logic above them is identical).
"""

from __future__ import annotations

import torch


class TransferStream:
    """A side stream for host<->device copies on CUDA; a no-op stand-in elsewhere.

    ``record()`` returns an event marking the copies issued so far; ``wait(event)`` makes the
    compute stream wait for them before it reads the copied tensors.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def context(self):  # type: ignore[no-untyped-def]
        if self.stream is None:
            import contextlib

            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event: torch.cuda.Event | None, tensors: list[torch.Tensor]) -> None:
        """Order the compute stream after ``event`` and tell the caching allocator that
        ``tensors`` (allocated on the side stream) are now used on the compute stream, so their
        memory is not reused by the side stream while compute still reads it."""
        if event is None or self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:
            t.record_stream(current)


def to_host(t: torch.Tensor, pin: bool, stream: TransferStream | None = None) -> tuple[torch.Tensor, object | None]:
    """A CPU copy of a CUDA tensor, pinned so later host->device copies can be asynchronous.

    With a side ``stream`` the copy is asynchronous: it is issued on the side stream after the
    work that wrote ``t``, into a buffer pinned once (no second, pinning copy), and the returned
    event marks its end: wait on it (``host_ready``) before reading the host data on the CPU.
    Without one the copy is synchronous and the event is None."""
    if stream is None or stream.stream is None or not pin:
        host = t.detach().to("cpu")
        return (host.pin_memory() if pin else host), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    compute = torch.cuda.current_stream(t.device)
    stream.stream.wait_stream(compute)  # the copy reads what the compute stream wrote
    with torch.cuda.stream(stream.stream):
        host.copy_(t.detach(), non_blocking=True)
    # the caller drops ``t`` now: its device memory must not be reused before the copy read it
    t.record_stream(stream.stream)
    return host, stream.record()


def host_ready(event: object | None) -> None:
    """Block the CPU until an asynchronous device->host copy has landed (before reading it)."""
    if event is not None:
        event.synchronize()  # type: ignore[attr-defined]


def to_device(host: torch.Tensor, device: torch.device, stream: TransferStream | None,
              pending: object | None = None) -> torch.Tensor:
    """A device copy of ``host``; ``pending`` is the event of the device->host copy that filled
    it, which the host->device copy is ordered after."""
    if pending is not None:
        # on the side stream the two copies are ordered already; on the compute stream wait for it
        if stream is None or stream.stream is None:
            torch.cuda.current_stream(device).wait_event(pending)  # type: ignore[arg-type]
        else:
            stream.stream.wait_event(pending)  # type: ignore[arg-type]
    if stream is not None and stream.stream is not None:
        with torch.cuda.stream(stream.stream):
            return host.to(device, non_blocking=host.is_pinned())
    return host.to(device, non_blocking=host.is_pinned())
