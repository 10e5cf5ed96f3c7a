"""CUDA's stream semantics on the CPU: an emulated asynchronous device for tests.

On the CPU and meta platforms every copy has finished before the next line runs and a freed
tensor is never read again, so a missing stream ordering or a premature free cannot show. This
device makes them show:

* **Device memory is the static allocator's arena.** Every tensor an operator creates while the
  device runs (``running()``) is moved into a block of ``libxema_alloc`` (``xema_malloc`` on the
  current stream, ``xema_free`` on the allocation stream when its storage dies: what torch's
  ``CUDAPluggableAllocator`` does), and the arena hands a freed block out again at once. Tensors
  made elsewhere (weights built at load, pinned host buffers) are host memory.
* **Side streams are queues.** A copy issued on a side stream (``TransferStream``) does not run
  when issued: it runs when something orders it, at the latest legal point — the compute stream
  waiting on an event recorded after it, the CPU synchronising that event or the device. The
  compute stream runs each operator when called (so values flow) but counts as *finished* only
  at a synchronisation, the latest a GPU may take.
* **Hazards are named.** A queued copy whose source was freed, a block handed to one stream while
  another stream's unfinished, unordered work still uses it, a compute read of a block a queued
  copy has not written yet: each raises ``StreamHazard`` ("block #12 at dynamic+0x4000 freed at
  compute event 311, read by stream side-1 at event 4"), or is recorded (``on_hazard="record"``)
  and the run goes on with the wrong bytes a GPU would have produced.

The arena learns the streams' progress through ``xema_host_stream_progress``, so its
stream-ordered frees (``xema_mark_used``) are exercised exactly as on CUDA. Only this module
knows the device is emulated: ``xema_ray.platforms.streams`` routes transfers here when it is
installed, the rest of the code sees a ``cpu`` device.

Example:
    >>> import torch
    >>> from xema_ray.allocator.runtime import StaticAllocator, default_library_path
    >>> alloc = StaticAllocator("host")
    >>> alloc.reserve(0, 1 << 20, device=63)
    >>> dev = AsyncHostDevice(str(default_library_path()), device_index=63)
    >>> with dev.installed(), dev.running():
    ...     x = torch.ones(4) * 2
    ...     dev.is_device_tensor(x)
    True
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

Policy = Literal["latest", "eager"]
OnHazard = Literal["raise", "record"]

#: the compute stream's handle: the one the static allocator's plans are armed on (host backend: 0)
COMPUTE_HANDLE = 0
_CPU = torch.device("cpu")
#: side-stream handles, unique in the process: the arena's host-stream progress table is the process's
_HANDLES = itertools.count(0x51DE0001)


class StreamHazard(RuntimeError):
    """A read, write or reuse of device memory that CUDA's stream semantics do not order."""


@dataclass(eq=False)
class Stream:
    """One emulated stream. ``issued``/``completed`` count its work; ``after[h]`` is the work of
    stream ``h`` it is ordered after (waits it made)."""

    handle: int
    name: str
    issued: int = 0
    completed: int = 0
    after: dict[int, int] = field(default_factory=dict)
    queue: deque[tuple[int, Callable[[], None]]] = field(default_factory=deque)


@dataclass(eq=False)
class Event:
    """A point in ``stream``'s work (``seq``) and what the stream was ordered after then."""

    stream: Stream
    seq: int
    after: dict[int, int]
    device: AsyncHostDevice

    def synchronize(self) -> None:
        """The CPU waits: the stream's work up to the event runs now."""
        self.device.run_until(self.stream, self.seq)


@dataclass(eq=False)
class Block:
    """A device block handed out by the arena, and who used it when."""

    id: int
    ptr: int
    size: int
    stream: Stream
    uses: dict[int, int] = field(default_factory=dict)  # stream handle -> its last event using it
    writer: tuple[Stream, int] | None = None  # a queued copy into it that has not run
    freed_at: str | None = None  # torch let go of it (the arena may still hold it: stream-ordered frees)
    reused_at: str | None = None  # the arena handed its memory out again


