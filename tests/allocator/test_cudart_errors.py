"""The CUDA backend leaves CUDA's error state as torch expects (``pytest -m cuda_stub``, CPU only).

The CUDA runtime keeps a per-thread *last error*: every call that returns an error code also
records it there, ``cudaGetLastError`` returns it and resets it, ``cudaPeekAtLastError`` returns it
as it is. torch checks every kernel launch with ``cudaGetLastError`` (``C10_CUDA_KERNEL_LAUNCH_CHECK``),
so an error another library left behind is raised by torch's next kernel as its own — even
``cudaErrorNotReady``, which ``cudaEventQuery`` answers for an event whose work is still running
(torch itself clears it there: ``c10/cuda/CUDAEvent.h``). The static allocator polls its deferred
frees with ``cudaEventQuery`` on every allocation, so a pending free left ``"CUDA error: device not
ready"`` for the next kernel.

These tests build a stub ``libcudart`` with those rules (C, the system compiler), point a private
copy of ``libxema_alloc.so`` at it (``StaticAllocator("cuda", cudart=...)``: the path the backend
dlopens), drive the arena's deferred frees and the failures of each runtime call the backend
makes, and check what torch would see afterwards: ``cudaPeekAtLastError() == cudaSuccess`` on the
thread that called the allocator.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from xema_ray.allocator.runtime import StaticAllocator, default_library_path

pytestmark = pytest.mark.cuda_stub

#: cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorInvalidDevice, cudaErrorNotReady
OOM, INVALID, BAD_DEVICE, NOT_READY = 2, 1, 101, 600
A, B = 0x1000, 0x2000  # two streams (the stub never dereferences a stream)

STUB = r"""
#include <stdlib.h>
#include <string.h>

/* the runtime's rule: an error returned is also the calling thread's last error */
static __thread int last_error = 0;
static int fail(int code) { last_error = code; return code; }

static int current_device = 0;
static int events_ready = 0;
struct stub_event { int done; };

/* test controls: the next call of `name` fails with `code`; events complete or not */
static char fail_name[64];
static int fail_code = 0;
static int queries = 0;
void stub_fail_next(const char* name, int code) { strncpy(fail_name, name, 63); fail_code = code; }
void stub_set_events_ready(int ready) { events_ready = ready; }
int stub_queries(void) { return queries; }
static int injected(const char* name) {
  if (fail_code != 0 && strcmp(fail_name, name) == 0) {
    int code = fail_code;
    fail_code = 0;
    return fail(code);
  }
  return 0;
}

int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
int cudaPeekAtLastError(void) { return last_error; }
const char* cudaGetErrorString(int code) { return code == 600 ? "device not ready" : "stub error"; }

int cudaGetDevice(int* d) { int rc = injected("cudaGetDevice"); if (rc) return rc; *d = current_device; return 0; }
int cudaSetDevice(int d) { int rc = injected("cudaSetDevice"); if (rc) return rc; current_device = d; return 0; }
int cudaMalloc(void** p, size_t n) {
  int rc = injected("cudaMalloc"); if (rc) return rc;
  *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
  return *p ? 0 : fail(2);
}
int cudaFree(void* p) { int rc = injected("cudaFree"); if (rc) return rc; free(p); return 0; }
int cudaEventCreateWithFlags(void** ev, unsigned int flags) {
  (void)flags;
  int rc = injected("cudaEventCreateWithFlags"); if (rc) return rc;
  *ev = calloc(1, sizeof(struct stub_event));
  return 0;
}
int cudaEventRecord(void* ev, void* stream) { (void)ev; (void)stream; return injected("cudaEventRecord"); }
int cudaEventQuery(void* ev) {
  ++queries;
  int rc = injected("cudaEventQuery"); if (rc) return rc;
  return (events_ready || ((struct stub_event*)ev)->done) ? 0 : fail(600);
}
int cudaEventSynchronize(void* ev) {
  int rc = injected("cudaEventSynchronize"); if (rc) return rc;
  ((struct stub_event*)ev)->done = 1;
  return 0;
}
int cudaEventDestroy(void* ev) { int rc = injected("cudaEventDestroy"); if (rc) return rc; free(ev); return 0; }
"""


class Stub:
    """The stub runtime as the test drives it (the same instance the allocator dlopened)."""

    def __init__(self, path: Path) -> None:
        self.c = ctypes.CDLL(str(path))
        self.c.stub_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self.c.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self.c.cudaEventQuery.argtypes = [ctypes.c_void_p]
        self.c.cudaEventDestroy.argtypes = [ctypes.c_void_p]

    def peek(self) -> int:
        """What torch's next kernel-launch check would read on this thread."""
        return int(self.c.cudaPeekAtLastError())

    def fail_next(self, name: str, code: int) -> None:
        self.c.stub_fail_next(name.encode(), code)

    def events_ready(self, ready: bool) -> None:
        self.c.stub_set_events_ready(int(ready))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The stub runtime and a private copy of the allocator library (its own process-wide state:
    the backend loads a runtime once per library instance, so other tests never meet the stub)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) on PATH to build the stub libcudart")
    d = tmp_path_factory.mktemp("cudart_stub")
    (d / "stub.c").write_text(STUB)
    stub = d / "libcudart.so.99"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(stub), str(d / "stub.c")], check=True,
                   capture_output=True, text=True)
    lib = d / "libxema_alloc_stubbed.so"
    shutil.copy(default_library_path(), lib)
    return stub, lib


