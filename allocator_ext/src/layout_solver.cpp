#include "layout_solver.h"

#include "gap_search.h"

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

using detail::kInf;

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
  int64_t ceiling = 0;  // the two-sided placement's upper stack grows down from here
  int64_t long_life = kInf;  // members living at least this long are long-lived (kLongFirst)

  bool long_lived(int32_t i) const { return end[i] - begin[i] >= long_life; }

  // Outcome.
  int64_t top = 0;
  Order order = Order::kSize;
  std::vector<int64_t> top_per_order;
  int64_t refine_rounds = 0;
};

using detail::GapFinder;
using detail::OverlapIndex;

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
      case Order::kLongFirst: {
        const bool long_a = p.long_lived(a), long_b = p.long_lived(b);
        if (long_a != long_b) return long_a;
        return long_a ? begin[a] < begin[b] : ext[a] > ext[b];
      }
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

// Algorithm 1 over one subproblem in one visit order (two-sided for the long-lived allocations
// of kLongFirst). Returns the members' offsets (obstacles keep theirs) and the highest member end;
// adds the allocations and conflicts it visited to `work` (a machine-independent measure of time).
int64_t place(const Subproblem& p, const OverlapIndex& index, Order order,
              const std::vector<int64_t>* priority, int64_t alignment,
              std::vector<int64_t>& offsets, int64_t& work) {
  offsets = p.off;
  std::vector<uint8_t> placed(p.begin.size(), 0);
  std::fill(placed.begin() + static_cast<std::ptrdiff_t>(p.members), placed.end(), 1);
  std::vector<int32_t> conflicts;
  GapFinder gaps(alignment);
  for (int32_t i : visit_order(order, p, priority)) {
    conflicts.clear();
    index.overlapping(p.begin[i], p.end[i], placed, conflicts);
    gaps.load(conflicts, offsets, p.ext, p.floor);
    if (order == Order::kLongFirst && p.long_lived(i)) {
      // A neighbour is a good edge to stack on if it lives through most of i's lifetime.
      const int64_t until = p.end[i] - (p.end[i] - p.begin[i]) / 4;
      offsets[i] = gaps.two_sided(p.ext[i], p.base, p.ceiling,
                                  [&](int32_t k) { return k < 0 || p.end[k] >= until; });
    } else {
      offsets[i] = gaps.best_fit(p.ext[i], p.base);
    }
    placed[i] = 1;
    work += 1 + static_cast<int64_t>(conflicts.size());
  }
  int64_t top = p.base;
  for (std::size_t i = 0; i < p.members; ++i) top = std::max(top, offsets[i] + p.ext[i]);
  return top;
}

// The compaction pass: revisits the members bottom-up (so what settles lower first makes room for
// what is revisited after it) and drops each into the lowest gap that fits it now. Never raises a
// member, so the top cannot grow; returns the new top.
int64_t compact(const Subproblem& p, const OverlapIndex& index, int64_t alignment,
                std::vector<int64_t>& offsets, int64_t& work) {
  std::vector<uint8_t> placed(p.begin.size(), 1);
  std::vector<int32_t> by_offset(p.members), conflicts;
  for (std::size_t i = 0; i < p.members; ++i) by_offset[i] = static_cast<int32_t>(i);
  std::stable_sort(by_offset.begin(), by_offset.end(),
                   [&](int32_t a, int32_t b) { return offsets[a] < offsets[b]; });
  GapFinder gaps(alignment);
  for (int32_t i : by_offset) {
    placed[i] = 0;
    conflicts.clear();
    index.overlapping(p.begin[i], p.end[i], placed, conflicts);
    gaps.load(conflicts, offsets, p.ext, p.floor);
    offsets[i] = std::min(offsets[i], gaps.first_fit(p.ext[i], p.base));
    placed[i] = 1;
    work += 1 + static_cast<int64_t>(conflicts.size());
  }
  int64_t top = p.base;
  for (std::size_t i = 0; i < p.members; ++i) top = std::max(top, offsets[i] + p.ext[i]);
  return top;
}

