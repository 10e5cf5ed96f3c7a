"""Host memory for weights: exact-size buffers, one shared copy per node, pinned by registration.

Weights a plan homes on the host (offloaded DiT blocks, a streamed or CPU text encoder) are read
by host-to-device copies that must be asynchronous, so on CUDA they live in page-locked memory.
torch's pinned allocator (``CachingHostAllocator``) rounds every block up to a power of two
(``ATen/core/CachingHostAllocator.h``, ``allocate``: ``c10::llvm::PowerOf2Ceil(size)`` for every
size up to ``pinned_max_round_threshold``, which is unbounded by default), so pinning tensor by
tensor holds up to twice the weights (``torch_pinned_bytes``). Here a component's host-homed
tensors are packed into one buffer of their exact size (tensors are views into it) and the buffer
is page-locked where it lies (``Platform.register_host``: ``cudaHostRegister`` on CUDA, nothing
elsewhere), so the process pins exactly what it holds.

Workers of one model on one node hold the same host-homed weights. ``SharedSegments`` keeps one
copy per node: a file in ``/dev/shm`` (tmpfs: RAM, no disk) named by the content's key. The first
worker creates it under a lock and fills it; every further worker maps the same pages and
registers them in its own process (page-locking already-resident pages allocates nothing). A
worker holds a shared ``flock`` on the segment while it maps it; the last one to close it removes
the file. A segment whose writer died before finishing is never used: it is written under a
``.partial`` name and renamed when complete.

Example:
    >>> buf = HostBuffer.private(1000)
    >>> buf.view(256, (2, 3), torch.float32).shape
    torch.Size([2, 3])
    >>> torch_pinned_bytes(1000), torch_pinned_bytes(1 << 20)
    (1024, 1048576)
"""

from __future__ import annotations

import fcntl
import mmap
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from xema_ray.platforms.base import Platform

#: tensors in a packed buffer start at multiples of this (the CUDA allocator's granularity; DMA
#: and vectorised host copies want aligned starts)
ALIGN = 256
#: where shared segments live unless ``XEMA_SHM_DIR`` says otherwise (tmpfs on Linux)
DEFAULT_SHM_DIR = Path("/dev/shm")


class HostMemoryError(OSError):
    """The host cannot hold a weight buffer where it was asked to (named with the bytes)."""


def torch_pinned_bytes(nbytes: int) -> int:
    """What torch's pinned allocator holds for a request of ``nbytes`` (the next power of two)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def shm_dir() -> Path:
    """The directory shared segments are created in (``XEMA_SHM_DIR``, else /dev/shm, else the temp dir)."""
    env = os.environ.get("XEMA_SHM_DIR")
    if env:
        return Path(env)
    if DEFAULT_SHM_DIR.is_dir() and os.access(DEFAULT_SHM_DIR, os.W_OK):
        return DEFAULT_SHM_DIR
    return Path(tempfile.gettempdir())


class HostBuffer:
    """One exact-size host buffer holding a component's host-homed tensors as views.

    ``private``: this process's own memory. ``SharedSegments.open``: a segment every worker of the
    node maps. ``register`` page-locks it for asynchronous copies on platforms that need it.
    """

    def __init__(self, data: torch.Tensor, nbytes: int, path: Path | None = None, fd: int | None = None,
                 mapping: mmap.mmap | None = None) -> None:
        self.data = data  # uint8, nbytes long
        self.nbytes = nbytes
        self.path = path
        self._fd = fd
        self._mapping = mapping
        self._platform: Platform | None = None
        #: the creation lock's descriptor while this worker fills a new segment (``SharedSegments.publish``)
        self._creating: int | None = None
        #: True: another worker filled the segment; its views already hold the weights
        self.filled = False

    @classmethod
    def private(cls, nbytes: int) -> HostBuffer:
        return cls(torch.empty(max(nbytes, 1), dtype=torch.uint8), nbytes)

    @property
    def shared(self) -> bool:
        return self.path is not None

    def view(self, offset: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over the buffer's bytes at ``offset``."""
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        if offset % ALIGN or offset + n > self.nbytes:
            raise ValueError(f"view of {n} bytes at offset {offset} does not fit an aligned slot of a "
                             f"{self.nbytes}-byte buffer")
        return self.data[offset:offset + n].view(dtype).view(shape)

    def register(self, platform: Platform) -> bool:
        """Page-lock the buffer for asynchronous device copies where ``platform`` needs it."""
        if self._platform is None and self.nbytes and platform.register_host(self.data.data_ptr(), self.nbytes):
            self._platform = platform
        return self._platform is not None

    @property
    def registered(self) -> bool:
        return self._platform is not None

    def close(self) -> None:
        """Unregister; for a shared segment, release it (the last worker removes the file). Views
        handed out keep the memory mapped until they are dropped."""
        if self._platform is not None:
            self._platform.unregister_host(self.data.data_ptr())
            self._platform = None
        if self._fd is not None and self.path is not None:
            _release(self.path, self._fd)
            self._fd = None


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _release(path: Path, fd: int) -> None:
    """Drop this process's hold on a segment; remove the file when no other process holds it."""
    lock = os.open(_lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # no worker attaches while we decide
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only if no other worker holds it shared
        except BlockingIOError:
            pass
        else:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)


