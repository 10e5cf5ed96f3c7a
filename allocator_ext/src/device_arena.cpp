#include "device_arena.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>

namespace xema::runtime {

namespace {

// c10/core/AllocatorConfig.h: kMinBlockSize = 512, every request is rounded up to it. Plans are
// made from traces with the same rounding, so sizes are compared after it.
constexpr uint64_t kBlock = 512;

// Tag of dynamic-region memory no stream has used yet: any stream may take it.
constexpr uint64_t kAnyStream = std::numeric_limits<uint64_t>::max();

uint64_t round_block(uint64_t bytes) { return (bytes + kBlock - 1) / kBlock * kBlock; }

}  // namespace

bool DeviceArena::static_conflict(uint64_t offset, uint64_t size) const {
  // Live static blocks are disjoint, so the one starting last before our end has the largest end
  // of all that start before it: checking it alone decides whether anything overlaps.
  auto it = static_live_.lower_bound(offset + size);
  if (it == static_live_.begin()) return false;
  --it;
  return it->second > offset;
}

void* DeviceArena::dynamic_allocate(uint64_t size, uint64_t stream_tag) {
  if (dyn_free_.empty()) return nullptr;
  // Best fit among blocks this stream freed and blocks no stream has touched. Reusing another
  // stream's freed block could race with its pending kernels (the caching allocator keeps
  // per-stream pools for the same reason), so those are never candidates.
  auto candidate = [&](uint64_t tag) {
    auto it = dyn_free_.lower_bound(FreeKey{tag, size, 0});
    return (it != dyn_free_.end() && std::get<0>(*it) == tag) ? it : dyn_free_.end();
  };
  auto own = candidate(stream_tag);
  auto fresh = candidate(kAnyStream);
  auto pick = own;
  if (pick == dyn_free_.end() ||
      (fresh != dyn_free_.end() && std::get<1>(*fresh) < std::get<1>(*own))) {
    pick = fresh;
  }
  if (pick == dyn_free_.end()) {
    // Last try before the driver: one of this stream's free blocks together with untouched
    // neighbours. (Freed blocks never merge with untouched memory on free, or one free would hand
    // the whole untouched region to that stream.)
    for (auto it = dyn_free_.lower_bound(FreeKey{stream_tag, 0, 0});
         it != dyn_free_.end() && std::get<0>(*it) == stream_tag; ++it) {
      auto block = dyn_blocks_.find(std::get<2>(*it));
      auto next = std::next(block);
      const bool take_next = next != dyn_blocks_.end() && next->second.free &&
                             next->second.stream_tag == kAnyStream;
      const bool take_prev = block != dyn_blocks_.begin() && std::prev(block)->second.free &&
                             std::prev(block)->second.stream_tag == kAnyStream;
      const uint64_t total = block->second.size + (take_next ? next->second.size : 0) +
                             (take_prev ? std::prev(block)->second.size : 0);
      if (total < size) continue;
      dyn_free_.erase(it);
      if (take_next) {
        dyn_free_.erase(FreeKey{kAnyStream, next->second.size, next->first});
        block->second.size += next->second.size;
        dyn_blocks_.erase(next);
      }
      if (take_prev) {
        auto prev = std::prev(block);
        dyn_free_.erase(FreeKey{kAnyStream, prev->second.size, prev->first});
        prev->second.size += block->second.size;
        prev->second.stream_tag = stream_tag;
        dyn_blocks_.erase(block);
        block = prev;
      }
      pick = dyn_free_.insert(FreeKey{stream_tag, block->second.size, block->first}).first;
      break;
    }
  }
  if (pick == dyn_free_.end()) return nullptr;

  const uint64_t offset = std::get<2>(*pick);
  dyn_free_.erase(pick);
  DynBlock& block = dyn_blocks_.at(offset);
  if (block.size - size >= kBlock) {
    const uint64_t rest = block.size - size;
    dyn_blocks_.emplace(offset + size, DynBlock{rest, true, block.stream_tag});
    dyn_free_.insert(FreeKey{block.stream_tag, rest, offset + size});
    block.size = size;
  }
  block.free = false;
  block.stream_tag = stream_tag;
  return dynamic_base_ + offset;
}

void DeviceArena::dynamic_free(uint64_t offset) {
  auto it = dyn_blocks_.find(offset);
  if (it == dyn_blocks_.end()) return;
  it->second.free = true;
  auto next = std::next(it);
  // Coalesce only with free neighbours of the same stream (see dynamic_allocate for why).
  if (next != dyn_blocks_.end() && next->second.free &&
      next->second.stream_tag == it->second.stream_tag) {
    dyn_free_.erase(FreeKey{next->second.stream_tag, next->second.size, next->first});
    it->second.size += next->second.size;
    dyn_blocks_.erase(next);
  }
  if (it != dyn_blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && prev->second.stream_tag == it->second.stream_tag) {
      dyn_free_.erase(FreeKey{prev->second.stream_tag, prev->second.size, prev->first});
      prev->second.size += it->second.size;
      dyn_blocks_.erase(it);
      it = prev;
    }
  }
  dyn_free_.insert(FreeKey{it->second.stream_tag, it->second.size, it->first});
}

