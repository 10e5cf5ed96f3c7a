"""The runtime static allocator (paper §6.2): the Python side of ``libxema_alloc`` (the
``xema_alloc`` target of allocator_ext/).

``libxema_alloc.so`` exports the two functions ``torch.cuda.memory.CUDAPluggableAllocator`` calls
(``xema_malloc`` / ``xema_free``) and a control API. Per device it keeps one arena: the static
region, where allocation ``i`` of an armed request lands at ``offset[i]`` of its ``ReplayPlan``
when its size matches, and a dynamic region (best-fit free list) for everything else; the driver
is the last resort. The two regions are separate backend allocations, so ``resize_static`` can
follow the template being run (a worker whose templates keep different weights on the device)
while the dynamic region keeps the long-lived blocks of ``warm_up``. This module loads the library through ctypes and turns its
statistics into typed objects; ``xema_ray.allocator.cuda`` installs it into torch (explicitly,
never at import) and ``xema_ray.allocator.recording`` reads what it recorded.

With ``backend="host"`` the same library serves host memory, so the plan/fallback logic runs and
is tested on a CPU-only machine through the very same C functions.

Example (host arena, runs anywhere):
    >>> import numpy as np
    >>> from xema_ray.allocator import solve_arrays
    >>> layout = solve_arrays(np.array([1024, 512]), np.array([0, 1]), np.array([2, 3]))
    >>> alloc = StaticAllocator("host")
    >>> alloc.reserve(layout.reserved_bytes, device=7)
    >>> with alloc.armed(layout.replay_plan(), device=7) as report:
    ...     a = alloc.malloc(1000, device=7)
    ...     b = alloc.malloc(512, device=7)
    >>> report.hits, report.misses
    (2, 0)
    >>> alloc.free(a, device=7); alloc.free(b, device=7); alloc.release(device=7)
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.allocator.margins import dynamic_region_bytes
from xema_ray.allocator.oom import ArenaOutOfMemory, OutOfMemoryRecord
from xema_ray.allocator.recording import RecordedEvent, Recording
from xema_ray.allocator.solver import ReplayPlan, StaticLayout

ArenaBackend = Literal["cuda", "host"]

ABI_VERSION = 6
MAX_DEVICES = 256  # xema_alloc.h: XEMA_MAX_DEVICES (host-arena slots: one per in-process CPU worker and test)

_BACKEND_CODES: dict[str, int] = {"cuda": 0, "host": 1}
_STATUS_NAMES = {-1: "invalid argument", -2: "wrong state", -3: "out of memory", -4: "backend error", -5: "internal"}


class AllocatorError(RuntimeError):
    """A control call into libxema_alloc failed; the message is the library's."""


class AllocatorStats(BaseModel):
    """One device's statistics, read from the library (torch's own memory stats do not work under
    a pluggable allocator). Bytes are requests rounded up to 512, as the trace counts them."""

    model_config = ConfigDict(frozen=True)

    active_bytes: int = Field(description="Live bytes handed out.")
    peak_active_bytes: int = Field(description="Peak of active_bytes since the last reset_peaks.")
    reserved_bytes: int = Field(description="Arena (static + dynamic region) plus driver blocks held.")
    peak_reserved_bytes: int = Field(description="Peak of reserved_bytes since the last reset_peaks.")
    static_region_bytes: int = Field(description="Size of the static region.")
    dynamic_region_bytes: int = Field(description="Size of the dynamic region.")
    static_active_bytes: int = Field(description="Live bytes in the static region.")
    dynamic_active_bytes: int = Field(description="Live bytes in the dynamic region.")
    driver_active_bytes: int = Field(description="Live bytes obtained from the driver directly.")
    planned_hits: int = Field(description="Allocations served at their planned offset.")
    planned_misses: int = Field(description="Allocations a plan covered that fell back.")
    unplanned_allocs: int = Field(description="Allocations while disarmed, on other streams or past the plan.")
    fallback_bytes: int = Field(description="Cumulative bytes of planned_misses.")
    dynamic_allocs: int = Field(description="Allocations served by the dynamic region.")
    driver_allocs: int = Field(description="Allocations served by the driver.")
    requests_armed: int = Field(description="Times a plan was armed.")
    requests_fell_back: int = Field(description="Armed requests that stopped trusting their plan.")
    unknown_frees: int = Field(description="Frees of pointers this allocator never handed out.")
    live_blocks: int = Field(description="Blocks currently live.")
    armed: bool = Field(description="A plan is armed now.")
    fell_back: bool = Field(description="The armed request has fallen back.")
    plan_cursor: int = Field(description="Planned-stream allocations seen since arming.")
    plan_length: int = Field(description="Allocations in the armed plan (0 when disarmed).")
    arena_base: int = Field(description="Address of the static region (0 if none).")
    dynamic_base: int = Field(description="Address of the dynamic region (0 if none).")
    static_resizes: int = Field(description="resize_static calls that changed the static region.")
    pending_free_bytes: int = Field(description="Bytes freed by torch but held until the other streams that used "
                                                "them pass an event recorded at the free (part of active_bytes).")
    peak_pending_free_bytes: int = Field(description="Peak of pending_free_bytes since the last reset_peaks.")
    pending_blocks: int = Field(description="Blocks held so now.")
    deferred_frees: int = Field(description="Frees deferred so far (stream-ordered frees).")
    marked_uses: int = Field(description="mark_used calls on live blocks.")


