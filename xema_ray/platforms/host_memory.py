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
copy per node: a file in ``/dev/shm`` (tmpfs: RAM, no disk) named by its app and the content's key
(``xema-<app>-<key>``). The first worker creates it under a lock and fills it; every further worker
maps the same pages and registers them in its own process (page-locking already-resident pages
allocates nothing). A worker holds a shared ``flock`` on the segment while it maps it; the last one
to close it removes the file, unless its owner keeps it (a node-level holder: a group scaled to
zero keeps its host copy). A segment whose writer died before finishing is never used: it is
written under a ``.partial`` name and renamed when complete.

The segment's pages are allocated when it is created (``posix_fallocate``): a tmpfs too small for
it, or for it beside another group's, answers ENOSPC there, a ``HostMemoryError`` naming both
sizes, instead of a SIGBUS at the first write past its end (tmpfs allocates a sparse file's pages
as they are touched). A worker waits for another one creating the same segment at most
``wait_s``; a stuck creator is named, not waited on forever. Every segment records its owner's
process (``.owner``); ``sweep`` removes the ones whose owner is gone and which no process maps (a
killed worker's or test's segment), never a live owner's.

Example:
    >>> buf = HostBuffer.private(1000)
    >>> buf.view(256, (2, 3), torch.float32).shape
    torch.Size([2, 3])
    >>> torch_pinned_bytes(1000), torch_pinned_bytes(1 << 20)
    (1024, 1048576)
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # torch is imported where a buffer is made: start-up's checks (shm_dir) run without it
    import torch

    from xema_ray.platforms.base import Platform

#: tensors in a packed buffer start at multiples of this (the CUDA allocator's granularity; DMA
#: and vectorised host copies want aligned starts)
ALIGN = 256
#: where shared segments live unless ``XEMA_SHM_DIR`` says otherwise (tmpfs on Linux)
DEFAULT_SHM_DIR = Path("/dev/shm")
#: how long a worker waits for another one creating the same segment (filling a Flux.2 offload
#: plan's 23.8 GiB from a checkpoint takes minutes; beyond this the creator is stuck)
CREATOR_WAIT_S = 900.0
#: the app a segment belongs to when none is named
DEFAULT_APP = "default"


def segment_app(app: str | None) -> str:
    """The token a Serve application's name gives its segments (``xema-<token>-<key>``): the name
    itself where it is letters, digits, '_' and '.'; else those characters with the others as '_'
    and a hash of the whole name (two apps never share a token); ``DEFAULT_APP`` for None or ''.

    Example:
        >>> segment_app("xema"), segment_app(None), segment_app("my-app")[:7]
        ('xema', 'default', 'my_app.')
    """
    if not app:
        return DEFAULT_APP
    if re.fullmatch(r"[A-Za-z0-9_.]+", app):
        return app
    import hashlib

    return re.sub(r"[^A-Za-z0-9_.]", "_", app) + "." + hashlib.sha256(app.encode()).hexdigest()[:8]


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
        import torch

        return cls(torch.empty(max(nbytes, 1), dtype=torch.uint8), nbytes)

    @property
    def shared(self) -> bool:
        return self.path is not None

    def view(self, offset: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over the buffer's bytes at ``offset``."""
        import torch

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


def _owner_path(path: Path) -> Path:
    return path.with_name(path.name + ".owner")


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc/<pid>/stat field 22): a pid and this pair name
    one process, never a later one the kernel gave the same pid. None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_owner(pid: int | None = None) -> dict[str, int | str | None]:
    """The owner record of a process (default: this one): pid and start time."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start": _process_start(pid)}


class SegmentHolder(BaseModel):
    """A node-level process that keeps the segments it owns after their last worker closes them
    (a group scaled to zero keeps its host copy, so that its wake maps it): its ``process_owner``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pid: int = Field(ge=1, description="the holder's process id")
    start: str | None = Field(description="its start time in clock ticks (a pid and this name one process)")

    @classmethod
    def this_process(cls) -> SegmentHolder:
        own = process_owner()
        return cls(pid=int(own["pid"] or 0), start=own["start"] if isinstance(own["start"], str) else None)

    def owner_record(self) -> dict[str, int | str | None]:
        """The ``.owner`` record of a segment it keeps."""
        return {"pid": self.pid, "start": self.start, "keep": 1}


def owner_alive(owner: dict[str, object]) -> bool:
    pid = owner.get("pid")
    return isinstance(pid, int) and _process_start(pid) is not None and _process_start(pid) == owner.get("start")


