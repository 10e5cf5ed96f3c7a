#include "layout_solver.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace xema::layout {

namespace {

constexpr int64_t kInf = std::numeric_limits<int64_t>::max();

int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

void validate(const int64_t* size, const int64_t* begin, const int64_t* end, std::size_t n,
              int64_t alignment) {
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument("alignment must be a positive power of two, got " +
                                std::to_string(alignment));
  }
  // Ids are int32 inside the solver to halve the memory traffic of the overlap queries.
  if (n >= static_cast<std::size_t>(std::numeric_limits<int32_t>::max())) {
    throw std::invalid_argument("too many allocations: " + std::to_string(n));
  }
  // Sizes are summed; keep headroom so no sum of aligned sizes can overflow int64.
  constexpr int64_t kMaxSize = int64_t{1} << 50;
  for (std::size_t i = 0; i < n; ++i) {
    if (size[i] < 0 || size[i] > kMaxSize) {
      throw std::invalid_argument("allocation " + std::to_string(i) + " has size " +
                                  std::to_string(size[i]) + " (must be in [0, 2^50])");
    }
    if (begin[i] < 0 || begin[i] >= end[i]) {
      throw std::invalid_argument("allocation " + std::to_string(i) + " has lifetime [" +
                                  std::to_string(begin[i]) + ", " + std::to_string(end[i]) +
                                  ") (need 0 <= begin < end)");
    }
  }
}