void DeviceArena::update_peaks() {
  stats_.peak_active_bytes = std::max(stats_.peak_active_bytes, stats_.active_bytes);
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
}

void DeviceArena::record(uint64_t ptr, uint64_t size, uint64_t requested, xema_stream_t stream,
                         uint64_t kind, int region) {
  if (!recording_) return;
  events_.push_back(xema_event{ptr, size, requested, reinterpret_cast<uintptr_t>(stream), kind,
                               static_cast<uint64_t>(region)});
}

void* DeviceArena::allocate(std::size_t requested, xema_stream_t stream, Backend& backend,
                            std::string& error) {
  if (requested == 0) return nullptr;
  if (requested > std::numeric_limits<uint64_t>::max() - kBlock) {
    error = "request of " + std::to_string(requested) + " bytes is too large";
    return nullptr;
  }
  const uint64_t size = round_block(requested);
  std::lock_guard<std::mutex> lock(mutex_);
  poll_locked();  // blocks whose other streams have moved on are free again

  void* ptr = nullptr;
  int region = XEMA_REGION_STATIC;
  uint64_t offset = 0;
  const bool on_plan_stream =
      armed_plan_ != nullptr && reinterpret_cast<uintptr_t>(stream) == armed_stream_;
  if (on_plan_stream && cursor_ < armed_plan_->sizes.size()) {
    const uint64_t index = cursor_++;
    if (!fell_back_) {
      const uint64_t planned = armed_plan_->offsets[index];
      // Size mismatch means the run diverged from the trace; a conflict means an earlier tenant
      // of this range is still alive. Either way the rest of the plan cannot be trusted.
      if (armed_plan_->sizes[index] == size && !static_conflict(planned, size)) {
        static_live_.emplace(planned, planned + size);
        ptr = static_base_ + planned;
        offset = planned;
        ++stats_.planned_hits;
      } else {
        fell_back_ = true;
        ++stats_.requests_fell_back;
      }
    }
    if (ptr == nullptr) {
      ++stats_.planned_misses;
      stats_.fallback_bytes += size;
    }
  } else {
    ++stats_.unplanned_allocs;
  }

  Backend* owner = arena_backend_;
  std::string why;
  // The dynamic region, then the driver; once more after waiting for the pending frees' streams
  // (memory they hold is the device's, and the caching allocator too synchronises before failing).
  for (int attempt = 0; ptr == nullptr && attempt < 2; ++attempt) {
    if (attempt == 1 && (pending_.empty() || drain_pending_locked() == 0)) break;
    const uint64_t tag = reinterpret_cast<uintptr_t>(stream);
    ptr = dynamic_allocate(size, tag == kAnyStream ? 0 : tag);
    if (ptr != nullptr) {
      region = XEMA_REGION_DYNAMIC;
      offset = static_cast<uint64_t>(static_cast<char*>(ptr) - dynamic_base_);
      ++stats_.dynamic_allocs;
      break;
    }
    if (within_limit(size, why)) ptr = backend.allocate(size, device_, why);
    if (ptr != nullptr) {
      region = XEMA_REGION_DRIVER;
      owner = &backend;
      ++stats_.driver_allocs;
      stats_.reserved_bytes += size;
    }
  }
  if (ptr == nullptr) {
    note_out_of_memory(requested, size, stream, why, error);
    return nullptr;
  }

  live_.emplace(reinterpret_cast<uintptr_t>(ptr),
                Live{size, region, offset, owner, reinterpret_cast<uintptr_t>(stream), {}});
  stats_.active_bytes += size;
  switch (region) {
    case XEMA_REGION_STATIC:
      stats_.static_active_bytes += size;
      break;
    case XEMA_REGION_DYNAMIC:
      stats_.dynamic_active_bytes += size;
      break;
    default:
      stats_.driver_active_bytes += size;
      break;
  }
  ++stats_.live_blocks;
  update_peaks();
  record(reinterpret_cast<uintptr_t>(ptr), size, requested, stream, 0, region);
  return ptr;
}

