#include "device_backend.h"

#include <dlfcn.h>
#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace xema::runtime {

namespace {

constexpr std::size_t kHostAlignment = 4096;
constexpr std::size_t kMapThreshold = std::size_t{1} << 30;  // 1 GiB

// Sonames in the order torch builds use them (CUDA 13 on the GPU machine, then 12, 11). The
// RTLD_NOLOAD pass finds the copy torch already loaded, so we call into the same runtime.
constexpr const char* kCudartNames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                        "libcudart.so"};

// Restores the caller's current device: torch passes `device` explicitly and expects the
// thread's current device to be unchanged afterwards. A refused get/set is cleared from the
// thread's last error (`clear`: cudaGetLastError) like every other failed call here.
class DeviceGuard {
 public:
  DeviceGuard(int (*get)(int*), int (*set)(int), int (*clear)(), int device) : set_(set), clear_(clear) {
    if (get(&previous_) != 0) {
      forget();
      return;
    }
    if (previous_ != device) {
      switched_ = set(device) == 0;
      if (!switched_) forget();
    }
  }
  ~DeviceGuard() {
    if (switched_ && set_(previous_) != 0) forget();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  void forget() noexcept {
    if (clear_ != nullptr) (void)clear_();
  }
  int (*set_)(int);
  int (*clear_)();
  int previous_ = -1;
  bool switched_ = false;
};

}  // namespace

void* HostBackend::allocate(std::size_t bytes, int /*device*/, std::string& error) noexcept {
  // aligned_alloc requires a size that is a multiple of the alignment.
  const std::size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
  if (rounded >= kMapThreshold) {
    void* m = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      try {
        error = "host mmap of " + std::to_string(bytes) + " bytes failed";
      } catch (...) {
      }
      return nullptr;
    }
    try {
      std::lock_guard<std::mutex> lock(mapped_mutex_);
      mapped_[m] = rounded;
    } catch (...) {
      munmap(m, rounded);
      return nullptr;
    }
    return m;
  }
  void* p = std::aligned_alloc(kHostAlignment, rounded == 0 ? kHostAlignment : rounded);
  if (p == nullptr) {
    try {
      error = "host aligned_alloc of " + std::to_string(bytes) + " bytes failed";
    } catch (...) {
    }
  }
  return p;
}

bool HostBackend::deallocate(void* ptr, int /*device*/, std::string& /*error*/) noexcept {
  std::size_t mapped = 0;
  {
    std::lock_guard<std::mutex> lock(mapped_mutex_);
    auto it = mapped_.find(ptr);
    if (it != mapped_.end()) {
      mapped = it->second;
      mapped_.erase(it);
    }
  }
  if (mapped != 0) return munmap(ptr, mapped) == 0;
  std::free(ptr);
  return true;
}

