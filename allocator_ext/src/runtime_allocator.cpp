// The C ABI of libxema_alloc: thin, exception-free wrappers over one DeviceArena per device (all
// but xema_torch_malloc, torch's alloc_fn, which throws on a refusal: see there).
//
// CUDAPluggableAllocator calls plain function pointers with no context argument, so the arenas
// have to be reachable from a process-wide registry. It is created on first use and deliberately
// never destroyed: tensors are still being freed while the interpreter and torch tear down (after
// static destructors may have run), and every such free must find valid state.
#include <array>
#include <atomic>
#include <exception>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>

#include "device_arena.h"
#include "device_backend.h"
#include "xema_alloc.h"

namespace xema::runtime {
namespace {

struct Registry {
  Registry() {
    for (int d = 0; d < XEMA_MAX_DEVICES; ++d) arenas[d].set_device(d);
  }
  std::array<DeviceArena, XEMA_MAX_DEVICES> arenas;
  HostBackend host;
  CudaBackend cuda;
  std::atomic<Backend*> current{nullptr};
  std::mutex init_mutex;
};

Registry& registry() {
  static Registry* instance = new Registry();
  return *instance;
}

thread_local std::string t_last_error;

void set_error(const std::string& message) noexcept {
  try {
    t_last_error = message;
  } catch (...) {
  }
}

bool valid_device(int device) noexcept {
  if (device >= 0 && device < XEMA_MAX_DEVICES) return true;
  try {
    set_error("device " + std::to_string(device) + " out of range [0, " +
              std::to_string(XEMA_MAX_DEVICES) + ")");
  } catch (...) {
  }
  return false;
}

// Without an explicit xema_init (torch installed the allocator directly) the CUDA backend is the
// only sensible default; it loads libcudart lazily on its first allocation.
Backend& current_backend() {
  Registry& r = registry();
  Backend* b = r.current.load(std::memory_order_acquire);
  if (b != nullptr) return *b;
  Backend* expected = nullptr;
  r.current.compare_exchange_strong(expected, &r.cuda, std::memory_order_acq_rel);
  return *r.current.load(std::memory_order_acquire);
}

template <typename F>
int guarded(F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    set_error("host out of memory inside the allocator");
    return XEMA_E_NOMEM;
  } catch (const std::exception& e) {
    set_error(e.what());
    return XEMA_E_INTERNAL;
  } catch (...) {
    set_error("unknown exception inside the allocator");
    return XEMA_E_INTERNAL;
  }
}

}  // namespace
}  // namespace xema::runtime

using xema::runtime::guarded;
using xema::runtime::registry;
using xema::runtime::set_error;
using xema::runtime::valid_device;

extern "C" {

void* xema_malloc(size_t size, int device, xema_stream_t stream) {
  if (!valid_device(device)) return nullptr;
  try {
    std::string error;
    void* p = registry().arenas[device].allocate(size, stream,
                                                 xema::runtime::current_backend(), error);
    if (p == nullptr && size != 0) set_error(error);
    return p;
  } catch (...) {
    set_error("exception inside xema_malloc");
    return nullptr;
  }
}

// The only function here that throws (see xema_alloc.h): torch does not check alloc_fn's pointer
// (torch/csrc/cuda/CUDAPluggableAllocator.cpp, CUDAPluggableAllocator::malloc and ::allocate wrap
// it in a DataPtr as it is), so a refusal has to unwind. rmm's torch allocator does the same (its
// allocate throws rmm::out_of_memory); torch's bindings turn any std::exception into RuntimeError.
// Everything the arena keeps is already consistent when this throws: the refusal is recorded
// (xema_get_oom) and nothing was handed out.
void* xema_torch_malloc(size_t size, int device, xema_stream_t stream) {
  void* p = xema_malloc(size, device, stream);
  if (p != nullptr || size == 0) return p;
  throw std::runtime_error(std::string("xema_alloc: ") + xema::runtime::t_last_error);
}

void xema_free(void* ptr, size_t /*size*/, int device, xema_stream_t stream) {
  // The live table knows each block's size; torch's `size` argument is not needed.
  if (!valid_device(device)) return;
  try {
    registry().arenas[device].deallocate(ptr, stream);
  } catch (...) {
    set_error("exception inside xema_free");
  }
}

int xema_mark_used(int device, void* ptr, xema_stream_t stream) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int {
    std::string error;
    const int rc = registry().arenas[device].mark_used(ptr, stream, error);
    if (rc != XEMA_OK) set_error(error);
    return rc;
  });
}

int xema_stream_ordered(int device, xema_stream_t waiter, xema_stream_t other) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int { return registry().arenas[device].stream_ordered(waiter, other); });
}

int xema_poll(int device) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int { return registry().arenas[device].poll(); });
}

int xema_host_stream_progress(xema_stream_t stream, uint64_t issued, uint64_t completed) {
  if (completed > issued) {
    set_error("host stream progress: completed " + std::to_string(completed) + " > issued " +
              std::to_string(issued));
    return XEMA_E_INVALID;
  }
  registry().host.set_stream_progress(reinterpret_cast<uintptr_t>(stream), issued, completed);
  return XEMA_OK;
}