void DeviceArena::deallocate(void* ptr, xema_stream_t stream) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == live_.end()) {
    // Never ours (or freed twice): touching it could corrupt someone else's memory, so count it
    // and leave it alone.
    ++stats_.unknown_frees;
    return;
  }
  Live block = std::move(it->second);
  live_.erase(it);
  --stats_.live_blocks;
  if (!block.users.empty()) {
    // Another stream used it: its work may still read or write the block, which the next tenant
    // (on any stream) must not see. Keep it until each such stream has passed an event recorded
    // now, after that work (what the caching allocator does for record_stream).
    Pending pending{reinterpret_cast<uintptr_t>(ptr), std::move(block), {}};
    std::string error;
    for (uintptr_t user : pending.block.users) {
      StreamEvent event;
      if (!arena_backend_or(pending.block).record_event(user, device_, event, error)) break;
      pending.events.push_back(event);
    }
    if (pending.events.size() == pending.block.users.size()) {
      stats_.pending_free_bytes += pending.block.size;
      stats_.peak_pending_free_bytes =
          std::max(stats_.peak_pending_free_bytes, stats_.pending_free_bytes);
      ++stats_.deferred_frees;
      ++stats_.pending_blocks;
      pending_.push_back(std::move(pending));
      return;
    }
    // No event could be recorded: nothing would ever say the stream moved on. Free at once (the
    // behaviour without stream-ordered frees) rather than leak the block.
    for (StreamEvent& e : pending.events) arena_backend_or(pending.block).destroy_event(e, device_);
    block = std::move(pending.block);
  }
  (void)stream;
  finish_free(reinterpret_cast<uintptr_t>(ptr), block);
}

Backend& DeviceArena::arena_backend_or(const Live& block) {
  return block.backend != nullptr ? *block.backend : *arena_backend_;
}

void DeviceArena::finish_free(uintptr_t ptr, const Live& block) {
  switch (block.region) {
    case XEMA_REGION_STATIC:
      static_live_.erase(block.offset);
      stats_.static_active_bytes -= block.size;
      break;
    case XEMA_REGION_DYNAMIC:
      dynamic_free(block.offset);
      stats_.dynamic_active_bytes -= block.size;
      break;
    default: {
      std::string ignored;
      block.backend->deallocate(reinterpret_cast<void*>(ptr), device_, ignored);
      stats_.driver_active_bytes -= block.size;
      stats_.reserved_bytes -= block.size;
      break;
    }
  }
  stats_.active_bytes -= block.size;
  record(ptr, block.size, block.size, reinterpret_cast<xema_stream_t>(block.stream), 1,
         block.region);
}