// Runs body(k) for k in [0, count) on up to hardware_concurrency threads; rethrows the first
// exception after all threads joined.
void parallel_for(std::size_t count, const std::function<void(std::size_t)>& body) {
  const std::size_t workers =
      std::min<std::size_t>(count, std::max(1u, std::thread::hardware_concurrency()));
  if (workers <= 1) {
    for (std::size_t k = 0; k < count; ++k) body(k);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  std::vector<std::thread> pool;
  pool.reserve(workers);
  for (std::size_t w = 0; w < workers; ++w) {
    pool.emplace_back([&] {
      for (std::size_t k = next++; k < count; k = next++) {
        try {
          body(k);
        } catch (...) {
          std::lock_guard<std::mutex> lock(failure_mutex);
          if (!failure) failure = std::current_exception();
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

// One independent placement problem in local ids: members [0, members) are to be placed;
// ids [members, size) are obstacles already placed elsewhere (fixed offsets) that overlap some of
// the members in time; `floor` holds the merged address ranges of obstacles that overlap every
// member, so they cost one range per query however many allocations they stand for.
struct Subproblem {
  std::vector<int64_t> begin, end, ext, off;
  std::vector<int32_t> global;
  std::size_t members = 0;
  std::vector<std::pair<int64_t, int64_t>> floor;
  int64_t base = 0;  // nothing of this problem goes below it (the hoisted allocations)

  // Outcome.
  int64_t top = 0;
  Order order = Order::kSize;
  std::vector<int64_t> top_per_order;
  int64_t refine_rounds = 0;
};

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

// Address ranges [lo, hi) that conflict with the allocation being placed, sorted by lo; the gaps
// in their union are the candidate slots. The sort dominates a solve, so ranges are sorted as
// packed uint64 keys (lo in alignment units above a 24-bit slot number), much cheaper than sorting
// (lo, hi) pairs; pairs remain the fallback for values that do not pack.
class GapFinder {
 public:
  void load(const std::vector<int32_t>& ids, const std::vector<int64_t>& offsets,
            const std::vector<int64_t>& extents,
            const std::vector<std::pair<int64_t, int64_t>>& floor, int64_t alignment) {
    spans_.assign(floor.begin(), floor.end());
    for (int32_t j : ids) spans_.emplace_back(offsets[j], offsets[j] + extents[j]);
    constexpr int kSlotBits = 24;
    bool packable = spans_.size() < (std::size_t{1} << kSlotBits);
    for (std::size_t k = 0; packable && k < spans_.size(); ++k) {
      packable = spans_[k].first / alignment < (int64_t{1} << (64 - kSlotBits - 1));
    }
    if (!packable) {
      std::sort(spans_.begin(), spans_.end());
      return;
    }
    keys_.clear();
    for (std::size_t k = 0; k < spans_.size(); ++k) {
      keys_.push_back((static_cast<uint64_t>(spans_[k].first / alignment) << kSlotBits) | k);
    }
    std::sort(keys_.begin(), keys_.end());
    sorted_.clear();
    for (uint64_t key : keys_) sorted_.push_back(spans_[key & ((uint64_t{1} << kSlotBits) - 1)]);
    spans_.swap(sorted_);
  }

  // Algorithm 1, lines 5-11: the smallest gap that holds `extent` (lowest address on ties), else
  // the address above every conflict.
  int64_t best_fit(int64_t extent, int64_t base) const {
    int64_t cur = base;
    int64_t best_gap = kInf;
    int64_t best_off = -1;
    for (const auto& [lo, hi] : spans_) {
      if (lo > cur) {
        const int64_t gap = lo - cur;
        if (gap >= extent && gap < best_gap) {
          best_gap = gap;
          best_off = cur;
        }
      }
      cur = std::max(cur, hi);
    }
    return best_off >= 0 ? best_off : cur;
  }

  // The lowest address that holds `extent` (used by the compaction pass).
  int64_t first_fit(int64_t extent, int64_t base) const {
    int64_t cur = base;
    for (const auto& [lo, hi] : spans_) {
      if (lo > cur && lo - cur >= extent) return cur;
      cur = std::max(cur, hi);
    }
    return cur;
  }

 private:
  std::vector<std::pair<int64_t, int64_t>> spans_, sorted_;
  std::vector<uint64_t> keys_;
};

// Visit order of a subproblem's members. With `priority`, higher priority goes first and the
// order's own rule breaks ties (the refinement's re-runs).
std::vector<int32_t> visit_order(Order order, const Subproblem& p,
                                 const std::vector<int64_t>* priority) {
  std::vector<int32_t> ids(p.members);
  for (std::size_t i = 0; i < p.members; ++i) ids[i] = static_cast<int32_t>(i);
  const auto& begin = p.begin;
  const auto& end = p.end;
  const auto& ext = p.ext;
  auto life = [&](int32_t i) { return end[i] - begin[i]; };
  auto rule = [&](int32_t a, int32_t b) -> bool {
    switch (order) {
      case Order::kSize:
        return ext[a] > ext[b];
      case Order::kSizeLongerFirst:
        if (ext[a] != ext[b]) return ext[a] > ext[b];
        if (life(a) != life(b)) return life(a) > life(b);
        return begin[a] < begin[b];
      case Order::kArea: {
        // long double: size (< 2^50) × lifetime (< 2^63) overflows int64.
        const long double area_a = static_cast<long double>(ext[a]) * life(a);
        const long double area_b = static_cast<long double>(ext[b]) * life(b);
        if (area_a != area_b) return area_a > area_b;
        return ext[a] > ext[b];
      }
      case Order::kLifetime:
        if (life(a) != life(b)) return life(a) > life(b);
        return ext[a] > ext[b];
    }
    return false;
  };
  if (priority == nullptr) {
    std::stable_sort(ids.begin(), ids.end(), rule);
  } else {
    std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
      if ((*priority)[a] != (*priority)[b]) return (*priority)[a] > (*priority)[b];
      return rule(a, b);
    });
  }
  return ids;
}

// Algorithm 1 over one subproblem in one visit order, then (optionally) the compaction pass.
// Returns the members' offsets (obstacles keep theirs) and the highest member end; adds the
// allocations and conflicts it visited to `work` (a machine-independent measure of time).
int64_t place(const Subproblem& p, const OverlapIndex& index, Order order,
              const std::vector<int64_t>* priority, const SolveOptions& options,
              std::vector<int64_t>& offsets, int64_t& work) {
  offsets = p.off;
  std::vector<uint8_t> placed(p.begin.size(), 0);
  std::fill(placed.begin() + static_cast<std::ptrdiff_t>(p.members), placed.end(), 1);
  std::vector<int32_t> conflicts;
  GapFinder gaps;
  for (int32_t i : visit_order(order, p, priority)) {
    conflicts.clear();
    index.overlapping(p.begin[i], p.end[i], placed, conflicts);
    gaps.load(conflicts, offsets, p.ext, p.floor, options.alignment);
    offsets[i] = gaps.best_fit(p.ext[i], p.base);
    placed[i] = 1;
    work += 1 + static_cast<int64_t>(conflicts.size());
  }
  if (options.compact) {
    // Bottom-up, so what settles lower first makes room for what is revisited after it.
    std::vector<int32_t> by_offset(p.members);
    for (std::size_t i = 0; i < p.members; ++i) by_offset[i] = static_cast<int32_t>(i);
    std::stable_sort(by_offset.begin(), by_offset.end(),
                     [&](int32_t a, int32_t b) { return offsets[a] < offsets[b]; });
    for (int32_t i : by_offset) {
      placed[i] = 0;
      conflicts.clear();
      index.overlapping(p.begin[i], p.end[i], placed, conflicts);
      gaps.load(conflicts, offsets, p.ext, p.floor, options.alignment);
      offsets[i] = std::min(offsets[i], gaps.first_fit(p.ext[i], p.base));
      placed[i] = 1;
      work += 1 + static_cast<int64_t>(conflicts.size());
    }
  }
  int64_t top = p.base;
  for (std::size_t i = 0; i < p.members; ++i) top = std::max(top, offsets[i] + p.ext[i]);
  return top;
}

// Squeaky-wheel optimisation (Joslin & Clements): members that ended above `target` are moved
// earlier in the visit order (their priority grows each time they end too high) and the greedy is
// re-run; the best placement found is kept. Stops at the target, after `refine_iterations`
// re-runs, when a quarter of them in a row brought nothing, or when `budget` (work units, see
// place) is spent. Measured on the CogVideoX VAE
// decode, where long-lived conv caches and short, large activations interleave: the greedy's
// 1.11-1.15x of the lower bound comes down to ~1.02x. (Blaming everything live when a squeaky
// allocation begins, or only the top half of the excess, did worse.)
void refine(Subproblem& p, const OverlapIndex& index, int64_t target, const SolveOptions& options,
            int64_t& budget) {
  const int patience = std::max(4, options.refine_iterations / 4);
  std::vector<int64_t> priority(p.members, 0);
  std::vector<int64_t> current = p.off;
  std::vector<int64_t> trial;
  int stale = 0;
  for (int it = 0; it < options.refine_iterations && p.top > target && stale < patience && budget > 0;
       ++it) {
    for (std::size_t i = 0; i < p.members; ++i) {
      if (current[i] + p.ext[i] > target) ++priority[i];
    }
    int64_t work = 0;
    const int64_t top = place(p, index, p.order, &priority, options, trial, work);
    budget -= work;
    ++p.refine_rounds;
    if (top < p.top) {
      p.top = top;
      p.off = trial;
      stale = 0;
    } else {
      ++stale;
    }
    current.swap(trial);
  }
}

// Places allocations crossing a cut first, so cut where few bytes are live across the cut: about
// every `segment_size` allocations (in begin order), at the candidate with the fewest crossing
// bytes among the next `segment_size` begin times, and only where those are at most
// `max_crossing` of the most bytes ever live (where everything is long-lived, as in a random
// trace, pinning the crossers first costs more than the cut gains).
std::vector<int64_t> choose_cuts(const std::vector<int32_t>& ids, const int64_t* begin,
                                 const int64_t* end, const std::vector<int64_t>& extents,
                                 int64_t segment_size, double max_crossing) {
  std::vector<int64_t> cuts;
  const std::size_t n = ids.size();
  if (segment_size <= 0 || n < 2 * static_cast<std::size_t>(segment_size)) return cuts;
  const std::size_t m = static_cast<std::size_t>(segment_size);
  std::vector<std::pair<int64_t, int64_t>> by_begin, by_end;  // (time, extent)
  by_begin.reserve(n);
  by_end.reserve(n);
  for (int32_t i : ids) {
    by_begin.emplace_back(begin[i], extents[i]);
    by_end.emplace_back(end[i], extents[i]);
  }
  std::sort(by_begin.begin(), by_begin.end());
  std::sort(by_end.begin(), by_end.end());
  std::vector<int64_t> begun(n + 1, 0), ended(n + 1, 0);  // prefix sums of extents
  std::vector<int64_t> end_times(n);
  for (std::size_t k = 0; k < n; ++k) {
    begun[k + 1] = begun[k] + by_begin[k].second;
    ended[k + 1] = ended[k] + by_end[k].second;
    end_times[k] = by_end[k].first;
  }
  // Bytes of allocations with begin < t < end, for t = the p-th begin time (p = #begins before t
  // when that begin time is distinct from the previous one).
  auto crossing = [&](std::size_t p) {
    const int64_t t = by_begin[p].first;
    const std::size_t done = static_cast<std::size_t>(
        std::upper_bound(end_times.begin(), end_times.end(), t) - end_times.begin());
    return begun[p] - ended[done];
  };
  int64_t most_live = 0;
  for (std::size_t p = 1; p < n; ++p) {
    if (by_begin[p].first != by_begin[p - 1].first) most_live = std::max(most_live, crossing(p));
  }
  const int64_t allowed = static_cast<int64_t>(max_crossing * static_cast<double>(most_live));
  std::size_t start = 0;
  while (n - start >= 2 * m) {
    std::size_t best = 0;
    int64_t best_bytes = kInf;
    for (std::size_t p = start + m; p < std::min(n, start + 2 * m); ++p) {
      if (by_begin[p].first == by_begin[p - 1].first) continue;
      const int64_t bytes = crossing(p);
      if (bytes < best_bytes) {
        best_bytes = bytes;
        best = p;
      }
    }
    if (best == 0 || best_bytes > allowed) {  // no acceptable cut in this window
      start += m;
      continue;
    }
    cuts.push_back(by_begin[best].first);
    start = best;
  }
  return cuts;
}

// Builds a subproblem of `members` with the already-placed `obstacles` (global ids, offsets in
// `placed_offsets`). Obstacles overlapping every member become merged floor ranges.
Subproblem make_subproblem(const std::vector<int32_t>& members,
                           const std::vector<int32_t>& obstacles, const int64_t* begin,
                           const int64_t* end, const std::vector<int64_t>& extents,
                           const std::vector<int64_t>& placed_offsets, int64_t base) {
  Subproblem p;
  p.base = base;
  p.members = members.size();
  int64_t min_end = kInf, max_begin = -1;
  for (int32_t g : members) {
    p.global.push_back(g);
    p.begin.push_back(begin[g]);
    p.end.push_back(end[g]);
    p.ext.push_back(extents[g]);
    p.off.push_back(0);
    min_end = std::min(min_end, end[g]);
    max_begin = std::max(max_begin, begin[g]);
  }
  std::vector<std::pair<int64_t, int64_t>> floor;
  for (int32_t g : obstacles) {
    const int64_t lo = placed_offsets[g], hi = placed_offsets[g] + extents[g];
    if (begin[g] < min_end && end[g] > max_begin) {
      floor.emplace_back(lo, hi);
      continue;
    }
    p.global.push_back(g);
    p.begin.push_back(begin[g]);
    p.end.push_back(end[g]);
    p.ext.push_back(extents[g]);
    p.off.push_back(lo);
  }
  std::sort(floor.begin(), floor.end());
  for (const auto& r : floor) {
    if (!p.floor.empty() && r.first <= p.floor.back().second) {
      p.floor.back().second = std::max(p.floor.back().second, r.second);
    } else {
      p.floor.push_back(r);
    }
  }
  return p;
}

// Solves every subproblem in every requested order (in parallel) and keeps each one's best.
// Returns the work of one greedy pass over all of them (the first order's).
int64_t solve_all(std::vector<Subproblem>& problems, const std::vector<OverlapIndex>& indexes,
                  const SolveOptions& options) {
  const std::size_t n_orders = options.orders.size();
  std::vector<std::vector<int64_t>> tops(problems.size(), std::vector<int64_t>(n_orders));
  std::vector<std::vector<std::vector<int64_t>>> offsets(
      problems.size(), std::vector<std::vector<int64_t>>(n_orders));
  std::vector<int64_t> work(problems.size() * n_orders, 0);
  parallel_for(problems.size() * n_orders, [&](std::size_t task) {
    const std::size_t s = task / n_orders, k = task % n_orders;
    tops[s][k] = place(problems[s], indexes[s], options.orders[k], nullptr, options, offsets[s][k],
                       work[task]);
  });
  int64_t first_order_work = 0;
  for (std::size_t s = 0; s < problems.size(); ++s) first_order_work += work[s * n_orders];
  for (std::size_t s = 0; s < problems.size(); ++s) {
    std::size_t best = 0;
    for (std::size_t k = 1; k < n_orders; ++k) {
      if (tops[s][k] < tops[s][best]) best = k;
    }
    problems[s].top = tops[s][best];
    problems[s].order = options.orders[best];
    problems[s].off = std::move(offsets[s][best]);
    problems[s].top_per_order = std::move(tops[s]);
  }
  return first_order_work;
}

}  // namespace

Order parse_order(const std::string& name) {
  if (name == "size") return Order::kSize;
  if (name == "size_longer_first") return Order::kSizeLongerFirst;
  if (name == "area") return Order::kArea;
  if (name == "lifetime") return Order::kLifetime;
  throw std::invalid_argument("unknown layout order '" + name +
                              "' (expected size, size_longer_first, area or lifetime)");
}

const char* order_name(Order order) {
  switch (order) {
    case Order::kSize:
      return "size";
    case Order::kSizeLongerFirst:
      return "size_longer_first";
    case Order::kArea:
      return "area";
    case Order::kLifetime:
      return "lifetime";
  }
  return "unknown";
}

int64_t lower_bound(const int64_t* size, const int64_t* begin, const int64_t* end, std::size_t n,
                    int64_t alignment) {
  validate(size, begin, end, n, alignment);
  std::vector<std::pair<int64_t, int64_t>> events;
  events.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t ext = align_up(size[i], alignment);
    if (ext == 0) continue;
    events.emplace_back(begin[i], ext);
    events.emplace_back(end[i], -ext);
  }
  // Lifetimes are half-open: at equal times the free (negative delta) sorts first.
  std::sort(events.begin(), events.end());
  int64_t live = 0, peak = 0;
  for (const auto& [t, delta] : events) {
    live += delta;
    peak = std::max(peak, live);
  }
  return peak;
}

SolveResult solve(const int64_t* size, const int64_t* begin, const int64_t* end, std::size_t n,
                  const SolveOptions& options) {
  validate(size, begin, end, n, options.alignment);
  if (options.orders.empty()) throw std::invalid_argument("no layout order requested");
  if (options.segment_size < 0 || options.refine_iterations < 0 ||
      !(options.segment_max_crossing >= 0.0 && options.segment_max_crossing <= 1.0)) {
    throw std::invalid_argument(
        "need segment_size >= 0, 0 <= segment_max_crossing <= 1, refine_iterations >= 0; got " +
        std::to_string(options.segment_size) + ", " + std::to_string(options.segment_max_crossing) +
        ", " + std::to_string(options.refine_iterations));
  }

  SolveResult result;
  result.lower_bound = lower_bound(size, begin, end, n, options.alignment);

  std::vector<int64_t> extents(n);
  std::vector<int32_t> nonempty;
  nonempty.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    extents[i] = align_up(size[i], options.alignment);
    if (extents[i] > 0) nonempty.push_back(static_cast<int32_t>(i));
  }

  // Universal allocations overlap every other non-empty one: begin before the earliest other end
  // and end after the latest other begin. The two smallest ends / two largest begins give "every
  // other" for each candidate in O(1).
  std::vector<int32_t> universal, rest;
  if (options.hoist_universal && !nonempty.empty()) {
    int32_t min_end_id = -1, max_begin_id = -1;
    int64_t min_end[2] = {kInf, kInf};
    int64_t max_begin[2] = {-1, -1};
    for (int32_t i : nonempty) {
      if (end[i] < min_end[0]) {
        min_end[1] = min_end[0];
        min_end[0] = end[i];
        min_end_id = i;
      } else if (end[i] < min_end[1]) {
        min_end[1] = end[i];
      }
      if (begin[i] > max_begin[0]) {
        max_begin[1] = max_begin[0];
        max_begin[0] = begin[i];
        max_begin_id = i;
      } else if (begin[i] > max_begin[1]) {
        max_begin[1] = begin[i];
      }
    }
    for (int32_t i : nonempty) {
      const int64_t other_min_end = i == min_end_id ? min_end[1] : min_end[0];
      const int64_t other_max_begin = i == max_begin_id ? max_begin[1] : max_begin[0];
      if (begin[i] < other_min_end && end[i] > other_max_begin) {
        universal.push_back(i);
      } else {
        rest.push_back(i);
      }
    }
  } else {
    rest = nonempty;
  }

  std::vector<int64_t> offsets(n, 0);
  int64_t base = 0;  // the rest is placed above the stacked universal allocations
  std::stable_sort(universal.begin(), universal.end(),
                   [&](int32_t a, int32_t b) { return extents[a] > extents[b]; });
  for (int32_t i : universal) {
    offsets[i] = base;
    base += extents[i];
  }

  // Time decomposition: crossers of any cut form the first subproblem; each segment between cuts
  // is then an independent subproblem with the crossers overlapping it as fixed obstacles.
  const std::vector<int64_t> cuts = choose_cuts(rest, begin, end, extents, options.segment_size,
                                                options.segment_max_crossing);
  std::vector<int32_t> crossers;
  std::vector<std::vector<int32_t>> segments(cuts.size() + 1);
  for (int32_t i : rest) {
    const std::size_t k = static_cast<std::size_t>(
        std::upper_bound(cuts.begin(), cuts.end(), begin[i]) - cuts.begin());
    if (k < cuts.size() && end[i] > cuts[k]) {
      crossers.push_back(i);
    } else {
      segments[k].push_back(i);
    }
  }
  result.crossers = static_cast<int64_t>(crossers.size());

  const std::size_t n_orders = options.orders.size();
  std::vector<int64_t> per_order(n_orders, base);
  int64_t greedy_work = 0;
  int64_t crossers_top = base;
  Order crossers_order = options.orders[0];
  if (!crossers.empty()) {
    std::vector<Subproblem> first{make_subproblem(crossers, {}, begin, end, extents, offsets, base)};
    std::vector<OverlapIndex> first_index{OverlapIndex(first[0].begin, first[0].end)};
    greedy_work += solve_all(first, first_index, options);
    for (std::size_t i = 0; i < first[0].members; ++i) {
      offsets[first[0].global[i]] = first[0].off[i];
    }
    crossers_top = first[0].top;
    crossers_order = first[0].order;
    for (std::size_t k = 0; k < n_orders; ++k) per_order[k] = first[0].top_per_order[k];
  }

  std::vector<Subproblem> problems;
  {
    // The crossers overlapping each segment, found through one index over all crossers.
    std::vector<int64_t> cb, ce;
    for (int32_t g : crossers) {
      cb.push_back(begin[g]);
      ce.push_back(end[g]);
    }
    const OverlapIndex crosser_index(cb, ce);
    const std::vector<uint8_t> all_placed(crossers.size(), 1);
    std::vector<int32_t> hits, obstacles;
    for (auto& members : segments) {
      if (members.empty()) continue;
      int64_t lo = kInf, hi = -1;
      for (int32_t g : members) {
        lo = std::min(lo, begin[g]);
        hi = std::max(hi, end[g]);
      }
      hits.clear();
      crosser_index.overlapping(lo, hi, all_placed, hits);
      obstacles.clear();
      for (int32_t h : hits) obstacles.push_back(crossers[h]);
      problems.push_back(make_subproblem(members, obstacles, begin, end, extents, offsets, base));
    }
  }
  result.segments = static_cast<int64_t>(problems.size());
  std::vector<OverlapIndex> indexes;
  indexes.reserve(problems.size());
  for (const auto& p : problems) indexes.emplace_back(p.begin, p.end);
  greedy_work += solve_all(problems, indexes, options);
  for (const auto& p : problems) {
    for (std::size_t k = 0; k < n_orders; ++k) {
      per_order[k] = std::max(per_order[k], p.top_per_order[k]);
    }
  }
  result.reserved_per_order = per_order;

  // Refine the segment that sets the peak while it can still lower it. (The crossers' placement
  // is kept: moving them would change every segment's obstacles.)
  auto peak_of_others = [&](std::size_t skip) {
    int64_t m = crossers_top;
    for (std::size_t s = 0; s < problems.size(); ++s) {
      if (s != skip) m = std::max(m, problems[s].top);
    }
    return m;
  };
  result.reserved_greedy = peak_of_others(problems.size());
  if (options.refine_iterations > 0) {
    // Refinement may cost at most kRefineBudget greedy passes over the whole trace, counted in
    // work units rather than seconds so that a layout does not depend on the machine's speed.
    constexpr int64_t kRefineBudget = 4;
    int64_t budget = kRefineBudget * greedy_work;
    std::vector<uint8_t> tried(problems.size(), 0);
    while (true) {
      std::size_t critical = problems.size();
      for (std::size_t s = 0; s < problems.size(); ++s) {
        if (critical == problems.size() || problems[s].top > problems[critical].top) critical = s;
      }
      if (critical == problems.size() || tried[critical]) break;
      const int64_t target = std::max(result.lower_bound, peak_of_others(critical));
      if (problems[critical].top <= target) break;
      tried[critical] = 1;
      refine(problems[critical], indexes[critical], target, options, budget);
      result.refine_rounds += problems[critical].refine_rounds;
    }
  }

  result.reserved = crossers_top;
  Order peak_order = crossers_order;
  int64_t peak_top = crossers_top;
  for (const auto& p : problems) {
    for (std::size_t i = 0; i < p.members; ++i) offsets[p.global[i]] = p.off[i];
    result.reserved = std::max(result.reserved, p.top);
    if (p.top > peak_top) {
      peak_top = p.top;
      peak_order = p.order;
    }
  }
  result.offsets = std::move(offsets);
  result.order = peak_order;
  return result;
}

}  // namespace xema::layout
