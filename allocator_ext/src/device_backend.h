// Where the runtime allocator's memory comes from: the CUDA driver (cudaMalloc/cudaFree reached
// through dlopen of libcudart, so no CUDA headers or link-time dependency) or host memory (the
// CPU stand-in that runs the same arena logic in tests). Declarations only.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>

namespace xema::runtime {

class Backend {
 public:
  virtual ~Backend() = default;
  // Both return false / nullptr on failure and never throw; `error` says why.
  virtual void* allocate(std::size_t bytes, int device, std::string& error) noexcept = 0;
  virtual bool deallocate(void* ptr, int device, std::string& error) noexcept = 0;
  virtual const char* name() const noexcept = 0;
};

class HostBackend final : public Backend {
 public:
  void* allocate(std::size_t bytes, int device, std::string& error) noexcept override;
  bool deallocate(void* ptr, int device, std::string& error) noexcept override;
  const char* name() const noexcept override { return "host"; }

 private:
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

 private:
  // cudaError_t is an int-sized enum; 0 is cudaSuccess.
  using MallocFn = int (*)(void**, std::size_t);
  using FreeFn = int (*)(void*);
  using GetDeviceFn = int (*)(int*);
  using SetDeviceFn = int (*)(int);
  using ErrorStringFn = const char* (*)(int);
  using GetLastErrorFn = int (*)();

  bool ensure_loaded(std::string& error) noexcept;
  std::string describe(int code) const noexcept;

  std::mutex load_mutex_;
  void* handle_ = nullptr;
  MallocFn malloc_ = nullptr;
  FreeFn free_ = nullptr;
  GetDeviceFn get_device_ = nullptr;
  SetDeviceFn set_device_ = nullptr;
  ErrorStringFn error_string_ = nullptr;
  GetLastErrorFn get_last_error_ = nullptr;
};

}  // namespace xema::runtime