int DeviceArena::release_pending_locked(bool wait) {
  int released = 0;
  for (std::size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    Backend& backend = arena_backend_or(p.block);
    bool passed = true;
    for (const StreamEvent& e : p.events) {
      // a failed query or wait (< 0: a broken context) frees the block: holding it forever would leak it
      const int done = wait ? backend.wait_event(e, device_) : backend.query_event(e, device_);
      if (done == 0) {
        passed = false;
        break;
      }
    }
    if (!passed) {
      ++i;
      continue;
    }
    for (StreamEvent& e : p.events) backend.destroy_event(e, device_);
    stats_.pending_free_bytes -= p.block.size;
    --stats_.pending_blocks;
    const uintptr_t ptr = p.ptr;
    const Live block = std::move(p.block);
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    finish_free(ptr, block);
    ++released;
  }
  return released;
}

int DeviceArena::poll_locked() { return release_pending_locked(false); }

int DeviceArena::drain_pending_locked() { return release_pending_locked(true); }

int DeviceArena::poll() {
  std::lock_guard<std::mutex> lock(mutex_);
  return poll_locked();
}

int DeviceArena::stream_ordered(xema_stream_t waiter, xema_stream_t other) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uintptr_t w = reinterpret_cast<uintptr_t>(waiter);
  const uintptr_t o = reinterpret_cast<uintptr_t>(other);
  for (Pending& p : pending_) {
    // Only blocks that go back to `waiter`'s own pool: another stream's next tenant would not be
    // ordered after `other` (static blocks are the armed stream's, dynamic ones are tagged).
    // Driver blocks go back to the driver, which may hand them to any stream: they wait for
    // the events (the poll) as before.
    if (p.block.stream != w || p.block.region == XEMA_REGION_DRIVER) continue;
    Backend& backend = arena_backend_or(p.block);
    for (auto it = p.events.begin(); it != p.events.end();) {
      if (it->stream == o) {
        backend.destroy_event(*it, device_);
        it = p.events.erase(it);
      } else {
        ++it;
      }
    }
  }
  // blocks with no event left are released by the poll
  return poll_locked();
}

int DeviceArena::mark_used(void* ptr, xema_stream_t stream, std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == live_.end()) {
    // Not a block this allocator handed out (a view's interior pointer, or memory another
    // allocator owns): say so, the caller keeps the ordering some other way.
    error = "mark_used: no live block starts at this address on device " + std::to_string(device_);
    return XEMA_E_INVALID;
  }
  const uintptr_t s = reinterpret_cast<uintptr_t>(stream);
  Live& block = it->second;
  if (s != block.stream &&
      std::find(block.users.begin(), block.users.end(), s) == block.users.end()) {
    block.users.push_back(s);
  }
  ++stats_.marked_uses;
  return XEMA_OK;
}

bool DeviceArena::within_limit(uint64_t extra, std::string& error) const {
  if (limit_bytes_ == 0 || stats_.reserved_bytes + extra <= limit_bytes_) return true;
  error = "the device's limit of " + std::to_string(limit_bytes_) + " bytes leaves " +
          std::to_string(limit_bytes_ - std::min(limit_bytes_, stats_.reserved_bytes)) +
          " bytes beside the " + std::to_string(stats_.reserved_bytes) + " held";
  return false;
}

void DeviceArena::note_out_of_memory(uint64_t requested, uint64_t size, xema_stream_t stream,
                                     const std::string& why, std::string& error) {
  uint64_t dyn_free = 0;
  uint64_t dyn_largest = 0;
  for (const auto& key : dyn_free_) {
    dyn_free += std::get<1>(key);
    dyn_largest = std::max(dyn_largest, std::get<1>(key));
  }
  const uint64_t static_free = static_bytes_ - std::min(static_bytes_, stats_.static_active_bytes);
  ++oom_.events;
  oom_.requested_bytes = requested;
  oom_.rounded_bytes = size;
  oom_.stream = reinterpret_cast<uintptr_t>(stream);
  oom_.static_free_bytes = static_free;
  oom_.static_region_bytes = static_bytes_;
  oom_.dynamic_free_bytes = dyn_free;
  oom_.dynamic_largest_free_bytes = dyn_largest;
  oom_.dynamic_region_bytes = dynamic_bytes_;
  oom_.reserved_bytes = stats_.reserved_bytes;
  oom_.limit_bytes = limit_bytes_;
  oom_.armed = armed_plan_ != nullptr ? 1 : 0;
  oom_.plan_cursor = cursor_;
  oom_.pending_free_bytes = stats_.pending_free_bytes;
  error = "device " + std::to_string(device_) + " out of memory: asked " +
          std::to_string(requested) + " bytes (" + std::to_string(size) +
          " rounded); static region " + std::to_string(static_free) + " of " +
          std::to_string(static_bytes_) + " bytes free, dynamic region " +
          std::to_string(dyn_free) + " of " + std::to_string(dynamic_bytes_) +
          " bytes free (largest block " + std::to_string(dyn_largest) + ")" +
          (stats_.pending_free_bytes != 0
               ? ", " + std::to_string(stats_.pending_free_bytes) +
                     " bytes freed but still in use by another stream"
               : std::string()) +
          "; driver refused: " + (why.empty() ? std::string("no reason given") : why);
}

