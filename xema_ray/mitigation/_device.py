"""The only place in the mitigation library that touches ``torch.cuda``.

Transfers run on a side stream on CUDA so they overlap compute; on CPU and meta there is one
stream and the same calls are plain copies (the logic above them is identical).
(When ``xema_ray/platforms/`` lands, this module moves there.)
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


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A CPU copy of a CUDA tensor, pinned so later host->device copies can be asynchronous."""
    host = t.detach().to("cpu")
    return host.pin_memory() if pin else host


def to_device(host: torch.Tensor, device: torch.device, stream: TransferStream | None) -> torch.Tensor:
    if stream is not None and stream.stream is not None:
        with torch.cuda.stream(stream.stream):
            return host.to(device, non_blocking=host.is_pinned())
    return host.to(device, non_blocking=host.is_pinned())