class _CStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in AllocatorStats.model_fields]


class _COom(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in OutOfMemoryRecord.model_fields]


class _CEvent(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("ptr", "size", "requested", "stream", "kind", "region")]


@dataclass
class RequestReport:
    """How one armed request went; filled in when ``StaticAllocator.armed`` exits."""

    planned: int = 0
    hits: int = 0
    misses: int = 0
    fell_back: bool = False
    fallback_bytes: int = 0
    unplanned: int = 0


def default_library_path() -> Path:
    """Where the build put ``libxema_alloc.so``: ``xema_ray/allocator/``, next to the compiled solver.

    Found through a compiled module's ``__file__`` rather than this file's, because in an editable
    install Python sources stay in the checkout while build outputs live in site-packages.
    """
    from xema_ray.allocator import _solver

    path = Path(_solver.__file__).resolve().parent / "libxema_alloc.so"
    if not path.is_file():
        raise FileNotFoundError(f"libxema_alloc.so not found at {path}; rebuild with `pip install -e .`")
    return path


def find_loaded_cudart() -> Path | None:
    """The libcudart this process already mapped (torch's), so the allocator calls the same runtime."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        # address perms offset dev inode pathname
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and Path(parts[5].strip()).name.startswith("libcudart.so"):
            return Path(parts[5].strip())
    return None




class _Library:
    """ctypes signatures of libxema_alloc, declared once per process."""

    _lock = threading.Lock()
    _loaded: dict[Path, _Library] = {}

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        u64, i64, vp = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
        sig: dict[str, tuple[Any, list[Any]]] = {
            "xema_malloc": (vp, [ctypes.c_size_t, ctypes.c_int, vp]),
            "xema_free": (None, [vp, ctypes.c_size_t, ctypes.c_int, vp]),
            "xema_mark_used": (ctypes.c_int, [ctypes.c_int, vp, vp]),
            "xema_poll": (ctypes.c_int, [ctypes.c_int]),
            "xema_stream_ordered": (ctypes.c_int, [ctypes.c_int, vp, vp]),
            "xema_host_stream_progress": (ctypes.c_int, [vp, u64, u64]),
            "xema_abi_version": (ctypes.c_int, []),
            "xema_last_error": (ctypes.c_char_p, []),
            "xema_init": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p]),
            "xema_reserve": (ctypes.c_int, [ctypes.c_int, u64, u64]),
            "xema_release": (ctypes.c_int, [ctypes.c_int]),
            "xema_resize_static": (ctypes.c_int, [ctypes.c_int, u64]),
            "xema_load_plan": (i64, [ctypes.c_int, ctypes.POINTER(u64), ctypes.POINTER(u64), u64]),
            "xema_unload_plan": (ctypes.c_int, [ctypes.c_int, i64]),
            "xema_arm": (ctypes.c_int, [ctypes.c_int, i64, vp]),
            "xema_disarm": (ctypes.c_int, [ctypes.c_int]),
            "xema_get_stats": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(_CStats), u64]),
            "xema_reset_peaks": (ctypes.c_int, [ctypes.c_int]),
            "xema_get_oom": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(_COom), u64]),
            "xema_set_limit": (ctypes.c_int, [ctypes.c_int, u64]),
            "xema_record_start": (ctypes.c_int, [ctypes.c_int]),
            "xema_record_stop": (ctypes.c_int, [ctypes.c_int]),
            "xema_record_read": (i64, [ctypes.c_int, ctypes.POINTER(_CEvent), u64]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        self.c = lib
        version = lib.xema_abi_version()
        if version != ABI_VERSION:
            raise ImportError(f"{path} has ABI version {version}, this module speaks {ABI_VERSION}; rebuild")

    @classmethod
    def get(cls, path: Path) -> _Library:
        with cls._lock:
            if path not in cls._loaded:
                cls._loaded[path] = cls(path)
            return cls._loaded[path]

    def check(self, rc: int, what: str) -> int:
        if rc < 0:
            detail = (self.c.xema_last_error() or b"").decode(errors="replace")
            raise AllocatorError(f"{what} failed ({_STATUS_NAMES.get(rc, rc)}): {detail}")
        return rc


class StaticAllocator:
    """Control handle on the process-wide static allocator.

    The library's state is per process (torch's allocator hooks take no context), so every
    ``StaticAllocator`` of a process drives the same arenas; this object adds typed calls, the
    plan-id cache and the torch glue.

    Args:
        backend: ``"cuda"`` (cudaMalloc/cudaFree through libcudart) or ``"host"`` (host memory, for
            CPU tests). Switching is refused while any device holds memory.
        library: path of ``libxema_alloc.so``; defaults to the built one.
        cudart: path of libcudart for the CUDA backend; defaults to the one torch loaded.
    """

    def __init__(self, backend: ArenaBackend = "cuda", *, library: Path | None = None, cudart: Path | None = None) -> None:
        if backend not in _BACKEND_CODES:
            raise ValueError(f"backend must be 'cuda' or 'host', got {backend!r}")
        self._lib = _Library.get((library or default_library_path()).resolve())
        self._backend: ArenaBackend = backend
        if backend == "cuda" and cudart is None:
            cudart = find_loaded_cudart()
        path = str(cudart).encode() if cudart is not None else None
        self._lib.check(self._lib.c.xema_init(_BACKEND_CODES[backend], path), f"init({backend})")
        self._plan_ids: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()
        self._pluggable: object | None = None  # keeps torch's allocator object alive

    @property
    def backend(self) -> ArenaBackend:
        return self._backend

    @property
    def library_path(self) -> Path:
        return self._lib.path

    # ------------------------------------------------------------------ arena
    def reserve(self, static_bytes: int, dynamic_bytes: int | None = None, *, device: int = 0) -> None:
        """Allocate the device's arena: ``static_bytes`` for planned tensors, then the dynamic region.

        Args:
            static_bytes: the static region; at least the largest ``ReplayPlan.static_bytes`` armed.
            dynamic_bytes: the dynamic region; ``margins.dynamic_region_bytes(static_bytes)`` when ``None``
                (``DYNAMIC_FRACTION`` of it, paper §6.2).
            device: device index.
        """
        _check_device(device)
        if static_bytes < 0 or (dynamic_bytes is not None and dynamic_bytes < 0):
            raise ValueError(f"arena sizes must be >= 0, got static {static_bytes}, dynamic {dynamic_bytes}")
        if dynamic_bytes is None:
            dynamic_bytes = dynamic_region_bytes(static_bytes)
        self._lib.check(self._lib.c.xema_reserve(device, static_bytes, dynamic_bytes), f"reserve on device {device}")

    def reserve_for(
        self, plans: list[ReplayPlan] | list[StaticLayout], dynamic_bytes: int | None = None, *, device: int = 0
    ) -> int:
        """Reserve a static region large enough for every given plan or layout; returns its size."""
        if not plans:
            raise ValueError("reserve_for needs at least one plan or layout")
        static = max(p.static_bytes if isinstance(p, ReplayPlan) else p.reserved_bytes for p in plans)
        self.reserve(static, dynamic_bytes, device=device)
        return static

    def release(self, *, device: int = 0) -> None:
        """Return the arena; refused (``AllocatorError``) while a block in it is live."""
        _check_device(device)
        self._lib.check(self._lib.c.xema_release(device), f"release on device {device}")

    def resize_static(self, static_bytes: int, *, device: int = 0) -> None:
        """Replace the static region by one of ``static_bytes`` (0: none), the old one freed first.

        The dynamic region and its blocks stay where they are. Refused (``AllocatorError``, "wrong
        state") without an arena, while a block in the static region is live or while a plan is
        armed; "out of memory" when the backend refused the new size (the region is then back at
        its old size, or 0 bytes where even that failed: ``stats().static_region_bytes`` says).
        """
        _check_device(device)
        if static_bytes < 0:
            raise ValueError(f"static_bytes must be >= 0, got {static_bytes}")
        self._lib.check(self._lib.c.xema_resize_static(device, static_bytes), f"resize_static on device {device}")

    # ------------------------------------------------------------------ plans
    def load(self, plan: ReplayPlan | StaticLayout, *, device: int = 0) -> int:
        """Copy a plan into the library once; later calls return the cached id.

        A ``StaticLayout`` stands for its plan over every allocation (``layout.replay_plan()``).
        """
        _check_device(device)
        if isinstance(plan, StaticLayout):
            plan = plan.replay_plan()
        with self._lock:
            key = (device, plan.key)
            if key not in self._plan_ids:
                sizes = np.ascontiguousarray(plan.sizes, dtype=np.uint64)
                offsets = np.ascontiguousarray(plan.offsets, dtype=np.uint64)
                u64p = ctypes.POINTER(ctypes.c_uint64)
                rc = self._lib.c.xema_load_plan(
                    device, sizes.ctypes.data_as(u64p), offsets.ctypes.data_as(u64p), len(sizes)
                )
                self._plan_ids[key] = self._lib.check(rc, f"load_plan on device {device}")
            return self._plan_ids[key]

    def unload(self, plan: ReplayPlan, *, device: int = 0) -> None:
        """Drop a loaded plan from the library (an armed one stays usable until disarmed)."""
        _check_device(device)
        with self._lock:
            plan_id = self._plan_ids.pop((device, plan.key), None)
        if plan_id is not None:
            self._lib.check(self._lib.c.xema_unload_plan(device, plan_id), f"unload_plan on device {device}")

    def arm(self, plan: ReplayPlan | StaticLayout, *, device: int = 0, stream: int | None = None) -> None:
        """Make the next allocations on ``stream`` follow ``plan`` from its first entry.

        Args:
            plan: from ``StaticLayout.replay_plan`` (or a layout, for all its allocations); its
                static region must fit the reserved one.
            device: device index.
            stream: the stream whose allocations the plan describes (``cudaStream_t`` as an int);
                the current torch stream for the CUDA backend, 0 for the host backend.
        """
        plan_id = self.load(plan, device=device)
        handle = self._stream(device) if stream is None else stream
        self._lib.check(self._lib.c.xema_arm(device, plan_id, handle), f"arm on device {device}")

    def disarm(self, *, device: int = 0) -> None:
        """Stop following the plan. Blocks handed out under it stay valid and are freed normally."""
        _check_device(device)
        self._lib.check(self._lib.c.xema_disarm(device), f"disarm on device {device}")

    @contextmanager
    def armed(
        self, plan: ReplayPlan | StaticLayout, *, device: int = 0, stream: int | None = None
    ) -> Iterator[RequestReport]:
        """Arm ``plan`` for the body of the ``with`` block; the yielded report is filled at exit."""
        if isinstance(plan, StaticLayout):
            plan = plan.replay_plan()
        before = self.stats(device=device)
        report = RequestReport(planned=len(plan))
        self.arm(plan, device=device, stream=stream)
        try:
            yield report
        finally:
            during = self.stats(device=device)
            self.disarm(device=device)
            report.hits = during.planned_hits - before.planned_hits
            report.misses = during.planned_misses - before.planned_misses
            report.fell_back = during.fell_back
            report.fallback_bytes = during.fallback_bytes - before.fallback_bytes
            report.unplanned = during.unplanned_allocs - before.unplanned_allocs

    # ------------------------------------------------------------------ statistics
    def stats(self, *, device: int = 0) -> AllocatorStats:
        _check_device(device)
        raw = _CStats()
        self._lib.check(
            self._lib.c.xema_get_stats(device, ctypes.byref(raw), ctypes.sizeof(raw)), f"stats on device {device}"
        )
        return AllocatorStats(**{name: getattr(raw, name) for name in AllocatorStats.model_fields})

    def reset_peaks(self, *, device: int = 0) -> None:
        _check_device(device)
        self._lib.check(self._lib.c.xema_reset_peaks(device), f"reset_peaks on device {device}")

    def out_of_memory(self, *, device: int = 0) -> OutOfMemoryRecord:
        """The device's last refused allocation (``events == 0``: none so far); see ``allocator.oom``."""
        _check_device(device)
        raw = _COom()
        self._lib.check(self._lib.c.xema_get_oom(device, ctypes.byref(raw), ctypes.sizeof(raw)), f"oom on device {device}")
        return OutOfMemoryRecord(**{name: getattr(raw, name) for name in OutOfMemoryRecord.model_fields})

    def set_limit(self, limit_bytes: int, *, device: int = 0) -> None:
        """Cap the memory the backend holds for ``device`` (arena regions + driver blocks), as a
        device of that size would: a driver fallback, reserve or static resize beyond it is refused.

        Args:
            limit_bytes: the cap; 0 removes it (the driver alone decides).
            device: device index.
        """
        _check_device(device)
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self._lib.check(self._lib.c.xema_set_limit(device, limit_bytes), f"set_limit on device {device}")

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, fn: Callable[[], object] | None = None, *, device: int = 0) -> AllocatorStats:
        """Run one-off allocations (cuBLAS workspaces, attention scratch) while disarmed, so they land
        in the dynamic region instead of derailing the first armed request's plan.

        Args:
            fn: the warm-up work; for the CUDA backend, defaults to matmuls in bf16/fp16/fp32 and a
                bf16 SDPA on ``device`` (the first matmul per handle and stream allocates cuBLAS's
                workspace through the current allocator).
            device: device index.

        Returns:
            The statistics after warming up.
        """
        if self.stats(device=device).armed:
            raise AllocatorError(f"device {device} is armed; warm up before arming a plan")
        if fn is None:
            if self._backend != "cuda":
                raise ValueError("the default warm-up needs the CUDA backend; pass fn for the host backend")
            from xema_ray.allocator.cuda import cuda_warm_up_fn

            fn = cuda_warm_up_fn(device)
        fn()
        return self.stats(device=device)

    # ------------------------------------------------------------------ raw C ABI
    def malloc(self, size: int, *, device: int = 0, stream: int = 0) -> int:
        """Call ``xema_malloc`` directly (what torch does per tensor); returns the address.

        Raises ``ArenaOutOfMemory`` (a ``torch.cuda.OutOfMemoryError``) when the allocator returns NULL for a
        non-zero size: every region and the driver refused it (``out_of_memory`` has the record).
        """
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        _check_device(device)
        ptr = self._lib.c.xema_malloc(size, device, stream)
        if not ptr:
            if size == 0:
                return 0
            detail = (self._lib.c.xema_last_error() or b"").decode(errors="replace")
            raise ArenaOutOfMemory(f"xema_malloc({size}) on device {device} failed: {detail}",
                                   self.out_of_memory(device=device))
        return int(ptr)

    def free(self, ptr: int, size: int = 0, *, device: int = 0, stream: int = 0) -> None:
        """Call ``xema_free`` directly."""
        _check_device(device)
        self._lib.c.xema_free(ptr, size, device, stream)

    # ------------------------------------------------------------------ stream-ordered frees
    def mark_used(self, ptr: int, stream: int, *, device: int = 0) -> bool:
        """``stream`` uses the block at ``ptr`` (a storage's address): its free waits for that stream
        (``xema_mark_used``, the arena's ``record_stream``). False: no live block of ours starts there."""
        _check_device(device)
        return self._lib.c.xema_mark_used(device, ptr, stream) == 0

    def stream_ordered(self, waiter: int, other: int, *, device: int = 0) -> int:
        """``waiter`` waited on a fresh event of ``other``: its blocks pending for ``other`` are free; how many."""
        _check_device(device)
        return self._lib.check(self._lib.c.xema_stream_ordered(device, waiter, other), f"stream_ordered on device {device}")

    def poll(self, *, device: int = 0) -> int:
        """Return the freed blocks whose streams have moved on to the free lists; how many."""
        _check_device(device)
        return self._lib.check(self._lib.c.xema_poll(device), f"poll on device {device}")

    def host_stream_progress(self, stream: int, issued: int, completed: int) -> None:
        """Host backend: ``stream`` has ``issued`` units of work of which ``completed`` ran."""
        self._lib.check(self._lib.c.xema_host_stream_progress(stream, issued, completed), "host_stream_progress")

    # ------------------------------------------------------------------ recording
    @contextmanager
    def record(self, *, device: int = 0) -> Iterator[Recording]:
        """Record every allocation and free on ``device`` inside the block (a real run's trace)."""
        _check_device(device)
        recording = Recording()
        self._lib.check(self._lib.c.xema_record_start(device), "record_start")
        try:
            yield recording
        finally:
            self._lib.check(self._lib.c.xema_record_stop(device), "record_stop")
            total = self._lib.check(self._lib.c.xema_record_read(device, None, 0), "record_read")
            buf = (_CEvent * total)()
            self._lib.check(self._lib.c.xema_record_read(device, buf, total), "record_read")
            recording.events = [
                RecordedEvent(
                    ptr=e.ptr, size=e.size, requested=e.requested, stream=e.stream, kind=e.kind, region=e.region
                )
                for e in buf
            ]

    def _stream(self, device: int) -> int:
        if self._backend != "cuda":
            return 0
        import torch

        return int(torch.cuda.current_stream(device).cuda_stream)


def _check_device(device: int) -> None:
    if not 0 <= device < MAX_DEVICES:
        raise ValueError(f"device must be in [0, {MAX_DEVICES}), got {device}")