int DeviceArena::static_state_error(const char* what, std::string& error) const {
  if (!static_live_.empty()) {
    error = "device " + std::to_string(device_) + " static region still holds " +
            std::to_string(stats_.static_active_bytes) + " live bytes in " +
            std::to_string(static_live_.size()) + " block(s); " + what +
            " refused so their frees stay valid";
    return XEMA_E_STATE;
  }
  if (armed_plan_ != nullptr) {
    error = "device " + std::to_string(device_) + " is armed; disarm before " + what;
    return XEMA_E_STATE;
  }
  return XEMA_OK;
}

void DeviceArena::free_regions() {
  // Both regions come from arena_backend_; a failed free leaves nothing this arena can use.
  std::string ignored;
  if (static_base_ != nullptr) arena_backend_->deallocate(static_base_, device_, ignored);
  if (dynamic_base_ != nullptr) arena_backend_->deallocate(dynamic_base_, device_, ignored);
  stats_.reserved_bytes -= static_bytes_ + dynamic_bytes_;
  static_base_ = dynamic_base_ = nullptr;
  static_bytes_ = dynamic_bytes_ = 0;
  reserved_ = false;
  dyn_blocks_.clear();
  dyn_free_.clear();
  stats_.static_region_bytes = stats_.dynamic_region_bytes = 0;
  stats_.arena_base = stats_.dynamic_base = 0;
}

int DeviceArena::reserve(uint64_t static_bytes, uint64_t dynamic_bytes, Backend& backend,
                         std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  static_bytes = round_block(static_bytes);
  dynamic_bytes = round_block(dynamic_bytes);
  if (static_bytes + dynamic_bytes == 0) {
    error = "arena of 0 bytes requested";
    return XEMA_E_INVALID;
  }
  if (reserved_) {
    if (stats_.dynamic_active_bytes != 0) {
      error = "device " + std::to_string(device_) + " dynamic region still holds " +
              std::to_string(stats_.dynamic_active_bytes) +
              " live bytes; the arena cannot be re-reserved";
      return XEMA_E_STATE;
    }
    const int rc = static_state_error("re-reserving", error);
    if (rc != XEMA_OK) return rc;
    free_regions();
  }
  if (!within_limit(static_bytes + dynamic_bytes, error)) return XEMA_E_NOMEM;
  void* s = nullptr;
  if (static_bytes > 0) {
    s = backend.allocate(static_bytes, device_, error);
    if (s == nullptr) return XEMA_E_NOMEM;
  }
  void* d = nullptr;
  if (dynamic_bytes > 0) {
    d = backend.allocate(dynamic_bytes, device_, error);
    if (d == nullptr) {
      std::string ignored;
      if (s != nullptr) backend.deallocate(s, device_, ignored);
      return XEMA_E_NOMEM;
    }
  }
  reserved_ = true;
  static_base_ = static_cast<char*>(s);
  dynamic_base_ = static_cast<char*>(d);
  static_bytes_ = static_bytes;
  dynamic_bytes_ = dynamic_bytes;
  arena_backend_ = &backend;
  if (dynamic_bytes > 0) {
    dyn_blocks_.emplace(0, DynBlock{dynamic_bytes, true, kAnyStream});
    dyn_free_.insert(FreeKey{kAnyStream, dynamic_bytes, 0});
  }
  stats_.static_region_bytes = static_bytes;
  stats_.dynamic_region_bytes = dynamic_bytes;
  stats_.arena_base = reinterpret_cast<uintptr_t>(static_base_);
  stats_.dynamic_base = reinterpret_cast<uintptr_t>(dynamic_base_);
  stats_.reserved_bytes += static_bytes + dynamic_bytes;
  update_peaks();
  return XEMA_OK;
}