// Squeaky-wheel optimisation (Joslin & Clements): members that ended above `target` are moved
// earlier in the visit order (their priority grows each time they end too high) and the greedy is
// re-run; the best placement found is kept. Stops at the target, after `refine_iterations`
// re-runs, when a quarter of them in a row brought nothing, or when `budget` (work units, see
// place) is spent. Only a placement that beats the best is compacted: compacting every re-run
// would triple its cost for about the same result (measured on the CogVideoX decode). There, from
// the size order's greedy, long-lived conv caches and short, large activations interleave and
// this brings 1.11-1.15x of the lower bound down to ~1.02x. (Blaming everything live when a
// squeaky allocation begins, or only the top half of the excess, did worse.)
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
    int64_t top = place(p, index, p.order, &priority, options.alignment, trial, work);
    ++p.refine_rounds;
    if (top < p.top) {
      current = trial;  // the next round's blame is on the greedy's placement
      if (options.compact) top = compact(p, index, options.alignment, trial, work);
      p.top = top;
      p.off = trial;
      stale = 0;
    } else {
      current.swap(trial);
      ++stale;
    }
    budget -= work;
  }
}

// Ceiling descent, the local search after the refinement: lowers the top towards the target one
// ceiling at a time. Every member reaching above the ceiling is moved below it, into a free gap if
// there is one, else into a window whose members in the way ("blockers") cover the least
// address × time; each blocker is moved below the same ceiling the same way, up to kDepth
// evictions deep. A level either fully succeeds or is undone, so the layout stays valid and the
// top never rises. On the CogVideoX decode it takes the two-sided greedy's 1.02-1.03x of the
// lower bound to about 1.005x, where the refinement's re-runs had found nothing.
class CeilingDescent {
 public:
  CeilingDescent(Subproblem& p, const OverlapIndex& index, int64_t alignment)
      : p_(p), index_(index), alignment_(alignment), all_(p.begin.size(), 1),
        pinned_(p.members, 0) {}

  void run(int64_t target, int64_t& budget) {
    std::vector<int32_t> high;
    // Aim straight at the target, halving the step after each failed level: pushing everything
    // just below the old top would only make the next level fail. After kMaxFailedLevels failures
    // in a row the members at the top are stuck and smaller steps only burn the budget.
    int64_t step = p_.top - target;
    int failed = 0;
    while (p_.top > target && budget > 0 && step >= alignment_ && failed < kMaxFailedLevels) {
      const int64_t ceiling = std::max(target, p_.top - step) / alignment_ * alignment_;
      high.clear();
      for (std::size_t i = 0; i < p_.members; ++i) {
        if (p_.off[i] + p_.ext[i] > ceiling) high.push_back(static_cast<int32_t>(i));
      }
      std::stable_sort(high.begin(), high.end(),
                       [&](int32_t a, int32_t b) { return p_.ext[a] > p_.ext[b]; });
      bool ok = true;
      for (int32_t i : high) {
        if (!(ok = move_below(i, ceiling, kDepth, budget))) break;
      }
      if (!ok) {
        rollback(0);
        step /= 2;
        ++failed;
        continue;
      }
      failed = 0;
      journal_.clear();
      p_.top = p_.base;
      for (std::size_t i = 0; i < p_.members; ++i) {
        p_.top = std::max(p_.top, p_.off[i] + p_.ext[i]);
      }
    }
  }

 private:
  struct Span {
    int64_t lo, hi;
    int32_t id;  // -1: a floor range (never moves)
  };

  // Evictions nest this deep; each move tries this many windows (fewer when nested). Measured on
  // the CogVideoX decode: depth 2 stops at 1.013x of the lower bound, depth 3 at 1.006x.
  static constexpr int kDepth = 3;
  static constexpr std::size_t kWindowsTried = 16;
  static constexpr std::size_t kWindowsTriedNested = 4;
  static constexpr int kMaxFailedLevels = 4;

