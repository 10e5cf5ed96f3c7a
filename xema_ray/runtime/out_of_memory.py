"""A batch that ran out of device memory fails alone: ``DeviceOutOfMemory``, and how a worker tells.

Under the static allocator an allocation that the static region, the dynamic region and the
driver all refuse raises in the op that asked (``xema_ray.allocator.oom``): a ``RuntimeError``
from torch on CUDA, an ``ArenaOutOfMemory`` from the host arena on a CPU worker. The worker then
reads the allocator's out-of-memory record; if a refusal happened during the batch, the batch's
error becomes a ``DeviceOutOfMemory`` naming the entry, the bytes asked and the bytes free, and
carrying the record (the serving layer answers it with a JSON 503 and Retry-After). Under
PyTorch's caching allocator its own ``torch.OutOfMemoryError`` becomes one too, with the figures
its message gives. ``DeviceOutOfMemory`` is a ``torch.OutOfMemoryError`` (the class torch's CUDA
module exports under the same name), as the caching allocator's error is, so code that catches
that catches this one on every platform.

Nothing of the batch may outlive it: the original error's traceback holds the frames of the
pipeline and with them the batch's tensors (static-region blocks the next armed batch needs), so
``device_out_of_memory`` drops the tracebacks of the whole chain before the new error is raised.
"""

from __future__ import annotations

import re

import torch

from xema_ray.allocator.oom import OutOfMemoryRecord

_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class DeviceOutOfMemory(torch.OutOfMemoryError, MemoryError):
    """One batch asked for more device memory than was free; the worker and its arena are fine.

    A ``torch.OutOfMemoryError`` (what users' code catches) and a ``MemoryError`` (what the
    serving layer's fault checks read).

    Args:
        message: what failed, with the figures.
        entry: the plan entry whose batch it was (template key, and its layout when armed).
        requested_bytes: bytes the refused allocation asked for.
        free_bytes: bytes the allocator could still hand out then.
        device: the worker's device.
        record: the static allocator's out-of-memory record (None under PyTorch's caching allocator).
    """

    def __init__(self, message: str, entry: str, requested_bytes: int, free_bytes: int, device: str,
                 record: OutOfMemoryRecord | None = None) -> None:
        super().__init__(message, entry, requested_bytes, free_bytes, device, record)  # all in args: it pickles
        self.entry = entry
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes
        self.device = device
        self.record = record

    def __str__(self) -> str:
        return str(self.args[0])


def _forget_frames(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and every exception chained to it (see the module docstring)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__


def _torch_figure(message: str, pattern: str) -> int | None:
    m = re.search(pattern + r"\s*([0-9.]+)\s*(B|bytes|KiB|MiB|GiB|TiB)", message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def device_out_of_memory(error: BaseException, entry: str, device: str, record: OutOfMemoryRecord | None) -> DeviceOutOfMemory | None:
    """The ``DeviceOutOfMemory`` that ``error`` (raised by a batch) stands for, or None if it is another failure.

    Args:
        error: what the batch raised.
        entry: the batch's plan entry, as the error names it.
        device: the worker's device.
        record: the static allocator's out-of-memory record if it refused an allocation during the
            batch (``OutOfMemoryRecord.since``), else None.
    """
    if record is not None:
        failure = DeviceOutOfMemory(
            f"{entry}: out of device memory on {device}: {record.describe()}; the batch failed, the worker "
            "is unharmed", entry, record.requested_bytes, record.free_bytes, device, record)
    elif type(error).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError: the caching allocator's own
        text = str(error)
        asked = _torch_figure(text, r"Tried to allocate") or 0
        free = _torch_figure(text, r"of which") or 0
        failure = DeviceOutOfMemory(
            f"{entry}: out of device memory on {device}: asked {asked} bytes; {free} free (PyTorch's caching "
            "allocator, figures from its message); the batch failed, the worker is unharmed", entry, asked, free, device)
    else:
        return None
    _forget_frames(error)
    return failure
