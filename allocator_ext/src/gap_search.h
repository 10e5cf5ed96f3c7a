// The two search structures of the layout solver (layout_solver.cpp): which placed allocations
// a new one's lifetime overlaps (OverlapIndex), and the address gaps those leave (GapFinder).
// Internal to the solver's translation unit (header-only, namespace detail); nothing here is part
// of the solver's interface (layout_solver.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace xema::layout::detail {

// No gap / no bound (the solver uses the same value).
inline constexpr int64_t kInf = std::numeric_limits<int64_t>::max();

// Finds the placed items whose lifetimes overlap [b, e). Items are known up front and only their
// "placed" flag changes, so the index is static and read-only (the flags belong to the caller,
// which lets several visit orders share one index from parallel threads):
//   * those alive at instant b (begin <= b < end) come from a centered interval tree (stabbing
//     query: one root-to-leaf walk, each node's lists scanned only as far as they match);
//   * those beginning inside (b, e) are a contiguous run of the begin-sorted order.
// The two sets are disjoint and together are exactly the overlapping ones. A query costs
// O(log n + items touched), so solving is O(n log n + overlapping pairs) instead of the O(n^2)
// scan over everything placed: what keeps 10^5 allocations well under a second.
class OverlapIndex {
 public:
  OverlapIndex(const std::vector<int64_t>& begin, const std::vector<int64_t>& end) {
    const std::size_t n = begin.size();
    starts_.reserve(n);
    std::vector<Interval> all;
    all.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      starts_.push_back({begin[i], static_cast<int32_t>(i)});
      all.push_back({begin[i], end[i] - 1, static_cast<int32_t>(i)});
    }
    std::sort(starts_.begin(), starts_.end());
    root_ = build(all);
  }

  // Appends every item j with placed[j] != 0, begin_j < e and end_j > b to `out`.
  void overlapping(int64_t b, int64_t e, const std::vector<uint8_t>& placed,
                   std::vector<int32_t>& out) const {
    // Alive at b. Intervals are stored closed, [begin, end - 1].
    for (int32_t node = root_; node >= 0;) {
      const Node& nd = nodes_[node];
      if (b < nd.center) {
        for (uint32_t k = nd.first; k < nd.first + nd.count && by_lo_[k].lo <= b; ++k) {
          if (placed[by_lo_[k].id]) out.push_back(by_lo_[k].id);
        }
        node = nd.left;
      } else if (b > nd.center) {
        for (uint32_t k = nd.first; k < nd.first + nd.count && by_hi_[k].hi >= b; ++k) {
          if (placed[by_hi_[k].id]) out.push_back(by_hi_[k].id);
        }
        node = nd.right;
      } else {
        for (uint32_t k = nd.first; k < nd.first + nd.count; ++k) {
          if (placed[by_lo_[k].id]) out.push_back(by_lo_[k].id);
        }
        break;
      }
    }
    // Beginning in (b, e).
    auto it = std::upper_bound(starts_.begin(), starts_.end(),
                               Start{b, std::numeric_limits<int32_t>::max()});
    for (; it != starts_.end() && it->begin < e; ++it) {
      if (placed[it->id]) out.push_back(it->id);
    }
  }

 private:
  struct Interval {
    int64_t lo, hi;  // closed
    int32_t id;
  };
  struct Start {
    int64_t begin;
    int32_t id;
    bool operator<(const Start& o) const { return begin != o.begin ? begin < o.begin : id < o.id; }
  };
  struct Node {
    int64_t center;
    int32_t left, right;
    uint32_t first, count;  // this node's intervals in by_lo_ / by_hi_
  };

  // Center = median endpoint, so each child gets at most half of the intervals: depth O(log n).
  int32_t build(std::vector<Interval>& items) {
    if (items.empty()) return -1;
    std::vector<int64_t> points;
    points.reserve(2 * items.size());
    for (const auto& iv : items) {
      points.push_back(iv.lo);
      points.push_back(iv.hi);
    }
    std::nth_element(points.begin(), points.begin() + points.size() / 2, points.end());
    const int64_t center = points[points.size() / 2];
    std::vector<Interval> left, right, here;
    for (const auto& iv : items) {
      if (iv.hi < center) {
        left.push_back(iv);
      } else if (iv.lo > center) {
        right.push_back(iv);
      } else {
        here.push_back(iv);
      }
    }
    items.clear();
    items.shrink_to_fit();
    const int32_t index = static_cast<int32_t>(nodes_.size());
    nodes_.push_back({center, -1, -1, static_cast<uint32_t>(by_lo_.size()),
                      static_cast<uint32_t>(here.size())});
    std::sort(here.begin(), here.end(),
              [](const Interval& a, const Interval& b) { return a.lo < b.lo; });
    by_lo_.insert(by_lo_.end(), here.begin(), here.end());
    std::sort(here.begin(), here.end(),
              [](const Interval& a, const Interval& b) { return a.hi > b.hi; });
    by_hi_.insert(by_hi_.end(), here.begin(), here.end());
    const int32_t l = build(left);
    const int32_t r = build(right);
    nodes_[index].left = l;
    nodes_[index].right = r;
    return index;
  }

  std::vector<Start> starts_;
  std::vector<Node> nodes_;
  std::vector<Interval> by_lo_, by_hi_;
  int32_t root_ = -1;
};