def _lock_within(lock: int, wait_s: float, path: Path) -> None:
    """``flock(lock, LOCK_EX)``, waiting at most ``wait_s`` for the worker holding it."""
    deadline = time.monotonic() + wait_s
    delay = 0.01
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise HostMemoryError(
                    f"{path}: another process has been creating this shared weight segment for over {wait_s:.0f} s "
                    f"(owner {_read_owner(path)}): it is stuck or dead; remove {path}.partial and {path}.lock if no "
                    "worker of this app runs") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def _read_owner(path: Path) -> dict[str, object]:
    try:
        owner = json.loads(_owner_path(path).read_text())
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def _release(path: Path, fd: int) -> None:
    """Drop this process's hold on a segment; remove the file when no other process holds it and
    its owner does not keep it (a live node-level holder other than this process)."""
    lock = os.open(_lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # no worker attaches while we decide
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only if no other worker holds it shared
        except BlockingIOError:
            pass
        else:
            owner = _read_owner(path)
            if not (owner.get("keep") and owner.get("pid") != os.getpid() and owner_alive(owner)):
                path.unlink(missing_ok=True)
                _owner_path(path).unlink(missing_ok=True)
            else:  # kept: drop the exclusive hold (the mapping shares this descriptor's lock) for the next worker
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)


class SharedSegments:
    """Named host segments one node's workers share (see the module docstring).

    Args:
        directory: where segments live (default ``shm_dir()``).
        app: the app they belong to (their names start ``xema-<app>-``): two apps on one node never
            share or sweep each other's segments.
        owner: the process that owns new segments (``process_owner()``; default this worker). A
            node-level holder's record with ``keep`` keeps a segment after its last worker closes it,
            until the holder is gone.
        wait_s: the longest wait for another worker creating the same segment.
        fallocate: allocates a new segment's pages (``os.posix_fallocate``; tests inject ENOSPC).
    """

    def __init__(self, directory: Path | None = None, app: str = DEFAULT_APP,
                 owner: dict[str, int | str | None] | None = None, wait_s: float = CREATOR_WAIT_S,
                 fallocate: Callable[[int, int, int], None] = os.posix_fallocate) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.]+", app):
            raise ValueError(f"app {app!r}: a segment's app is letters, digits, '_' and '.' (it names files)")
        self.directory = directory or shm_dir()
        self.app = app
        self.owner = owner
        self.wait_s = wait_s
        self._fallocate = fallocate

    def path(self, key: str) -> Path:
        return self.directory / f"xema-{self.app}-{key}"

    def open(self, key: str, nbytes: int) -> HostBuffer:
        """The segment named ``key``: mapped as it is when another worker made it (``filled``),
        else created empty for this worker to fill; call ``publish`` once it is filled.

        Raises:
            HostMemoryError: the file system cannot hold the segment (named with its free bytes), or
                another worker has been creating it for over ``wait_s``.
        """
        path = self.path(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sweep()
        lock = os.open(_lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # held while this worker creates and fills the segment: the others wait (bounded), then map it
            _lock_within(lock, self.wait_s, path)
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
            free = self.free_bytes()
            if free < nbytes:
                raise HostMemoryError(self._too_small(nbytes, free))
            partial = path.with_name(path.name + ".partial")
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)  # first: a sweep never takes a segment being made
            try:
                self._allocate(fd, nbytes)
            except BaseException:
                os.close(fd)
                partial.unlink(missing_ok=True)
                raise
            _owner_path(path).write_text(json.dumps(self.owner or process_owner()))
            buf = self._mapped(path, fd, nbytes)
            buf._creating = lock  # released by publish / abandon
            return buf
        except BaseException:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
            raise

    def free_bytes(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    def _too_small(self, nbytes: int, free: int) -> str:
        return (f"{self.directory}: {free:,} bytes free, a shared weight segment needs {nbytes:,} (enlarge it, e.g. "
                "docker --shm-size or mount -o remount,size=..., or point XEMA_SHM_DIR at a larger tmpfs; or "
                "share_host_weights: off)")

    def _allocate(self, fd: int, nbytes: int) -> None:
        """Every page of the new segment now: a full tmpfs answers ENOSPC here, not SIGBUS at a write."""
        if not nbytes:
            return
        try:
            self._fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise HostMemoryError(self._too_small(nbytes, self.free_bytes()) + f" [{os.strerror(e.errno)}]") from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)  # no fallocate on this file system: sparse, as checked by free_bytes

    def sweep(self) -> list[str]:
        """Remove this app's segments whose owner is gone and that no process maps (a killed
        worker's); a live owner's segment, in use or kept, stays. Returns the names removed."""
        removed = []
        for path in sorted(self.directory.glob(f"xema-{self.app}-*")):
            if path.suffix in (".lock", ".owner") or not path.is_file():
                continue
            segment = path.with_name(path.name.removesuffix(".partial"))
            if owner_alive(_read_owner(segment)):
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no process maps it
            except BlockingIOError:
                continue
            finally:
                os.close(fd)
            path.unlink(missing_ok=True)
            if path == segment:
                _owner_path(segment).unlink(missing_ok=True)
            removed.append(path.name)
        return removed

    @staticmethod
    def _mapped(path: Path, fd: int, nbytes: int) -> HostBuffer:
        mapping = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        import torch

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
        _owner_path(buf.path).unlink(missing_ok=True)
        buf._creating = None
        if buf._fd is not None:
            os.close(buf._fd)
            buf._fd = None
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