class SharedSegments:
    """Named host segments one node's workers share (see the module docstring)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or shm_dir()

    def path(self, key: str) -> Path:
        return self.directory / f"xema-{key}"

    def open(self, key: str, nbytes: int) -> HostBuffer:
        """The segment named ``key``: mapped as it is when another worker made it (``filled``),
        else created empty for this worker to fill; call ``publish`` once it is filled."""
        path = self.path(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        lock = os.open(_lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # held while this worker creates and fills the segment: the others wait, then map it
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                fd = os.open(path, os.O_RDWR)
                if os.fstat(fd).st_size != nbytes:
                    os.close(fd)
                    raise ValueError(f"{path}: a shared weight segment of {os.stat(path).st_size} bytes, "
                                     f"this worker expects {nbytes} (same key, other content: remove the file)")
                fcntl.flock(fd, fcntl.LOCK_SH)
                buf = self._mapped(path, fd, nbytes)
                buf.filled = True
                fcntl.flock(lock, fcntl.LOCK_UN)
                os.close(lock)
                return buf
            st = os.statvfs(self.directory)
            free = st.f_bavail * st.f_frsize
            if free < nbytes:  # tmpfs pages are allocated as they are written: past its size, a SIGBUS
                raise HostMemoryError(
                    f"{self.directory}: {free:,} bytes free, a shared weight segment needs {nbytes:,} (enlarge it, "
                    "e.g. docker --shm-size, or point XEMA_SHM_DIR at a larger tmpfs; or share_host_weights: off)")
            partial = path.with_name(path.name + ".partial")
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, nbytes)
            fcntl.flock(fd, fcntl.LOCK_SH)
            buf = self._mapped(path, fd, nbytes)
            buf._creating = lock  # released by publish / abandon
            return buf
        except BaseException:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
            raise

    @staticmethod
    def _mapped(path: Path, fd: int, nbytes: int) -> HostBuffer:
        mapping = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        data = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        return HostBuffer(data, nbytes, path=path, fd=fd, mapping=mapping)

    @staticmethod
    def publish(buf: HostBuffer) -> None:
        """The creating worker filled ``buf``: give it its name (others may map it now)."""
        lock = buf._creating
        if lock is None or buf.path is None:
            return
        os.rename(buf.path.with_name(buf.path.name + ".partial"), buf.path)
        buf._creating = None
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)

    @staticmethod
    def abandon(buf: HostBuffer) -> None:
        """Filling failed: remove the unfinished segment and let the next worker try."""
        lock = buf._creating
        if lock is None or buf.path is None:
            return
        buf.path.with_name(buf.path.name + ".partial").unlink(missing_ok=True)
        buf._creating = None
        if buf._fd is not None:
            os.close(buf._fd)
            buf._fd = None
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