int DeviceArena::release(std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!reserved_) return XEMA_OK;
  poll_locked();
  if (!pending_.empty()) {
    error = "device " + std::to_string(device_) + " has " + std::to_string(pending_.size()) +
            " freed block(s) of " + std::to_string(stats_.pending_free_bytes) +
            " bytes still in use by another stream; release refused until they pass";
    return XEMA_E_STATE;
  }
  if (stats_.dynamic_active_bytes != 0) {
    error = "device " + std::to_string(device_) + " dynamic region still holds " +
            std::to_string(stats_.dynamic_active_bytes) +
            " live bytes; release refused so their frees stay valid";
    return XEMA_E_STATE;
  }
  int rc = static_state_error("releasing", error);
  if (rc != XEMA_OK) return rc;
  bool ok = true;
  if (static_base_ != nullptr) ok = arena_backend_->deallocate(static_base_, device_, error) && ok;
  static_base_ = nullptr;
  if (dynamic_base_ != nullptr) ok = arena_backend_->deallocate(dynamic_base_, device_, error) && ok;
  dynamic_base_ = nullptr;
  free_regions();
  arena_backend_ = nullptr;
  return ok ? XEMA_OK : XEMA_E_BACKEND;
}

int DeviceArena::resize_static(uint64_t static_bytes, std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!reserved_) {
    error = "device " + std::to_string(device_) + " has no arena; reserve before resizing it";
    return XEMA_E_STATE;
  }
  static_bytes = round_block(static_bytes);
  if (static_bytes == static_bytes_) return XEMA_OK;
  const int rc = static_state_error("resizing the static region", error);
  if (rc != XEMA_OK) return rc;
  // Free first, then allocate: the device never holds both regions (the point of shrinking
  // before weights come in). On failure the old size is tried again, so a refused grow leaves
  // the region as it was; if even that fails, the static region is gone (0 bytes) and says so.
  const uint64_t old = static_bytes_;
  if (static_base_ != nullptr && !arena_backend_->deallocate(static_base_, device_, error)) {
    return XEMA_E_BACKEND;
  }
  static_base_ = nullptr;
  static_bytes_ = 0;
  stats_.reserved_bytes -= old;
  int result = XEMA_OK;
  uint64_t now = static_bytes;
  void* p = nullptr;
  if (now > 0) {
    p = within_limit(now, error) ? arena_backend_->allocate(now, device_, error) : nullptr;
    if (p == nullptr) {
      result = XEMA_E_NOMEM;
      const std::string why = error;
      now = old;
      std::string again;
      p = old > 0 ? arena_backend_->allocate(old, device_, again) : nullptr;
      if (p == nullptr) now = 0;
      error = "device " + std::to_string(device_) + ": static region of " +
              std::to_string(static_bytes) + " bytes refused (" + why + "); it is " +
              (now > 0 ? "back at " + std::to_string(old) + " bytes"
                       : "now 0 bytes (the old " + std::to_string(old) +
                             " could not be allocated again: " + again + ")");
    }
  }
  static_base_ = static_cast<char*>(p);
  static_bytes_ = now;
  stats_.reserved_bytes += now;
  stats_.static_region_bytes = now;
  stats_.arena_base = reinterpret_cast<uintptr_t>(static_base_);
  ++stats_.static_resizes;
  update_peaks();
  return result;
}

