// One device's memory under the static allocator: the arena (a static region at the planned
// offsets and a dynamic region with a best-fit free list, two backend allocations so the static
// one can be re-sized while the dynamic one keeps its long-lived blocks), the driver fallback,
// the loaded plans, the armed request's cursor and the statistics. Every public method takes the
// arena's own mutex, so devices never contend with each other. Declarations only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "device_backend.h"
#include "xema_alloc.h"

namespace xema::runtime {

// Per planned allocation, in the order the allocator sees them: rounded size and static offset.
struct Plan {
  std::vector<uint64_t> sizes;
  std::vector<uint64_t> offsets;
  uint64_t static_bytes_needed = 0;  // max(offset + size)
};

class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  void set_device(int device) noexcept { device_ = device; }

  // nullptr (with `error` set) when neither the arena nor the backend can serve the request.
  void* allocate(std::size_t requested, xema_stream_t stream, Backend& backend,
                 std::string& error);
  void deallocate(void* ptr, xema_stream_t stream);
  // Stream-ordered frees: `stream` uses the live block at `ptr` (besides the stream that
  // allocated it). Its free is then deferred until every such stream has passed an event
  // recorded at the free; `poll` returns the blocks whose streams have (allocate polls too).
  int mark_used(void* ptr, xema_stream_t stream, std::string& error);
  int poll();
  // `waiter` is now ordered after all work issued on `other` so far (it waited on a fresh event
  // of it): pending blocks allocated on `waiter` no longer wait for `other` (only `waiter` reuses
  // them, and its next work runs after `other`'s). Returns how many blocks that released.
  int stream_ordered(xema_stream_t waiter, xema_stream_t other);

  int reserve(uint64_t static_bytes, uint64_t dynamic_bytes, Backend& backend,
              std::string& error);
  int release(std::string& error);
  // Replaces the static region by one of `static_bytes` (0: none); refused while a static block
  // is live or a plan is armed. The dynamic region and its blocks are untouched.
  int resize_static(uint64_t static_bytes, std::string& error);

  int64_t load_plan(const uint64_t* sizes, const uint64_t* offsets, uint64_t n,
                    std::string& error);
  int unload_plan(int64_t plan_id, std::string& error);
  int arm(int64_t plan_id, xema_stream_t stream, std::string& error);
  int disarm();

  void stats(xema_stats& out);
  void reset_peaks();
  // The last allocation refused by every source (static, dynamic, driver within the limit).
  void out_of_memory(xema_oom& out);
  // Caps the backend memory held for this device (arena regions + driver blocks); 0: no cap.
  void set_limit(uint64_t limit_bytes);

  int record_start();
  int record_stop();
  int64_t record_read(xema_event* out, uint64_t capacity);

  // True while the arena is reserved or any block (arena or driver) is live.
  bool holds_memory();

 private:
  struct Live {
    uint64_t size;
    int region;
    uint64_t offset;   // within the arena (static and dynamic regions)
    Backend* backend;  // driver blocks return to the backend that made them
    uintptr_t stream;  // the stream it was allocated on
    std::vector<uintptr_t> users;  // other streams that used it (mark_used)
  };
  struct Pending {
    uintptr_t ptr;
    Live block;
    std::vector<StreamEvent> events;  // one per user stream, recorded at the free
  };
  struct DynBlock {
    uint64_t size;
    bool free;
    uint64_t stream_tag;
  };
  using FreeKey = std::tuple<uint64_t, uint64_t, uint64_t>;  // (stream tag, size, offset)

  bool static_conflict(uint64_t offset, uint64_t size) const;
  void* dynamic_allocate(uint64_t size, uint64_t stream_tag);
  void dynamic_free(uint64_t offset);
  void finish_free(uintptr_t ptr, const Live& block);
  int poll_locked();
  // The out-of-memory path: waits (where the backend can) for the streams of every pending free
  // and frees what they passed; returns how many blocks it freed.
  int drain_pending_locked();
  // Frees every pending block whose events have passed (queried, or waited for when ``wait``).
  int release_pending_locked(bool wait);
  Backend& arena_backend_or(const Live& block);
  void record(uint64_t ptr, uint64_t size, uint64_t requested, xema_stream_t stream,
              uint64_t kind, int region);
  void update_peaks();
  int static_state_error(const char* what, std::string& error) const;
  // False (with `error`) when `extra` more backend bytes would exceed the device's limit.
  bool within_limit(uint64_t extra, std::string& error) const;
  // Fills oom_ and `error` for an allocation nothing could serve; `why` is the driver's reason.
  void note_out_of_memory(uint64_t requested, uint64_t size, xema_stream_t stream,
                          const std::string& why, std::string& error);
  void free_regions();

  std::mutex mutex_;
  int device_ = 0;

  // Arena: [static_base_, + static_bytes_) is the static region, [dynamic_base_, +
  // dynamic_bytes_) the dynamic region; each its own backend allocation (nullptr when 0 bytes).
  // reserved_ is true between reserve and release, even while both regions are 0 bytes.
  bool reserved_ = false;
  char* static_base_ = nullptr;
  char* dynamic_base_ = nullptr;
  uint64_t static_bytes_ = 0;
  uint64_t dynamic_bytes_ = 0;
  Backend* arena_backend_ = nullptr;

  std::unordered_map<uintptr_t, Live> live_;
  std::map<uint64_t, uint64_t> static_live_;  // offset -> end of live static blocks (disjoint)
  std::map<uint64_t, DynBlock> dyn_blocks_;   // tiles the dynamic region, keyed by offset
  std::set<FreeKey> dyn_free_;
  std::vector<Pending> pending_;  // freed by torch, still in use by another stream

  std::unordered_map<int64_t, std::shared_ptr<const Plan>> plans_;
  int64_t next_plan_id_ = 0;
  std::shared_ptr<const Plan> armed_plan_;
  uintptr_t armed_stream_ = 0;
  uint64_t cursor_ = 0;
  bool fell_back_ = false;

  bool recording_ = false;
  std::vector<xema_event> events_;

  xema_stats stats_{};
  uint64_t limit_bytes_ = 0;
  xema_oom oom_{};
};

}  // namespace xema::runtime