class _DeviceMode(TorchDispatchMode):
    """Moves every new operator output into an arena block and notes the compute stream's uses."""

    def __init__(self, device: AsyncHostDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        dev = self.device
        kwargs = kwargs or {}
        stream = dev.current_stream()
        seen: set[int] = set()
        # views and re-pointing read no bytes: only the operators that do are checked against
        # copies still queued into their inputs
        reads = not (getattr(func, "is_view", False) or func.__name__.startswith("set_"))
        for x in tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                seen.add(dev._use(x.untyped_storage().data_ptr(), stream, reading=reads))
            elif isinstance(x, torch.UntypedStorage) and x.device.type == "cpu":
                seen.add(x.data_ptr())
        out = func(*args, **kwargs)
        stream.issued += 1 if stream.handle == COMPUTE_HANDLE else 0
        moved: dict[int, torch.UntypedStorage] = {}

        def rehome(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                return t
            s = t.untyped_storage()
            p = s.data_ptr()
            if s.nbytes() == 0 or p in seen or p in dev.blocks:
                dev._use(p, stream, reading=False)
                return t
            if p not in moved:
                moved[p] = dev._allocate(s.nbytes(), stream)
                ctypes.memmove(moved[p].data_ptr(), p, s.nbytes())
            new = torch.empty(0, dtype=t.dtype).set_(moved[p], t.storage_offset(), t.size(), t.stride())
            dev._use(moved[p].data_ptr(), stream, reading=False)
            return new

        return tree_map(rehome, out)


class AsyncHostDevice:
    """The emulated device of one process (installed once, like torch's pluggable allocator).

    Args:
        library: ``libxema_alloc.so`` (device memory comes from its ``xema_malloc``/``xema_free``).
        device_index: the allocator's device index.
        locate: address -> "static+0x..."/"dynamic+0x..." (the arena's own view), for hazard messages.
        policy: "latest": side-stream work runs at the latest legal point (adversarial); "eager":
            when issued (what a synchronous device does; nothing can show).
        on_hazard: "raise" a ``StreamHazard``, or "record" it in ``hazards`` and go on.
    """

    def __init__(self, library: str, device_index: int = 0, locate: Callable[[int], str] | None = None,
                 policy: Policy = "latest", on_hazard: OnHazard = "raise") -> None:
        lib = ctypes.CDLL(library)
        vp, u64 = ctypes.c_void_p, ctypes.c_uint64
        for name, res, argtypes in (("xema_malloc", vp, [ctypes.c_size_t, ctypes.c_int, vp]),
                                    ("xema_free", None, [vp, ctypes.c_size_t, ctypes.c_int, vp]),
                                    ("xema_mark_used", ctypes.c_int, [ctypes.c_int, vp, vp]),
                                    ("xema_poll", ctypes.c_int, [ctypes.c_int]),
                                    ("xema_stream_ordered", ctypes.c_int, [ctypes.c_int, vp, vp]),
                                    ("xema_host_stream_progress", ctypes.c_int, [vp, u64, u64]),
                                    ("xema_last_error", ctypes.c_char_p, [])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, argtypes
        self._lib = lib
        self.device_index = device_index
        self.locate = locate or (lambda p: hex(p))
        self.policy: Policy = policy
        self.on_hazard: OnHazard = on_hazard
        self.compute = Stream(COMPUTE_HANDLE, "compute")
        self.streams: dict[int, Stream] = {COMPUTE_HANDLE: self.compute}
        self._ids = itertools.count(1)
        self.blocks: dict[int, Block] = {}  # live arena blocks by address
        self.freed: list[Block] = []  # freed blocks other streams' unfinished work still used
        self.hazards: list[str] = []
        self._local = threading.local()
        self._lock = threading.RLock()
        self._refs: dict[int, weakref.ref] = {}

    # ------------------------------------------------------------------ installation
    @contextlib.contextmanager
    def installed(self) -> Iterator[AsyncHostDevice]:
        """Make this the process's device for ``xema_ray.platforms.streams`` (and uninstall after)."""
        from xema_ray.platforms import streams

        previous = streams.set_emulated_device(self)
        try:
            yield self
        finally:
            try:
                with contextlib.suppress(StreamHazard):  # it is in ``hazards``; uninstalling goes on
                    self.synchronize()
            finally:
                streams.set_emulated_device(previous)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Device work on this thread: new tensors land in the arena (re-entrant)."""
        if getattr(self._local, "depth", 0):
            yield
            return  # already running on this thread
        self._local.depth = 1
        try:
            with _DeviceMode(self):
                yield
        finally:
            self._local.depth = 0

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Host work inside ``running()`` (pinned buffers are not device memory)."""
        from torch.utils._python_dispatch import _disable_current_modes

        if not getattr(self._local, "depth", 0):
            yield
            return
        with _disable_current_modes():
            yield

    # ------------------------------------------------------------------ streams and events
    def new_stream(self) -> Stream:
        with self._lock:
            s = Stream(next(_HANDLES), f"side-{len(self.streams)}")
            self.streams[s.handle] = s
            return s

    def current_stream(self) -> Stream:
        return getattr(self._local, "stream", None) or self.compute

    @contextlib.contextmanager
    def stream(self, s: Stream) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = s
        try:
            yield
        finally:
            self._local.stream = previous

    def record(self, s: Stream) -> Event:
        return Event(s, s.issued, dict(s.after), self)
    def wait_event(self, waiter: Stream, event: Event) -> None:
        """``waiter`` runs nothing more before ``event``'s work: order it after that work (and what
        that work was ordered after). For the compute stream, which runs eagerly, the work runs now."""
        with self._lock:
            if waiter is event.stream:
                return
            waiter.after[event.stream.handle] = max(waiter.after.get(event.stream.handle, 0), event.seq)
            for h, n in event.after.items():
                waiter.after[h] = max(waiter.after.get(h, 0), n)
        if event.seq == event.stream.issued:  # a fresh event: the arena may hand waiter's pending blocks back
            self._report()
            self._lib.xema_stream_ordered(self.device_index, waiter.handle, event.stream.handle)
        if waiter is self.compute or self.policy == "eager":
            self.run_until(event.stream, event.seq)
        elif event.stream is not self.compute:
            # a side stream waits on another: its next work runs after that stream's, whenever it
            # runs (a barrier in its queue keeps the order transitive at the latest legal point)
            other, seq = event.stream, event.seq
            self.enqueue(waiter, lambda: self.run_until(other, seq))

    def wait_stream(self, waiter: Stream, other: Stream) -> None:
        self.wait_event(waiter, self.record(other))
    def run_until(self, s: Stream, seq: int) -> None:
        """Run ``s``'s queued work up to ``seq`` (the latest point it may run)."""
        if s is self.compute:
            s.completed = max(s.completed, min(seq, s.issued))
            self._report()
            return
        while s.queue and s.queue[0][0] <= seq:
            n, work = s.queue.popleft()
            work()
            s.completed = n
        self._report()

    def synchronize(self) -> None:
        """The CPU waits for the whole device: every queue runs, every stream has finished."""
        for s in list(self.streams.values()):
            self.run_until(s, s.issued)
        self.compute.completed = self.compute.issued
        self._report()
        self._lib.xema_poll(self.device_index)

    def enqueue(self, s: Stream, work: Callable[[], None]) -> int:
        """Issue ``work`` on side stream ``s``; it runs when ordered. Returns its event number."""
        with self._lock:
            s.issued += 1
            seq = s.issued
            s.queue.append((seq, work))
        if self.policy == "eager":
            self.run_until(s, seq)
        return seq

    def _report(self) -> None:
        for s in self.streams.values():
            self._lib.xema_host_stream_progress(s.handle, s.issued, s.completed)

    # ------------------------------------------------------------------ memory
    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() in self.blocks
    def _event(self, s: Stream) -> str:  # noqa: D102 - "compute event 311"
        return f"{s.name} event {s.issued}"

    def hazard(self, message: str) -> None:
        """Raise (or record) a hazard: what CUDA would get wrong here."""
        self.hazards.append(message)
        if self.on_hazard == "raise":
            raise StreamHazard(message)

    def _allocate(self, nbytes: int, s: Stream) -> torch.UntypedStorage:
        with self._lock:
            self._report()
            ptr = self._lib.xema_malloc(nbytes, self.device_index, s.handle)
            if not ptr:
                detail = (self._lib.xema_last_error() or b"").decode(errors="replace")
                raise torch.OutOfMemoryError(f"emulated device {self.device_index}: {nbytes} bytes: {detail}")
            block = Block(next(self._ids), int(ptr), nbytes, s)
            try:
                self._check_reuse(block, s)
            except StreamHazard:
                self._lib.xema_free(ptr, nbytes, self.device_index, s.handle)  # nobody will hold it
                raise
            self.blocks[block.ptr] = block
        storage = torch._C._construct_storage_from_data_pointer(int(ptr), _CPU, nbytes)
        holder = torch.empty(0, dtype=torch.uint8).set_(storage)
        storage = holder.untyped_storage()
        # the storage's death is the free (torch keeps one Python object per storage)
        self._refs[block.ptr] = weakref.ref(storage, lambda _r, b=block: self._free(b))
        return storage

    def _free(self, block: Block) -> None:
        with self._lock:
            if self.blocks.get(block.ptr) is block:
                del self.blocks[block.ptr]
                self._refs.pop(block.ptr, None)
            block.freed_at = self._event(self.compute)
            if any(h != block.stream.handle for h in block.uses):
                self.freed.append(block)
            self._report()
            self._lib.xema_free(block.ptr, block.size, self.device_index, block.stream.handle)

    def _unfinished(self, uses: dict[int, int], s: Stream) -> list[tuple[Stream, int]]:
        """Uses by other streams that have not run and that ``s`` is not ordered after."""
        out = []
        for h, n in uses.items():
            u = self.streams[h]
            if u is not s and u.completed < n and s.after.get(h, 0) < n:
                out.append((u, n))
        return out

    def _check_reuse(self, block: Block, s: Stream) -> None:
        end = block.ptr + block.size
        keep = []
        for old in self.freed:
            if all(self.streams[h].completed >= n for h, n in old.uses.items() if h != old.stream.handle):
                continue  # every other stream's work on it has run: it can never conflict again
            keep.append(old)
            if old.ptr < end and block.ptr < old.ptr + old.size:
                old.reused_at = f"{self._event(s)} (block #{block.id})"
                for u, n in self._unfinished(old.uses, s):
                    self.hazard(f"block #{old.id} at {self.locate(old.ptr)} ({old.size} bytes) freed at {old.freed_at}, "
                                f"reused by stream {s.name} at {self._event(s)} while stream {u.name}'s use at its event "
                                f"{n} had not run and was not ordered before it")
        self.freed = keep

    def _use(self, ptr: int, s: Stream, reading: bool) -> int:
        block = self.blocks.get(ptr)
        if block is None:
            return ptr
        if reading and block.writer is not None:
            w, n = block.writer
            if w.completed < n:
                self.hazard(f"block #{block.id} at {self.locate(block.ptr)} read by stream {s.name} at {self._event(s)} "
                            f"before the copy into it on stream {w.name} (its event {n}) ran")
            else:
                block.writer = None
        block.uses[s.handle] = s.issued + (1 if s is self.compute else 0)
        return ptr

    def mark_used(self, t: torch.Tensor, s: Stream) -> None:
        """What ``record_stream`` is for the arena: ``s`` uses ``t``'s block; its free waits for ``s``."""
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.blocks:
            self._lib.xema_mark_used(self.device_index, ptr, s.handle)

    # ------------------------------------------------------------------ copies
    def empty(self, shape: torch.Size, dtype: torch.dtype, s: Stream) -> torch.Tensor:
        """A device tensor allocated on stream ``s``."""
        nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
        with self.suspended():
            storage = self._allocate(nbytes, s)
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def _raw(self, block: Block, like: torch.Tensor, offset: int) -> torch.Tensor:
        storage = torch._C._construct_storage_from_data_pointer(block.ptr, _CPU, block.size)
        return torch.empty(0, dtype=like.dtype).set_(storage, offset, like.size(), like.stride())

    def copy_to_host(self, src: torch.Tensor, host: torch.Tensor, s: Stream) -> None:
        """Queue ``host.copy_(src)`` on side stream ``s``. The queued copy holds the source's
        address, not the tensor: dropping the tensor frees the block as on CUDA."""
        block = self.blocks[src.untyped_storage().data_ptr()]
        offset, shape = src.storage_offset(), src.detach()
        meta = torch.empty_strided(shape.size(), shape.stride(), dtype=shape.dtype, device="meta")

        def work() -> None:
            if block.reused_at is not None:
                self.hazard(f"block #{block.id} at {self.locate(block.ptr)} ({block.size} bytes) freed at {block.freed_at} "
                            f"and handed out again at {block.reused_at}, read by stream {s.name} at {s.name} event {seq}")
                if "driver" in self.locate(block.ptr):
                    return  # the process's heap may have unmapped it: the host copy keeps its garbage
            with self.suspended():
                host.copy_(self._raw(block, meta, offset))

        with self._lock:
            seq = s.issued + 1
            block.uses[s.handle] = seq
        self.enqueue(s, work)

    def copy_to_device(self, host: torch.Tensor, s: Stream) -> torch.Tensor:
        """A device tensor allocated on ``s`` whose bytes ``host``'s are once ``s`` ran the copy."""
        dst = self.empty(host.shape, host.dtype, s)
        block = self.blocks[dst.untyped_storage().data_ptr()]
        if s is self.compute:
            with self.suspended():
                dst.copy_(host)
            s.issued += 1
            block.uses[s.handle] = s.issued
            return dst
        meta = torch.empty(host.shape, dtype=host.dtype, device="meta")

        def work() -> None:
            if block.reused_at is not None:
                self.hazard(f"block #{block.id} at {self.locate(block.ptr)} ({block.size} bytes) freed at {block.freed_at} "
                            f"and handed out again at {block.reused_at}, written by stream {s.name} at {s.name} event {seq}")
                return
            with self.suspended():
                self._raw(block, meta, 0).copy_(host)

        with self._lock:
            seq = s.issued + 1
            block.uses[s.handle] = seq
            block.writer = (s, seq)
        self.enqueue(s, work)
        return dst


    def copy_into(self, dst: torch.Tensor, host: torch.Tensor, s: Stream) -> None:
        """Queue ``dst.copy_(host)`` on side stream ``s`` into a device block that already exists
        (a slot another tensor used: the expert swap's). Writing it while another stream's use of
        it has not run and ``s`` is not ordered after that use is a hazard (CUDA would overwrite
        data still being read)."""
        block = self.blocks[dst.untyped_storage().data_ptr()]
        offset = dst.storage_offset()
        meta = torch.empty_strided(dst.size(), dst.stride(), dtype=dst.dtype, device="meta")
        with self._lock:
            for u, n in self._unfinished(block.uses, s):
                self.hazard(f"block #{block.id} at {self.locate(block.ptr)} written by stream {s.name} at "
                            f"{self._event(s)} while stream {u.name}'s use at its event {n} had not run and was not "
                            f"ordered before it")

        def work() -> None:
            with self.suspended():
                self._raw(block, meta, offset).copy_(host)

        with self._lock:
            seq = s.issued + 1
            block.uses[s.handle] = seq
            block.writer = (s, seq)
        self.enqueue(s, work)


def make_async_host_platform(policy: Policy = "latest", on_hazard: OnHazard = "raise") -> Any:
    """A ``CpuPlatform`` whose device becomes an ``AsyncHostDevice`` once an allocator is installed:
    a worker started on it with ``static_allocator=True`` installs the host arena as its device
    memory, as a CUDA worker installs the pluggable allocator.

    Example:
        >>> p = make_async_host_platform()
        >>> p.name, p.allocator_backend
        ('cpu', 'host')
    """
    from xema_ray.platforms.cpu import CpuPlatform

    class _AsyncHost(CpuPlatform):
        allocator_backend = "host"

        def __init__(self) -> None:
            self.device_emulation: AsyncHostDevice | None = None
            self._installed: contextlib.ExitStack | None = None

        def install_allocator(self, library: str, device_index: int, locate: Any = None) -> None:
            if self.device_emulation is not None:
                return
            self.device_emulation = AsyncHostDevice(library, device_index, locate, policy, on_hazard)
            self._installed = contextlib.ExitStack()
            self._installed.enter_context(self.device_emulation.installed())

        def uninstall(self) -> None:
            """Take the emulated device out of ``platforms.streams`` (after its queues ran)."""
            if self._installed is not None:
                self._installed.close()
                self._installed = None

        def running(self) -> contextlib.AbstractContextManager[None]:
            return self.device_emulation.running() if self.device_emulation is not None else contextlib.nullcontext()

        def synchronize(self) -> None:
            if self.device_emulation is not None:
                self.device_emulation.synchronize()

    return _AsyncHost()