// Address ranges [lo, hi) that conflict with the allocation being placed, visited in order of lo;
// the gaps in their union are the candidate slots. Sorting dominates a solve, so the ranges are
// ordered through packed uint64 keys (lo in alignment units above a 24-bit slot number), much
// cheaper than sorting (lo, hi) pairs; a comparison sort remains the fallback for values that do
// not pack. Each range remembers its owner (-1 for a floor range) for the two-sided placement.
class GapFinder {
 public:
  explicit GapFinder(int64_t alignment) {
    while ((int64_t{1} << shift_) < alignment) ++shift_;
  }

  void load(const std::vector<int32_t>& ids, const std::vector<int64_t>& offsets,
            const std::vector<int64_t>& extents,
            const std::vector<std::pair<int64_t, int64_t>>& floor) {
    const std::size_t n = floor.size() + ids.size();
    lo_.resize(n);
    hi_.resize(n);
    owner_.resize(n);
    int64_t max_lo = 0;
    std::size_t k = 0;
    for (const auto& [lo, hi] : floor) {
      lo_[k] = lo;
      hi_[k] = hi;
      owner_[k++] = -1;
      max_lo = std::max(max_lo, lo);
    }
    for (int32_t j : ids) {
      lo_[k] = offsets[j];
      hi_[k] = offsets[j] + extents[j];
      owner_[k++] = j;
      max_lo = std::max(max_lo, offsets[j]);
    }
    order_.resize(n);
    constexpr int kSlotBits = 24;
    if (n >= kRadixMin && (max_lo >> shift_) < (int64_t{1} << 62)) {
      radix_order(n, max_lo >> shift_);
    } else if (n < (std::size_t{1} << kSlotBits) &&
        (max_lo >> shift_) < (int64_t{1} << (63 - kSlotBits))) {
      keys_.resize(n);
      for (k = 0; k < n; ++k) {
        keys_[k] = (static_cast<uint64_t>(lo_[k] >> shift_) << kSlotBits) | k;
      }
      std::sort(keys_.begin(), keys_.end());
      for (k = 0; k < n; ++k) order_[k] = static_cast<uint32_t>(keys_[k] & ((1u << kSlotBits) - 1));
    } else {
      for (k = 0; k < n; ++k) order_[k] = static_cast<uint32_t>(k);
      std::sort(order_.begin(), order_.end(), [&](uint32_t a, uint32_t b) {
        return lo_[a] != lo_[b] ? lo_[a] < lo_[b] : a < b;
      });
    }
  }

  // Algorithm 1, lines 5-11: the smallest gap that holds `extent` (lowest address on ties), else
  // the address above every conflict.
  int64_t best_fit(int64_t extent, int64_t base) const {
    int64_t cur = base;
    int64_t best_gap = kInf;
    int64_t best_off = -1;
    for (uint32_t k : order_) {
      if (lo_[k] > cur) {
        const int64_t gap = lo_[k] - cur;
        if (gap >= extent && gap < best_gap) {
          best_gap = gap;
          best_off = cur;
        }
      }
      cur = std::max(cur, hi_[k]);
    }
    return best_off >= 0 ? best_off : cur;
  }