  bool movable(int32_t id) const {
    return id >= 0 && static_cast<std::size_t>(id) < p_.members && !pinned_[id];
  }

  // The address ranges of everything live with i but i, sorted by lo.
  void load(int32_t i, int64_t& budget) {
    ids_.clear();
    index_.overlapping(p_.begin[i], p_.end[i], all_, ids_);
    spans_.clear();
    for (const auto& [lo, hi] : p_.floor) spans_.push_back({lo, hi, -1});
    for (int32_t j : ids_) {
      if (j != i) spans_.push_back({p_.off[j], p_.off[j] + p_.ext[j], j});
    }
    std::sort(spans_.begin(), spans_.end(),
              [](const Span& a, const Span& b) { return a.lo < b.lo; });
    budget -= 1 + static_cast<int64_t>(spans_.size());
  }

  // Smallest free gap in spans_ that holds `extent` below `ceiling` (lowest on ties), else the
  // space above every span if that fits: it is what later moves will need. -1 if nothing fits.
  int64_t best_gap(int64_t extent, int64_t ceiling) const {
    int64_t cur = p_.base, best_size = kInf, best = -1;
    for (const Span& s : spans_) {
      if (cur + extent > ceiling) return best;
      if (s.lo > cur) {
        const int64_t gap = std::min(s.lo, ceiling) - cur;
        if (gap >= extent && gap < best_size) {
          best_size = gap;
          best = cur;
        }
      }
      cur = std::max(cur, s.hi);
    }
    return best >= 0 || cur + extent > ceiling ? best : cur;
  }

  // Moves member i below `ceiling`: into the best-fitting free gap, else (depth > 0) into one of
  // the windows whose blockers are cheapest to move, each blocker moved below the ceiling the same
  // way with depth - 1. On failure nothing has changed.
  bool move_below(int32_t i, int64_t ceiling, int depth, int64_t& budget) {
    load(i, budget);
    const int64_t extent = p_.ext[i];
    if (const int64_t off = best_gap(extent, ceiling); off >= 0) {
      set(i, off);
      return true;
    }
    if (depth == 0 || budget <= 0) return false;
    const std::size_t tries = depth > 1 ? kWindowsTried : kWindowsTriedNested;
    std::vector<std::pair<int64_t, std::vector<int32_t>>> windows;  // (offset, blockers)
    for (const auto& [cost, o] : cheapest_windows(extent, ceiling, tries)) {
      std::vector<int32_t> blockers;
      for (const Span& s : spans_) {
        if (s.lo >= o + extent) break;
        if (s.hi > o) blockers.push_back(s.id);
      }
      // Largest first: the big ones have the fewest places to go.
      std::stable_sort(blockers.begin(), blockers.end(),
                       [&](int32_t a, int32_t b) { return p_.ext[a] > p_.ext[b]; });
      windows.emplace_back(o, std::move(blockers));
    }
    pinned_[i] = 1;  // the blockers' own moves must not evict i again
    bool ok = false;
    for (const auto& [o, blockers] : windows) {
      const std::size_t mark = journal_.size();
      set(i, o);
      ok = true;
      for (int32_t j : blockers) {
        if (!(ok = move_below(j, ceiling, depth - 1, budget))) break;
      }
      if (ok) break;
      rollback(mark);
      if (budget <= 0) break;
    }
    pinned_[i] = 0;
    return ok;
  }