bool CudaBackend::load(const char* path, std::string& error) noexcept {
  std::lock_guard<std::mutex> lock(load_mutex_);
  if (handle_ != nullptr) return true;
  try {
    if (path != nullptr && path[0] != '\0') {
      handle_ = dlopen(path, RTLD_NOW | RTLD_LOCAL);
      if (handle_ == nullptr) {
        const char* why = dlerror();
        error = std::string("dlopen(") + path + ") failed: " + (why ? why : "unknown");
        return false;
      }
    } else {
      for (int pass = 0; pass < 2 && handle_ == nullptr; ++pass) {
        for (const char* soname : kCudartNames) {
          handle_ = dlopen(soname, RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
          if (handle_ != nullptr) break;
        }
      }
      if (handle_ == nullptr) {
        error = "libcudart not found (tried libcudart.so.13/.12/.11.0/.so); pass its path";
        return false;
      }
    }
    malloc_ = reinterpret_cast<MallocFn>(dlsym(handle_, "cudaMalloc"));
    free_ = reinterpret_cast<FreeFn>(dlsym(handle_, "cudaFree"));
    get_device_ = reinterpret_cast<GetDeviceFn>(dlsym(handle_, "cudaGetDevice"));
    set_device_ = reinterpret_cast<SetDeviceFn>(dlsym(handle_, "cudaSetDevice"));
    error_string_ = reinterpret_cast<ErrorStringFn>(dlsym(handle_, "cudaGetErrorString"));
    event_create_ = reinterpret_cast<EventCreateFn>(dlsym(handle_, "cudaEventCreateWithFlags"));
    event_record_ = reinterpret_cast<EventRecordFn>(dlsym(handle_, "cudaEventRecord"));
    event_query_ = reinterpret_cast<EventQueryFn>(dlsym(handle_, "cudaEventQuery"));
    event_synchronize_ = reinterpret_cast<EventSynchronizeFn>(dlsym(handle_, "cudaEventSynchronize"));
    event_destroy_ = reinterpret_cast<EventDestroyFn>(dlsym(handle_, "cudaEventDestroy"));
    get_last_error_ = reinterpret_cast<GetLastErrorFn>(dlsym(handle_, "cudaGetLastError"));
    if (!malloc_ || !free_ || !get_device_ || !set_device_) {
      error = "libcudart lacks cudaMalloc/cudaFree/cudaGetDevice/cudaSetDevice";
      dlclose(handle_);
      handle_ = nullptr;
      return false;
    }
    return true;
  } catch (...) {
    error = "unexpected exception while loading libcudart";
    return false;
  }
}

bool CudaBackend::ensure_loaded(std::string& error) noexcept {
  {
    std::lock_guard<std::mutex> lock(load_mutex_);
    if (handle_ != nullptr) return true;
  }
  return load(nullptr, error);
}

std::string CudaBackend::describe(int code) const noexcept {
  try {
    std::string text = "cudaError " + std::to_string(code);
    if (error_string_ != nullptr) text += std::string(" (") + error_string_(code) + ")";
    return text;
  } catch (...) {
    return "cudaError";
  }
}

int CudaBackend::cleared(int rc) const noexcept {
  if (rc != 0 && get_last_error_ != nullptr) (void)get_last_error_();
  return rc;
}

void* CudaBackend::allocate(std::size_t bytes, int device, std::string& error) noexcept {
  if (!ensure_loaded(error)) return nullptr;
  DeviceGuard guard(get_device_, set_device_, get_last_error_, device);
  void* p = nullptr;
  // Out of memory is not a sticky error: cleared, the context stays usable.
  const int rc = cleared(malloc_(&p, bytes));
  if (rc != 0) {
    try {
      error = "cudaMalloc(" + std::to_string(bytes) + ") on device " + std::to_string(device) +
              " failed: " + describe(rc);
    } catch (...) {
    }
    return nullptr;
  }
  return p;
}

bool CudaBackend::deallocate(void* ptr, int device, std::string& error) noexcept {
  if (!ensure_loaded(error)) return false;
  DeviceGuard guard(get_device_, set_device_, get_last_error_, device);
  const int rc = cleared(free_(ptr));
  if (rc != 0) {
    try {
      error = "cudaFree on device " + std::to_string(device) + " failed: " + describe(rc);
    } catch (...) {
    }
    return false;
  }
  return true;
}

bool HostBackend::record_event(uintptr_t stream, int /*device*/, StreamEvent& out,
                               std::string& /*error*/) noexcept {
  std::lock_guard<std::mutex> lock(streams_mutex_);
  auto it = streams_.find(stream);
  out.stream = stream;
  out.seq = it == streams_.end() ? 0 : it->second.issued;
  out.handle = nullptr;
  return true;
}

int HostBackend::query_event(const StreamEvent& event, int /*device*/) noexcept {
  std::lock_guard<std::mutex> lock(streams_mutex_);
  auto it = streams_.find(event.stream);
  const uint64_t completed = it == streams_.end() ? 0 : it->second.completed;
  return completed >= event.seq ? 1 : 0;
}

void HostBackend::set_stream_progress(uintptr_t stream, uint64_t issued, uint64_t completed) noexcept {
  try {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    streams_[stream] = Progress{issued, completed};
  } catch (...) {
  }
}

// cudaEventDisableTiming: the event only orders, it is never timed (cheaper to record).
constexpr unsigned int kEventDisableTiming = 0x02;
// cudaErrorNotReady: the work before the event is still running.
constexpr int kCudaNotReady = 600;

bool CudaBackend::record_event(uintptr_t stream, int device, StreamEvent& out,
                               std::string& error) noexcept {
  if (!ensure_loaded(error)) return false;
  if (!event_create_ || !event_record_ || !event_query_ || !event_destroy_) {
    error = "libcudart lacks the cudaEvent functions";
    return false;
  }
  DeviceGuard guard(get_device_, set_device_, get_last_error_, device);
  void* ev = nullptr;
  int rc = cleared(event_create_(&ev, kEventDisableTiming));
  if (rc == 0) {
    rc = cleared(event_record_(ev, reinterpret_cast<void*>(stream)));
    if (rc != 0) (void)cleared(event_destroy_(ev));
  }
  if (rc != 0) {
    try {
      error = "cudaEventRecord on device " + std::to_string(device) + " failed: " + describe(rc);
    } catch (...) {
    }
    return false;
  }
  out.stream = stream;
  out.seq = 0;
  out.handle = ev;
  return true;
}

int CudaBackend::query_event(const StreamEvent& event, int device) noexcept {
  if (event.handle == nullptr || event_query_ == nullptr) return -1;
  DeviceGuard guard(get_device_, set_device_, get_last_error_, device);
  // cudaErrorNotReady is an answer, not a failure, but the runtime still records it as the
  // thread's last error: cleared, as torch's own event query does (c10/cuda/CUDAEvent.h), or the
  // next kernel launch's check reports "device not ready".
  const int rc = cleared(event_query_(event.handle));
  if (rc == 0) return 1;
  return rc == kCudaNotReady ? 0 : -1;
}

int CudaBackend::wait_event(const StreamEvent& event, int device) noexcept {
  if (event.handle == nullptr || event_synchronize_ == nullptr) return query_event(event, device);
  DeviceGuard guard(get_device_, set_device_, get_last_error_, device);
  return cleared(event_synchronize_(event.handle)) == 0 ? 1 : -1;
}

void CudaBackend::destroy_event(StreamEvent& event, int device) noexcept {
  if (event.handle == nullptr || event_destroy_ == nullptr) return;
  DeviceGuard guard(get_device_, set_device_, get_last_error_, device);
  (void)cleared(event_destroy_(event.handle));
  event.handle = nullptr;
}

}  // namespace xema::runtime