  // Two-sided placement of a long-lived allocation: its best-fit slot if what ends right below
  // that slot (or the base) is `compatible` (outlives most of it), else the highest slot below
  // `ceiling`, top-aligned, if what starts right above it (or the ceiling) is; else the best fit.
  // Consecutive generations of long-lived tensors (the VAE's conv caches, each batch's set alive
  // until the next batch ends) then grow as two stacks from the base and from the ceiling, each
  // with its youngest tensors at the inner edge, so the space between them, where the short-lived
  // activations go, stays contiguous; bottom-up best fit alone interleaves the generations and
  // leaves holes in each at the peaks.
  template <typename Compatible>
  int64_t two_sided(int64_t extent, int64_t base, int64_t ceiling,
                    const Compatible& compatible) const {
    int64_t cur = base;
    int32_t cur_owner = -1;  // what ends at `cur` (-1: the base or a floor range)
    int64_t best_gap = kInf, best_off = -1, high_off = -1;
    int32_t best_below = -1, high_above = -1;
    for (uint32_t k : order_) {
      const int64_t lo = lo_[k];
      if (lo > cur) {
        const int64_t gap = lo - cur;
        if (gap >= extent && gap < best_gap) {
          best_gap = gap;
          best_off = cur;
          best_below = cur_owner;
        }
        if (std::min(lo, ceiling) - cur >= extent) {
          high_off = std::min(lo, ceiling) - extent;
          high_above = lo <= ceiling ? owner_[k] : -1;
        }
      }
      if (hi_[k] > cur) {
        cur = hi_[k];
        cur_owner = owner_[k];
      }
    }
    if (best_off < 0) {
      best_off = cur;
      best_below = cur_owner;
    }
    if (ceiling - cur >= extent) {
      high_off = ceiling - extent;
      high_above = -1;
    }
    if (high_off < 0 || compatible(best_below) || !compatible(high_above)) return best_off;
    return high_off;
  }

  // The lowest address that holds `extent` (used by the compaction pass).
  int64_t first_fit(int64_t extent, int64_t base) const {
    int64_t cur = base;
    for (uint32_t k : order_) {
      if (lo_[k] > cur && lo_[k] - cur >= extent) return cur;
      cur = std::max(cur, hi_[k]);
    }
    return cur;
  }

 private:
  // From this many ranges on, slots are ordered by an LSD radix sort of lo in alignment units
  // (8-bit digits, stable: equal keys keep slot order), the same order the packed-key sort
  // gives ((lo, slot) ascending) in a few linear passes instead of n log n comparisons.
  static constexpr std::size_t kRadixMin = 64;

  void radix_order(std::size_t n, int64_t max_key) {
    constexpr int kDigit = 8;
    constexpr std::size_t kBuckets = std::size_t{1} << kDigit;
    keys_.resize(n);
    radix_keys_.resize(n);
    radix_slots_.resize(n);
    for (std::size_t k = 0; k < n; ++k) {
      keys_[k] = static_cast<uint64_t>(lo_[k] >> shift_);
      order_[k] = static_cast<uint32_t>(k);
    }
    std::size_t count[kBuckets];
    for (int at = 0; at == 0 || (at < 64 && (static_cast<uint64_t>(max_key) >> at) != 0); at += kDigit) {
      std::fill(count, count + kBuckets, std::size_t{0});
      for (std::size_t k = 0; k < n; ++k) ++count[(keys_[k] >> at) & (kBuckets - 1)];
      std::size_t sum = 0;
      for (std::size_t b = 0; b < kBuckets; ++b) {
        const std::size_t c = count[b];
        count[b] = sum;
        sum += c;
      }
      for (std::size_t k = 0; k < n; ++k) {
        const std::size_t to = count[(keys_[k] >> at) & (kBuckets - 1)]++;
        radix_keys_[to] = keys_[k];
        radix_slots_[to] = order_[k];
      }
      keys_.swap(radix_keys_);
      order_.swap(radix_slots_);
    }
  }

  int shift_ = 0;  // log2(alignment): offsets are multiples of the alignment
  std::vector<int64_t> lo_, hi_;
  std::vector<int32_t> owner_;
  std::vector<uint64_t> keys_, radix_keys_;
  std::vector<uint32_t> order_, radix_slots_;  // slots by lo
};

}  // namespace xema::layout::detail