  // The `count` windows [o, o + extent) below `ceiling` (o = the base or the end of a span in
  // spans_) whose movable blockers cover the least address × time, i.e. are likeliest to find
  // room elsewhere; windows with a fixed blocker are skipped. The blockers of o are the spans with
  // lo < o + extent and hi > o, counted through prefix sums over spans_ by lo and by hi (every
  // span ending at or below o also starts below o + extent). Returns (cost, offset) pairs.
  std::vector<std::pair<double, int64_t>> cheapest_windows(int64_t extent, int64_t ceiling,
                                                           std::size_t count) {
    const std::size_t k = spans_.size();
    by_hi_.resize(k);
    for (std::size_t a = 0; a < k; ++a) by_hi_[a] = static_cast<int32_t>(a);
    std::sort(by_hi_.begin(), by_hi_.end(),
              [&](int32_t a, int32_t b) { return spans_[a].hi < spans_[b].hi; });
    // Address × time, in double: only the ranking matters and the product overflows int64.
    auto cost = [&](const Span& s) {
      return static_cast<double>(s.hi - s.lo) * static_cast<double>(p_.end[s.id] - p_.begin[s.id]);
    };
    lo_cost_.assign(k + 1, 0.0);
    hi_cost_.assign(k + 1, 0.0);
    lo_fixed_.assign(k + 1, 0);
    hi_fixed_.assign(k + 1, 0);
    for (std::size_t a = 0; a < k; ++a) {
      const Span& s = spans_[a];
      const Span& h = spans_[by_hi_[a]];
      lo_cost_[a + 1] = lo_cost_[a] + (movable(s.id) ? cost(s) : 0);
      lo_fixed_[a + 1] = lo_fixed_[a] + (movable(s.id) ? 0 : 1);
      hi_cost_[a + 1] = hi_cost_[a] + (movable(h.id) ? cost(h) : 0);
      hi_fixed_[a + 1] = hi_fixed_[a] + (movable(h.id) ? 0 : 1);
    }
    std::vector<std::pair<double, int64_t>> windows;
    auto consider = [&](int64_t o) {
      if (o < p_.base || o + extent > ceiling) return;
      const std::size_t starts = static_cast<std::size_t>(
          std::lower_bound(spans_.begin(), spans_.end(), o + extent,
                           [](const Span& s, int64_t v) { return s.lo < v; }) -
          spans_.begin());
      const std::size_t ends = static_cast<std::size_t>(
          std::upper_bound(by_hi_.begin(), by_hi_.end(), o,
                           [&](int64_t v, int32_t a) { return v < spans_[a].hi; }) -
          by_hi_.begin());
      if (lo_fixed_[starts] - hi_fixed_[ends] > 0) return;
      windows.emplace_back(lo_cost_[starts] - hi_cost_[ends], o);
    };
    consider(p_.base);
    for (const Span& s : spans_) consider(s.hi);
    std::sort(windows.begin(), windows.end());
    windows.erase(std::unique(windows.begin(), windows.end()), windows.end());
    if (windows.size() > count) windows.resize(count);
    return windows;
  }

  void set(int32_t i, int64_t offset) {
    journal_.emplace_back(i, p_.off[i]);
    p_.off[i] = offset;
  }

  void rollback(std::size_t mark) {
    while (journal_.size() > mark) {
      p_.off[journal_.back().first] = journal_.back().second;
      journal_.pop_back();
    }
  }

