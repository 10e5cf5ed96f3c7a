"""Out of memory under the static allocator: what the library recorded, and the error a batch gets.

When the static region, the dynamic region and the driver (within the device's limit,
``StaticAllocator.set_limit``) all refuse an allocation, ``libxema_alloc`` records the refusal
per device (``xema_get_oom``: the bytes asked, what each region had free) and:

* ``xema_malloc`` (the C ABI, ctypes) returns NULL, which ``StaticAllocator.malloc`` raises as
  ``ArenaOutOfMemory``;
* ``xema_torch_malloc`` (what torch's ``CUDAPluggableAllocator`` is given) throws, and torch raises
  a plain ``RuntimeError`` in the op that asked (torch wraps a NULL from a pluggable allocator
  unchecked, so returning one would fault the first kernel and lose the CUDA context; and only
  its own ``c10::OutOfMemoryError`` becomes ``torch.OutOfMemoryError``).
  ``out_of_memory_errors`` turns that ``RuntimeError`` into ``ArenaOutOfMemory`` when the
  record shows a refusal.

``ArenaOutOfMemory`` is a ``torch.cuda.OutOfMemoryError`` (what users' code and serving frameworks
catch) and a ``MemoryError``, on the CUDA and the host backend alike, and carries the record. The
caller learns which allocation failed from the record's ``events`` count, not from a message:
``OutOfMemoryRecord.since(before)`` is the refusal that happened during a batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from xema_ray.allocator.runtime import StaticAllocator


class OutOfMemoryRecord(BaseModel):
    """One device's last refused allocation (``xema_oom``); ``events == 0``: none so far."""

    model_config = ConfigDict(frozen=True)

    events: int = Field(description="allocations refused so far on this device")
    requested_bytes: int = Field(description="bytes the last refused allocation asked for")
    rounded_bytes: int = Field(description="the same, rounded up to 512")
    stream: int = Field(description="its stream (cudaStream_t as an int; 0 on the host backend)")
    static_free_bytes: int = Field(description="static region bytes no live block held then")
    static_region_bytes: int = Field(description="size of the static region then")
    dynamic_free_bytes: int = Field(description="dynamic region bytes free then (any stream)")
    dynamic_largest_free_bytes: int = Field(description="the largest free dynamic block then")
    dynamic_region_bytes: int = Field(description="size of the dynamic region then")
    reserved_bytes: int = Field(description="arena + driver blocks held then")
    limit_bytes: int = Field(description="the device's limit then (0: none, the driver decided)")
    armed: bool = Field(description="a plan was armed")
    plan_cursor: int = Field(description="planned-stream allocations seen since arming")
    pending_free_bytes: int = Field(description="freed blocks another stream still used then (the allocator first "
                                                "waits for those streams where the backend can: CUDA events)")

    @property
    def free_bytes(self) -> int:
        """Bytes free for an allocation off the plan then: the dynamic region's free bytes plus
        what the limit left beside the held ones (none without a limit: the driver's own refusal
        said the device was full). The static region's free bytes serve planned allocations only."""
        headroom = max(0, self.limit_bytes - self.reserved_bytes) if self.limit_bytes else 0
        return self.dynamic_free_bytes + headroom

    def since(self, before: OutOfMemoryRecord | None) -> OutOfMemoryRecord | None:
        """This record if a refusal happened after ``before`` was read, else None."""
        seen = before.events if before is not None else 0
        return self if self.events > seen else None

    def describe(self) -> str:
        return (f"asked {self.requested_bytes} bytes; {self.free_bytes} free (dynamic region {self.dynamic_free_bytes} "
                f"of {self.dynamic_region_bytes}, largest block {self.dynamic_largest_free_bytes}"
                + (f", {max(0, self.limit_bytes - self.reserved_bytes)} under the {self.limit_bytes}-byte limit"
                   if self.limit_bytes else ", the driver refused the rest")
                + f"; static region {self.static_free_bytes} of {self.static_region_bytes} free, for planned "
                  "allocations only"
                + (f"; {self.pending_free_bytes} freed but still in use by another stream" if self.pending_free_bytes
                   else "") + ")")


class ArenaOutOfMemory(torch.cuda.OutOfMemoryError, MemoryError):
    """The static allocator refused an allocation; ``record`` says what was free.

    A ``torch.cuda.OutOfMemoryError`` (so ``except torch.cuda.OutOfMemoryError`` catches it as it
    catches the caching allocator's) and a ``MemoryError`` (what the host arena always raised)."""

    def __init__(self, message: str, record: OutOfMemoryRecord) -> None:
        super().__init__(message, record)  # both in args: it pickles
        self.record = record

    def __str__(self) -> str:
        return str(self.args[0])


@contextmanager
def out_of_memory_errors(allocator: StaticAllocator, device: int = 0) -> Iterator[None]:
    """Inside the block, an allocation ``allocator`` refused on ``device`` raises ``ArenaOutOfMemory``
    (a ``torch.cuda.OutOfMemoryError`` carrying the record) where torch raised a plain
    ``RuntimeError`` (``xema_torch_malloc``'s refusal, see the module docstring). Other errors, and
    a refusal on another device, pass unchanged.

    Args:
        allocator: the installed static allocator.
        device: the device whose refusals become ``ArenaOutOfMemory``.

    Example (GPU only):
        >>> with out_of_memory_errors(alloc):          # doctest: +SKIP
        ...     torch.empty(1 << 40, device="cuda")
        Traceback (most recent call last):
        ArenaOutOfMemory: xema_alloc: device 0 out of memory: asked 1099511627776 bytes; ...
    """
    before = allocator.out_of_memory(device=device)
    try:
        yield
    except ArenaOutOfMemory:
        raise
    except RuntimeError as e:
        record = allocator.out_of_memory(device=device).since(before)
        if record is None:
            raise
        raise ArenaOutOfMemory(str(e), record) from e
