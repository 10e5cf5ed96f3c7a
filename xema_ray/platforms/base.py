"""The platform interface: what the engine, the SP layer and the profiler may ask of a device."""

from __future__ import annotations

import contextlib
import hashlib
from abc import ABC, abstractmethod
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

PlatformName = Literal["cpu", "cuda", "meta", "emulated"]


class MemoryStats(BaseModel):
    """Memory of one worker during one batch, in bytes.

    On CUDA these are the caching allocator's counters (or, under Xema's pluggable allocator,
    which disables them, the process-level device usage from NVML). On CPU they are the
    process's resident set, the closest host analogue; ``source`` says which.
    """

    model_config = ConfigDict(frozen=True)

    source: str = Field(description="where the numbers come from, e.g. 'torch.cuda', 'nvml', 'rss'")
    peak_bytes: int = Field(ge=0, description="peak during the measured region")
    current_bytes: int = Field(ge=0, description="in use at the end of the region")
    reserved_bytes: int | None = Field(default=None, description="held by the allocator (CUDA only)")


class Platform(ABC):
    """One kind of device. Instances are stateless; a worker owns one device index."""

    name: PlatformName
    #: torch.distributed backend for SP groups on this platform
    dist_backend: str
    #: the static allocator's backend that can serve this platform's device memory ("cuda": torch's
    #: pluggable allocator; "host": the emulated asynchronous device), None: none can
    allocator_backend: str | None = None

    @abstractmethod
    def device(self, local_index: int = 0) -> torch.device:
        """The torch device a worker with this local index computes on."""

    @abstractmethod
    def set_device(self, local_index: int) -> None:
        """Bind the calling process to its device (before any allocation or NCCL group)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for queued device work, so a host clock read after it covers that work."""

    @abstractmethod
    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""

    def running(self) -> contextlib.AbstractContextManager[None]:
        """Entered around a batch's device work, on the thread that runs it (the emulated
        asynchronous device puts that work's memory in its arena; a no-op elsewhere)."""
        return contextlib.nullcontext()

    def install_allocator(self, library: str, device_index: int, locate: Any = None) -> None:
        """Serve this platform's device memory from ``library``'s ``xema_malloc``/``xema_free``
        (``allocator_backend`` "host" only; CUDA installs through torch)."""
        raise ValueError(f"the {self.name} platform cannot take a pluggable allocator")

    def release_cached_memory(self) -> None:
        """Hand memory the allocator caches but no tensor holds back to the device (no-op but on CUDA)."""

    @abstractmethod
    def memory_stats(self) -> MemoryStats:
        """Memory used since the last ``reset_peak_memory``."""

    @abstractmethod
    def hardware_name(self) -> str:
        """Human-readable device model, e.g. 'NVIDIA H200' or the CPU model string."""

    @abstractmethod
    def device_count(self) -> int:
        """Devices of this kind visible to the process."""

    def device_topology(self, local_index: int = 0) -> tuple[str, set[str]]:
        """(a device id unique on this machine, ids of the devices it has a direct fast link to).
        Default: no links (CPU workers are interchangeable)."""
        import os

        return f"{self.name}:{os.getpid()}:{local_index}", set()

    def hardware_fingerprint(self) -> str:
        """Stable key for the hardware a measurement was taken on (keys the profile store):
        device model, device count and the torch build, hashed. Two machines with the same
        GPU model and software share profiles; a different GPU or torch does not."""
        text = f"{self.name}|{self.hardware_name()}|{self.device_count()}|torch {torch.__version__}"
        return f"{self.name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