int xema_abi_version(void) { return XEMA_ABI_VERSION; }

const char* xema_last_error(void) { return xema::runtime::t_last_error.c_str(); }

int xema_init(int backend, const char* cudart_path) {
  return guarded([&]() -> int {
    auto& r = registry();
    xema::runtime::Backend* wanted = nullptr;
    if (backend == XEMA_BACKEND_HOST) {
      wanted = &r.host;
    } else if (backend == XEMA_BACKEND_CUDA) {
      wanted = &r.cuda;
    } else {
      set_error("unknown backend " + std::to_string(backend) + " (0 = cuda, 1 = host)");
      return XEMA_E_INVALID;
    }
    std::lock_guard<std::mutex> lock(r.init_mutex);
    xema::runtime::Backend* now = r.current.load(std::memory_order_acquire);
    if (now != nullptr && now != wanted) {
      for (int d = 0; d < XEMA_MAX_DEVICES; ++d) {
        if (r.arenas[d].holds_memory()) {
          set_error(std::string("cannot switch backend from ") + now->name() + " to " +
                    wanted->name() + ": device " + std::to_string(d) + " holds memory");
          return XEMA_E_STATE;
        }
      }
    }
    if (wanted == &r.cuda) {
      std::string error;
      if (!r.cuda.load(cudart_path, error)) {
        set_error(error);
        return XEMA_E_BACKEND;
      }
    }
    r.current.store(wanted, std::memory_order_release);
    return XEMA_OK;
  });
}

int xema_reserve(int device, uint64_t static_bytes, uint64_t dynamic_bytes) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int {
    std::string error;
    const int rc = registry().arenas[device].reserve(static_bytes, dynamic_bytes,
                                                     xema::runtime::current_backend(), error);
    if (rc != XEMA_OK) set_error(error);
    return rc;
  });
}

int xema_release(int device) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int {
    std::string error;
    const int rc = registry().arenas[device].release(error);
    if (rc != XEMA_OK) set_error(error);
    return rc;
  });
}

int xema_resize_static(int device, uint64_t static_bytes) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int {
    std::string error;
    const int rc = registry().arenas[device].resize_static(static_bytes, error);
    if (rc != XEMA_OK) set_error(error);
    return rc;
  });
}

int64_t xema_load_plan(int device, const uint64_t* sizes, const uint64_t* offsets, uint64_t n) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  int64_t id = XEMA_E_INTERNAL;
  const int rc = guarded([&]() -> int {
    std::string error;
    id = registry().arenas[device].load_plan(sizes, offsets, n, error);
    if (id < 0) set_error(error);
    return XEMA_OK;
  });
  return rc == XEMA_OK ? id : rc;
}

int xema_unload_plan(int device, int64_t plan_id) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int {
    std::string error;
    const int rc = registry().arenas[device].unload_plan(plan_id, error);
    if (rc != XEMA_OK) set_error(error);
    return rc;
  });
}

int xema_arm(int device, int64_t plan_id, xema_stream_t stream) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int {
    std::string error;
    const int rc = registry().arenas[device].arm(plan_id, stream, error);
    if (rc != XEMA_OK) set_error(error);
    return rc;
  });
}

int xema_disarm(int device) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int { return registry().arenas[device].disarm(); });
}

int xema_get_stats(int device, xema_stats* out, uint64_t out_size) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  if (out == nullptr || out_size != sizeof(xema_stats)) {
    set_error("xema_stats size mismatch: caller has " + std::to_string(out_size) +
              " bytes, library has " + std::to_string(sizeof(xema_stats)));
    return XEMA_E_INVALID;
  }
  return guarded([&]() -> int {
    registry().arenas[device].stats(*out);
    return XEMA_OK;
  });
}

int xema_get_oom(int device, xema_oom* out, uint64_t out_size) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  if (out == nullptr || out_size != sizeof(xema_oom)) {
    set_error("xema_oom size mismatch: caller has " + std::to_string(out_size) +
              " bytes, library has " + std::to_string(sizeof(xema_oom)));
    return XEMA_E_INVALID;
  }
  return guarded([&]() -> int {
    registry().arenas[device].out_of_memory(*out);
    return XEMA_OK;
  });
}

int xema_set_limit(int device, uint64_t limit_bytes) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int {
    registry().arenas[device].set_limit(limit_bytes);
    return XEMA_OK;
  });
}

int xema_reset_peaks(int device) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int {
    registry().arenas[device].reset_peaks();
    return XEMA_OK;
  });
}

int xema_record_start(int device) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int { return registry().arenas[device].record_start(); });
}

int xema_record_stop(int device) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  return guarded([&]() -> int { return registry().arenas[device].record_stop(); });
}

int64_t xema_record_read(int device, xema_event* out, uint64_t capacity) {
  if (!valid_device(device)) return XEMA_E_INVALID;
  int64_t total = 0;
  const int rc = guarded([&]() -> int {
    total = registry().arenas[device].record_read(out, capacity);
    return XEMA_OK;
  });
  return rc == XEMA_OK ? total : rc;
}

}  // extern "C"