  Subproblem& p_;
  const OverlapIndex& index_;
  int64_t alignment_;
  std::vector<uint8_t> all_, pinned_;
  std::vector<int32_t> ids_, by_hi_;
  std::vector<Span> spans_;
  std::vector<double> lo_cost_, hi_cost_;
  std::vector<int64_t> lo_fixed_, hi_fixed_;
  std::vector<std::pair<int32_t, int64_t>> journal_;  // this level's moves: (member, old offset)
};

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
                           const std::vector<int64_t>& placed_offsets, int64_t base,
                           int64_t ceiling) {
  Subproblem p;
  p.base = base;
  p.ceiling = ceiling;
  p.members = members.size();
  int64_t min_end = kInf, max_begin = -1, min_begin = kInf, max_end = -1;
  for (int32_t g : members) {
    p.global.push_back(g);
    p.begin.push_back(begin[g]);
    p.end.push_back(end[g]);
    p.ext.push_back(extents[g]);
    p.off.push_back(0);
    min_end = std::min(min_end, end[g]);
    max_begin = std::max(max_begin, begin[g]);
    min_begin = std::min(min_begin, begin[g]);
    max_end = std::max(max_end, end[g]);
  }
  // Long-lived: alive for at least a sixteenth of the span the members cover. On the CogVideoX
  // decode (6.8k events) that is the conv caches (1.1k-2k events) and not the activations
  // (< 64 events); thresholds from 1/12 to 1/20 of the span gave the same layouts.
  if (!members.empty()) p.long_life = std::max<int64_t>(1, (max_end - min_begin) / 16);
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

// Places every subproblem in every requested order (in parallel, greedy only) and keeps each
// one's best. Returns the work of one greedy pass over all of them (the first order's).
int64_t solve_all(std::vector<Subproblem>& problems, const std::vector<OverlapIndex>& indexes,
                  const SolveOptions& options) {
  const std::size_t n_orders = options.orders.size();
  std::vector<std::vector<int64_t>> tops(problems.size(), std::vector<int64_t>(n_orders));
  std::vector<std::vector<std::vector<int64_t>>> offsets(
      problems.size(), std::vector<std::vector<int64_t>>(n_orders));
  std::vector<int64_t> work(problems.size() * n_orders, 0);
  parallel_for(problems.size() * n_orders, [&](std::size_t task) {
    const std::size_t s = task / n_orders, k = task % n_orders;
    tops[s][k] = place(problems[s], indexes[s], options.orders[k], nullptr, options.alignment,
                       offsets[s][k], work[task]);
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
  if (name == "long_first") return Order::kLongFirst;
  throw std::invalid_argument("unknown layout order '" + name +
                              "' (expected size, size_longer_first, area, lifetime or long_first)");
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
    case Order::kLongFirst:
      return "long_first";
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
    std::vector<Subproblem> first{make_subproblem(crossers, {}, begin, end, extents, offsets, base,
                                                  result.lower_bound)};
    std::vector<OverlapIndex> first_index{OverlapIndex(first[0].begin, first[0].end)};
    greedy_work += solve_all(first, first_index, options);
    if (options.compact) {  // every segment builds on the crossers' placement
      int64_t work = 0;
      first[0].top = compact(first[0], first_index[0], options.alignment, first[0].off, work);
    }
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
      problems.push_back(make_subproblem(members, obstacles, begin, end, extents, offsets, base,
                                         result.lower_bound));
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

  // Compaction can only lower the peak where a segment sets it, so only those are compacted:
  // the segment with the highest top, until that one is already compacted.
  if (options.compact) {
    std::vector<uint8_t> compacted(problems.size(), 0);
    while (!problems.empty()) {
      std::size_t s = 0;
      for (std::size_t t = 1; t < problems.size(); ++t) {
        if (problems[t].top > problems[s].top) s = t;
      }
      if (compacted[s] || problems[s].top <= crossers_top) break;
      compacted[s] = 1;
      int64_t work = 0;
      problems[s].top = compact(problems[s], indexes[s], options.alignment, problems[s].off, work);
    }
  }

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
  if (options.refine_iterations > 0 || options.descent) {
    // Refinement may cost at most kRefineBudget greedy passes over the whole trace (a compaction
    // pass costs about two), the descent kDescentBudget passes per segment, counted in work units
    // rather than seconds so that a layout does not depend on the machine's speed. (The descent
    // mostly stops on its own first; on the planner's 4-step CogVideoX traces, where the decode is
    // most of the trace, one pass left them at 1.03-1.05x of the lower bound, 16 at 1.01-1.04x.)
    constexpr int64_t kRefineBudget = 12;
    constexpr int64_t kDescentBudget = 16;
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
      if (options.refine_iterations > 0) {
        refine(problems[critical], indexes[critical], target, options, budget);
        result.refine_rounds += problems[critical].refine_rounds;
      }
      if (options.descent) {
        int64_t descent_budget = kDescentBudget * greedy_work;
        CeilingDescent(problems[critical], indexes[critical], options.alignment)
            .run(target, descent_budget);
      }
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
