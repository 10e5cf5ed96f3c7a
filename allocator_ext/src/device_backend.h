// Where the runtime allocator's memory comes from: the CUDA driver (cudaMalloc/cudaFree reached
// through dlopen of libcudart, so no CUDA headers or link-time dependency) or host memory (the
// CPU stand-in that runs the same arena logic in tests). Declarations only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace xema::runtime {

// A point in one stream's work, for stream-ordered frees: `seq` on the host backend (the
// emulated streams report their progress), a cudaEvent_t in `handle` on the CUDA backend.
struct StreamEvent {
  uintptr_t stream = 0;
  uint64_t seq = 0;
  void* handle = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Both return false / nullptr on failure and never throw; `error` says why.
  virtual void* allocate(std::size_t bytes, int device, std::string& error) noexcept = 0;
  virtual bool deallocate(void* ptr, int device, std::string& error) noexcept = 0;
  virtual const char* name() const noexcept = 0;
  // Records an event on `stream` after the work issued on it so far; false (with `error`) when
  // none could be recorded.
  virtual bool record_event(uintptr_t stream, int device, StreamEvent& out, std::string& error) noexcept = 0;
  // 1: the stream has passed the event; 0: not yet; < 0: the query failed.
  virtual int query_event(const StreamEvent& event, int device) noexcept = 0;
  virtual void destroy_event(StreamEvent& event, int device) noexcept = 0;
  // Blocks until the stream has passed the event where the backend can (the out-of-memory path,
  // as the caching allocator synchronises its streams' events before giving up); as query_event.
  virtual int wait_event(const StreamEvent& event, int device) noexcept { return query_event(event, device); }
};

class HostBackend final : public Backend {
 public:
  void* allocate(std::size_t bytes, int device, std::string& error) noexcept override;
  bool deallocate(void* ptr, int device, std::string& error) noexcept override;
  const char* name() const noexcept override { return "host"; }
  bool record_event(uintptr_t stream, int device, StreamEvent& out, std::string& error) noexcept override;
  int query_event(const StreamEvent& event, int device) noexcept override;
  void destroy_event(StreamEvent& /*event*/, int /*device*/) noexcept override {}
  // Host "streams" are the CPU emulation's (xema_ray/platforms/async_host.py): it reports how
  // much work it issued and completed on each. A stream it never reported has none queued.
  void set_stream_progress(uintptr_t stream, uint64_t issued, uint64_t completed) noexcept;

 private:
  struct Progress {
    uint64_t issued = 0;
    uint64_t completed = 0;
  };
  std::mutex streams_mutex_;
  std::unordered_map<uintptr_t, Progress> streams_;
  // Large regions (arenas sized for a real GPU: tens of GB on a CPU test machine) are mapped
  // without reserving swap, so a replay that only computes offsets never needs the memory.
  std::mutex mapped_mutex_;
  std::unordered_map<void*, std::size_t> mapped_;
};

class CudaBackend final : public Backend {
 public:
  // Loads libcudart once; later calls are no-ops. An explicit path wins over the search.
  bool load(const char* path, std::string& error) noexcept;
  void* allocate(std::size_t bytes, int device, std::string& error) noexcept override;
  bool deallocate(void* ptr, int device, std::string& error) noexcept override;
  const char* name() const noexcept override { return "cuda"; }
  bool record_event(uintptr_t stream, int device, StreamEvent& out, std::string& error) noexcept override;
  int query_event(const StreamEvent& event, int device) noexcept override;
  void destroy_event(StreamEvent& event, int device) noexcept override;
  int wait_event(const StreamEvent& event, int device) noexcept override;

 private:
  // cudaError_t is an int-sized enum; 0 is cudaSuccess.
  using MallocFn = int (*)(void**, std::size_t);
  using FreeFn = int (*)(void*);
  using GetDeviceFn = int (*)(int*);
  using SetDeviceFn = int (*)(int);
  using ErrorStringFn = const char* (*)(int);
  using EventCreateFn = int (*)(void**, unsigned int);
  using EventRecordFn = int (*)(void*, void*);
  using EventQueryFn = int (*)(void*);
  using EventSynchronizeFn = int (*)(void*);
  using EventDestroyFn = int (*)(void*);
  using GetLastErrorFn = int (*)();

  bool ensure_loaded(std::string& error) noexcept;
  std::string describe(int code) const noexcept;
  // Every runtime call goes through this: a failed call (cudaErrorNotReady from an event query
  // included) leaves its code as the calling thread's last error, which torch's next
  // kernel-launch check (cudaGetLastError) would raise as its own; so it is read back here and
  // the code returned. The allocator reports failures through its return values instead.
  int cleared(int rc) const noexcept;

  std::mutex load_mutex_;
  void* handle_ = nullptr;
  MallocFn malloc_ = nullptr;
  FreeFn free_ = nullptr;
  GetDeviceFn get_device_ = nullptr;
  SetDeviceFn set_device_ = nullptr;
  ErrorStringFn error_string_ = nullptr;
  EventCreateFn event_create_ = nullptr;
  EventRecordFn event_record_ = nullptr;
  EventQueryFn event_query_ = nullptr;
  EventDestroyFn event_destroy_ = nullptr;
  EventSynchronizeFn event_synchronize_ = nullptr;
  GetLastErrorFn get_last_error_ = nullptr;
};

}  // namespace xema::runtime