int64_t DeviceArena::load_plan(const uint64_t* sizes, const uint64_t* offsets, uint64_t n,
                               std::string& error) {
  if (n > 0 && (sizes == nullptr || offsets == nullptr)) {
    error = "plan arrays are null";
    return XEMA_E_INVALID;
  }
  auto plan = std::make_shared<Plan>();
  plan->sizes.assign(sizes, sizes + n);
  plan->offsets.assign(offsets, offsets + n);
  for (uint64_t i = 0; i < n; ++i) {
    if (sizes[i] == 0 || sizes[i] % kBlock != 0 || offsets[i] % kBlock != 0 ||
        offsets[i] > std::numeric_limits<uint64_t>::max() - sizes[i]) {
      error = "plan entry " + std::to_string(i) + " has size " + std::to_string(sizes[i]) +
              " and offset " + std::to_string(offsets[i]) +
              " (need a non-zero multiple of 512 and a 512-aligned offset)";
      return XEMA_E_INVALID;
    }
    plan->static_bytes_needed = std::max(plan->static_bytes_needed, offsets[i] + sizes[i]);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t id = next_plan_id_++;
  plans_.emplace(id, std::move(plan));
  return id;
}

int DeviceArena::unload_plan(int64_t plan_id, std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  // An armed plan stays alive through armed_plan_'s reference until disarm.
  if (plans_.erase(plan_id) == 0) {
    error = "no plan " + std::to_string(plan_id) + " on device " + std::to_string(device_);
    return XEMA_E_INVALID;
  }
  return XEMA_OK;
}

int DeviceArena::arm(int64_t plan_id, xema_stream_t stream, std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (armed_plan_ != nullptr) {
    error = "device " + std::to_string(device_) + " is already armed; disarm first";
    return XEMA_E_STATE;
  }
  auto it = plans_.find(plan_id);
  if (it == plans_.end()) {
    error = "no plan " + std::to_string(plan_id) + " on device " + std::to_string(device_);
    return XEMA_E_INVALID;
  }
  if (it->second->static_bytes_needed > static_bytes_) {
    error = "plan " + std::to_string(plan_id) + " needs a static region of " +
            std::to_string(it->second->static_bytes_needed) + " bytes, device " +
            std::to_string(device_) + " has " + std::to_string(static_bytes_) +
            (!reserved_ ? " (no arena reserved)" : "");
    return XEMA_E_INVALID;
  }
  armed_plan_ = it->second;
  armed_stream_ = reinterpret_cast<uintptr_t>(stream);
  cursor_ = 0;
  fell_back_ = false;
  ++stats_.requests_armed;
  return XEMA_OK;
}

int DeviceArena::disarm() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Blocks handed out under the plan stay in live_ / static_live_ and are freed normally later;
  // only the cursor goes away.
  armed_plan_.reset();
  cursor_ = 0;
  fell_back_ = false;
  return XEMA_OK;
}

void DeviceArena::stats(xema_stats& out) {
  std::lock_guard<std::mutex> lock(mutex_);
  out = stats_;
  out.armed = armed_plan_ != nullptr ? 1 : 0;
  out.fell_back = fell_back_ ? 1 : 0;
  out.plan_cursor = cursor_;
  out.plan_length = armed_plan_ != nullptr ? armed_plan_->sizes.size() : 0;
}

void DeviceArena::out_of_memory(xema_oom& out) {
  std::lock_guard<std::mutex> lock(mutex_);
  out = oom_;
}

void DeviceArena::set_limit(uint64_t limit_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_bytes_ = limit_bytes;
}

void DeviceArena::reset_peaks() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_active_bytes = stats_.active_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
  stats_.peak_pending_free_bytes = stats_.pending_free_bytes;
}

int DeviceArena::record_start() {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.clear();
  recording_ = true;
  return XEMA_OK;
}

int DeviceArena::record_stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  recording_ = false;
  return XEMA_OK;
}

int64_t DeviceArena::record_read(xema_event* out, uint64_t capacity) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t n = std::min<uint64_t>(capacity, events_.size());
  if (n > 0 && out != nullptr) std::memcpy(out, events_.data(), n * sizeof(xema_event));
  return static_cast<int64_t>(events_.size());
}

bool DeviceArena::holds_memory() {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_ || !live_.empty() || !pending_.empty();
}

}  // namespace xema::runtime