@pytest.fixture
def env(built: tuple[Path, Path]) -> Iterator[tuple[StaticAllocator, Stub]]:
    stub_path, lib = built
    stub = Stub(stub_path)
    alloc = StaticAllocator("cuda", library=lib, cudart=stub_path)
    stub.events_ready(False)
    alloc.reserve(0, 1 << 16, device=0)
    yield alloc, stub
    stub.fail_next("", 0)
    stub.events_ready(True)
    alloc.poll(device=0)
    assert alloc.stats(device=0).live_blocks == 0
    alloc.set_limit(0, device=0)
    alloc.release(device=0)
    stub.c.cudaGetLastError()


def _pending_free(alloc: StaticAllocator, size: int = 4096) -> int:
    """A block allocated on stream A, used by stream B, freed: pending until B passes an event."""
    p = alloc.malloc(size, device=0, stream=A)
    assert alloc.mark_used(p, B, device=0)
    alloc.free(p, device=0, stream=A)
    assert alloc.stats(device=0).pending_blocks == 1
    return p


def test_the_stub_keeps_the_last_error_as_the_runtime_does(env: tuple[StaticAllocator, Stub]) -> None:
    """The stub answers an unfinished event with cudaErrorNotReady and leaves it set, as the
    runtime does: what the allocator has to clear."""
    _, stub = env
    ev = ctypes.c_void_p()
    assert stub.c.cudaEventCreateWithFlags(ctypes.byref(ev), 2) == 0
    assert stub.c.cudaEventQuery(ev) == NOT_READY
    assert stub.peek() == NOT_READY and stub.peek() == NOT_READY  # peeking does not reset it
    assert stub.c.cudaGetLastError() == NOT_READY and stub.peek() == 0  # reading it does
    stub.c.cudaEventDestroy(ev)


def test_polling_a_pending_free_not_ready_leaves_no_error(env: tuple[StaticAllocator, Stub]) -> None:
    alloc, stub = env
    _pending_free(alloc)
    queries = stub.c.stub_queries()
    assert alloc.poll(device=0) == 0  # stream B has not passed the event
    assert stub.c.stub_queries() > queries and stub.peek() == 0
    # every allocation polls the pending frees first
    q = alloc.malloc(4096, device=0, stream=A)
    assert alloc.stats(device=0).pending_blocks == 1 and stub.peek() == 0
    # the stream-ordered release polls too
    alloc.stream_ordered(B, A, device=0)
    assert stub.peek() == 0
    alloc.free(q, device=0, stream=A)
    stub.events_ready(True)
    assert alloc.poll(device=0) == 1 and stub.peek() == 0
    assert alloc.stats(device=0).pending_blocks == 0


@pytest.mark.parametrize("call, code", [
    ("cudaEventQuery", INVALID),          # a query that fails outright frees the block
    ("cudaEventDestroy", INVALID),        # the event of a released block
])
def test_a_failed_event_call_while_polling_leaves_no_error(env: tuple[StaticAllocator, Stub], call: str,
                                                           code: int) -> None:
    alloc, stub = env
    _pending_free(alloc)
    if call == "cudaEventDestroy":
        stub.events_ready(True)
    stub.fail_next(call, code)
    assert alloc.poll(device=0) == 1
    assert stub.peek() == 0


@pytest.mark.parametrize("call", ["cudaEventCreateWithFlags", "cudaEventRecord"])
def test_a_free_whose_event_cannot_be_recorded_leaves_no_error(env: tuple[StaticAllocator, Stub], call: str) -> None:
    alloc, stub = env
    p = alloc.malloc(4096, device=0, stream=A)
    assert alloc.mark_used(p, B, device=0)
    stub.fail_next(call, INVALID)
    alloc.free(p, device=0, stream=A)  # freed at once: nothing would ever say stream B moved on
    assert alloc.stats(device=0).pending_blocks == 0 and stub.peek() == 0


def test_out_of_memory_after_waiting_on_pending_frees_leaves_no_error(env: tuple[StaticAllocator, Stub]) -> None:
    """The out-of-memory path waits on the pending frees' events (cudaEventSynchronize), then asks
    the driver: a failed wait and a refused cudaMalloc are both cleared."""
    alloc, stub = env
    alloc.set_limit(1 << 16, device=0)  # no room beside the arena: the driver is refused by the limit
    _pending_free(alloc, 1 << 16)  # the whole dynamic region, pending
    stub.fail_next("cudaEventSynchronize", INVALID)
    q = alloc.malloc(4096, device=0, stream=A)  # the wait failed: the block was freed anyway
    after_wait = stub.peek()
    alloc.free(q, device=0, stream=A)
    assert after_wait == 0
    alloc.set_limit(0, device=0)
    stub.fail_next("cudaMalloc", OOM)
    with pytest.raises(MemoryError):
        alloc.malloc(1 << 20, device=0, stream=A)  # past the dynamic region, the driver refuses
    assert stub.peek() == 0


def test_a_failed_driver_free_leaves_no_error(env: tuple[StaticAllocator, Stub]) -> None:
    alloc, stub = env
    p = alloc.malloc(1 << 20, device=0, stream=A)  # larger than the dynamic region: a driver block
    assert alloc.stats(device=0).driver_active_bytes == 1 << 20
    stub.fail_next("cudaFree", INVALID)
    alloc.free(p, device=0, stream=A)
    assert stub.peek() == 0


def test_a_refused_device_switch_leaves_no_error(env: tuple[StaticAllocator, Stub]) -> None:
    """torch passes the device explicitly; the backend switches to it and back around each call."""
    alloc, stub = env
    stub.fail_next("cudaSetDevice", BAD_DEVICE)
    alloc.reserve(0, 1 << 12, device=1)
    assert stub.peek() == 0
    alloc.release(device=1)
