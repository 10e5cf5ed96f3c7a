"""Out of memory in the runtime allocator, on the host arena: an allocation that the static region,
the dynamic region and the driver (within the device's limit) all refuse is recorded with the
sizes and fails alone; the arena and the next allocation are unharmed. ``xema_torch_malloc``,
torch's alloc_fn, throws where ``xema_malloc`` returns NULL: checked here by a C++ caller that
calls it as torch's ``CUDAPluggableAllocator`` does (through ``std::function``, catching
``std::exception`` as torch's Python bindings do)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.host_arena import alloc, device  # noqa: F401 - fixtures
from xema_ray.allocator import solve_arrays
from xema_ray.allocator.oom import ArenaOutOfMemory, out_of_memory_errors
from xema_ray.allocator.runtime import AllocatorError, StaticAllocator, default_library_path

#: issue #35: CUDA's out-of-memory semantics, modelled on the CPU (with the stream tests: ``-m streams``)
pytestmark = pytest.mark.streams

KIB = 1024
HEADER_DIR = Path(__file__).resolve().parents[2] / "allocator_ext" / "src"


def test_error_raised_if_every_region_and_the_limit_refuse(alloc: StaticAllocator, device: int) -> None:
    layout = solve_arrays(np.array([64 * KIB, 64 * KIB]), np.array([0, 1]), np.array([2, 3]))
    alloc.reserve(layout.reserved_bytes, 32 * KIB, device=device)
    alloc.set_limit(alloc.stats(device=device).reserved_bytes + 16 * KIB, device=device)  # 16 KiB of driver room
    assert alloc.out_of_memory(device=device).events == 0
    with alloc.armed(layout.replay_plan(), device=device):
        a = alloc.malloc(64 * KIB, device=device)  # planned: the static region
        with pytest.raises(torch.cuda.OutOfMemoryError) as e:  # the class users' code catches, on the host arena too
            alloc.malloc(200 * KIB, device=device)  # a planned index of the wrong size: dynamic 32 KiB, driver 16 KiB
        b = alloc.malloc(24 * KIB, device=device)  # the next allocation is served (the dynamic region)
    assert isinstance(e.value, ArenaOutOfMemory) and isinstance(e.value, MemoryError)
    rec = e.value.record
    assert rec.events == 1 and rec.requested_bytes == 200 * KIB and rec.rounded_bytes == 200 * KIB
    assert rec.static_region_bytes == layout.reserved_bytes
    assert rec.static_free_bytes == layout.reserved_bytes - 64 * KIB
    assert rec.dynamic_free_bytes == rec.dynamic_largest_free_bytes == rec.dynamic_region_bytes == 32 * KIB
    assert rec.limit_bytes - rec.reserved_bytes == 16 * KIB and rec.armed and rec.plan_cursor == 2
    assert rec.free_bytes == 32 * KIB + 16 * KIB  # the static region's free bytes serve planned allocations only
    assert "asked 204800 bytes" in str(e.value) and "limit" in str(e.value)
    assert alloc.out_of_memory(device=device) == rec  # the record stays until the next refusal
    stats = alloc.stats(device=device)
    assert stats.live_blocks == 2 and stats.active_bytes == 64 * KIB + 24 * KIB and stats.driver_allocs == 0
    alloc.free(a, device=device)
    alloc.free(b, device=device)
    with alloc.armed(layout.replay_plan(), device=device):  # the arena serves the next request as planned
        c = alloc.malloc(64 * KIB, device=device)
        d = alloc.malloc(64 * KIB, device=device)
    assert alloc.stats(device=device).planned_hits == 3
    alloc.free(c, device=device)
    alloc.free(d, device=device)
    assert alloc.out_of_memory(device=device).events == 1


def test_error_raised_if_torch_reports_a_refusal_as_a_runtime_error(alloc: StaticAllocator, device: int) -> None:
    """What torch raises for a refusal of ``xema_torch_malloc`` (a plain ``RuntimeError`` with the
    library's message) becomes ``ArenaOutOfMemory`` with the record inside
    ``out_of_memory_errors``; a RuntimeError with no refusal behind it passes unchanged."""
    alloc.reserve(0, 16 * KIB, device=device)
    alloc.set_limit(alloc.stats(device=device).reserved_bytes, device=device)

    def torch_op() -> None:  # the op's allocation refused: torch raises the library's message
        if not alloc._lib.c.xema_malloc(64 * KIB, device, None):
            raise RuntimeError("xema_alloc: " + alloc._lib.c.xema_last_error().decode())

    with pytest.raises(torch.cuda.OutOfMemoryError) as e, out_of_memory_errors(alloc, device):
        torch_op()
    assert isinstance(e.value, ArenaOutOfMemory) and isinstance(e.value.__cause__, RuntimeError)
    assert e.value.record == alloc.out_of_memory(device=device) and e.value.record.requested_bytes == 64 * KIB
    assert str(e.value).startswith("xema_alloc: ")
    with pytest.raises(RuntimeError, match="not memory") as other, out_of_memory_errors(alloc, device):
        raise RuntimeError("not memory")
    assert not isinstance(other.value, torch.cuda.OutOfMemoryError)


def test_error_raised_if_a_reserve_or_resize_exceeds_the_limit(alloc: StaticAllocator, device: int) -> None:
    alloc.set_limit(1 << 20, device=device)
    with pytest.raises(AllocatorError, match="out of memory.*limit of 1048576 bytes"):
        alloc.reserve(1 << 20, 4096, device=device)
    alloc.reserve(512 * KIB, 64 * KIB, device=device)
    with pytest.raises(AllocatorError, match="limit"):
        alloc.resize_static(1 << 20, device=device)
    assert alloc.stats(device=device).static_region_bytes == 512 * KIB  # back at its old size
    alloc.set_limit(0, device=device)  # no cap: the driver alone decides
    alloc.resize_static(1 << 20, device=device)
    assert alloc.stats(device=device).static_region_bytes == 1 << 20


def test_the_record_counts_frees_another_stream_still_uses(alloc: StaticAllocator, device: int) -> None:
    # a block freed on the compute stream but used by a side stream is held until that stream
    # passes (stream-ordered frees): out of memory first waits for it where the backend can (CUDA
    # events); the host's emulated streams advance only from Python, so here it stays pending
    side = 0x0E0E0E00 + device  # an emulated side stream of this test only
    alloc.reserve(0, 64 * KIB, device=device)
    alloc.set_limit(alloc.stats(device=device).reserved_bytes, device=device)  # no room beside the arena
    alloc.host_stream_progress(side, 1, 0)  # one piece of work queued on it, not run
    a = alloc.malloc(48 * KIB, device=device)
    assert alloc.mark_used(a, side, device=device)
    alloc.free(a, device=device)
    assert alloc.stats(device=device).pending_free_bytes == 48 * KIB
    with pytest.raises(ArenaOutOfMemory) as e:
        alloc.malloc(48 * KIB, device=device)
    assert e.value.record.pending_free_bytes == 48 * KIB
    assert "49152 bytes freed but still in use by another stream" in str(e.value)
    alloc.host_stream_progress(side, 1, 1)  # the side stream ran: the block is free again
    b = alloc.malloc(48 * KIB, device=device)
    assert alloc.stats(device=device).pending_free_bytes == 0
    alloc.free(b, device=device)


_HARNESS = r"""
// Calls xema_torch_malloc as torch's CUDAPluggableAllocator does: through a std::function, in C++
// that catches std::exception (torch's Python bindings turn it into RuntimeError).
#include <cstdio>
#include <exception>
#include <functional>
#include "xema_alloc.h"

int main() {
  std::function<void*(size_t, int, void*)> alloc_fn = xema_torch_malloc;
  const int device = 3;
  if (xema_init(XEMA_BACKEND_HOST, nullptr) != XEMA_OK) return 10;
  if (xema_reserve(device, 0, 4096) != XEMA_OK) return 11;
  if (xema_set_limit(device, 4096 + 8192) != XEMA_OK) return 12;
  void* ok = alloc_fn(2048, device, nullptr);
  if (ok == nullptr) return 13;
  try {
    alloc_fn(1 << 20, device, nullptr);
    std::puts("no exception");
    return 14;
  } catch (const std::exception& e) {
    std::printf("caught: %s\n", e.what());
  }
  void* next = alloc_fn(4096, device, nullptr);  // the next allocation: the driver, within the limit
  xema_oom oom{};
  if (xema_get_oom(device, &oom, sizeof oom) != XEMA_OK) return 15;
  std::printf("events %llu asked %llu next %d\n", (unsigned long long)oom.events,
              (unsigned long long)oom.requested_bytes, next != nullptr);
  if (xema_malloc(1 << 20, device, nullptr) != nullptr) return 16;  // the C ABI: NULL, no exception
  xema_free(ok, 0, device, nullptr);
  xema_free(next, 0, device, nullptr);
  return xema_release(device) == XEMA_OK ? 0 : 17;
}
"""


def test_torch_malloc_throws_where_malloc_returns_null(tmp_path: Path) -> None:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH (the package's own build needs one)")
    lib = default_library_path()
    src = tmp_path / "harness.cpp"
    src.write_text(_HARNESS)
    exe = tmp_path / "harness"
    subprocess.run([cxx, "-std=c++17", "-O0", f"-I{HEADER_DIR}", str(src), "-o", str(exe), str(lib),
                    f"-Wl,-rpath,{lib.parent}"], check=True, capture_output=True, timeout=120)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("caught: xema_alloc: device 3 out of memory: asked 1048576 bytes"), lines
    assert "dynamic region 2048 of 4096 bytes free" in lines[0] and "limit of 12288 bytes" in lines[0]
    assert lines[1] == "events 1 asked 1048576 next 1"
