// Offline static memory layout: Algorithm 1 of the Xema paper (§6) as rectangle packing on the
// address × time plane. Each allocation is a rectangle [begin, end) × [offset, offset + size);
// allocations whose lifetimes overlap must get disjoint address ranges; the objective is the
// highest used address (the static reserved peak).
//
// Declarations only: every definition lives in layout_solver.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace xema::layout {

// The order in which the greedy placer visits allocations. Algorithm 1 is kSize; the others are
// the variants the issue asks to try. Every requested order is run and the lowest peak is kept.
enum class Order {
  kSize,             // size descending, ties by index (the paper's rule, stable)
  kSizeLongerFirst,  // size descending, ties by longer lifetime, then earlier begin
  kArea,             // size × lifetime descending
  kLifetime,         // lifetime descending, ties by size descending
  kLongFirst,        // long-lived first by begin, stacked from both ends; then the rest by size
};

// Parses "size", "size_longer_first", "area", "lifetime", "long_first". Throws
// std::invalid_argument.
Order parse_order(const std::string& name);
const char* order_name(Order order);

struct SolveOptions {
  // Offsets and extents are multiples of this (the CUDA caching allocator's 512-byte blocks).
  int64_t alignment = 512;
  std::vector<Order> orders{Order::kSize, Order::kLongFirst};
  // Allocations that overlap every other allocation (weights, request inputs) are stacked at the
  // bottom first: any valid layout pays their sum at every instant, so doing so loses nothing and
  // removes them from every later overlap query.
  bool hoist_universal = true;
  // Second pass: revisit allocations bottom-up and drop each into the lowest gap that fits now.
  // Never raises an allocation, so the peak cannot grow. Run on the segments that set the peak
  // (elsewhere it cannot lower it) and on each improvement the refinement finds.
  bool compact = true;
  // Time decomposition: cut the trace where few bytes are live across the cut, about every
  // `segment_size` allocations. Allocations crossing a cut are placed first (they are the long-
  // lived ones), then each segment independently around them. 0 disables it.
  int64_t segment_size = 4096;
  // A cut is only made where the bytes crossing it are at most this fraction of the most bytes
  // live at any time (excluding the hoisted allocations).
  double segment_max_crossing = 0.1;
  // Squeaky-wheel refinement of the segment that sets the peak: re-run the greedy with the
  // allocations that ended too high moved earlier in the visit order, keep the best. At most this
  // many re-runs per segment, and at most twelve greedy passes' worth of work in all; 0 disables
  // it.
  int refine_iterations = 48;
  // Then a local search on that segment: move the allocations that reach its top below it,
  // evicting and re-placing what is in the way. Never raises the peak; at most sixteen greedy
  // passes' worth of work per segment.
  bool descent = true;
};

struct SolveResult {
  std::vector<int64_t> offsets;  // one per allocation, in input order
  int64_t reserved = 0;          // highest used address (max of offset + aligned size)
  int64_t lower_bound = 0;       // max live aligned bytes at any instant
  int64_t reserved_greedy = 0;   // the peak before refinement and descent
  Order order = Order::kSize;    // the order that placed the segment setting the peak
  // Aligned with SolveOptions::orders: the greedy's peak in each order alone, before compaction.
  std::vector<int64_t> reserved_per_order;
  int64_t segments = 1;          // independent time segments solved
  int64_t crossers = 0;          // allocations placed first because they cross a cut
  int64_t refine_rounds = 0;     // greedy re-runs spent refining
};

// Throws std::invalid_argument (with the offending values) on negative sizes, begin < 0,
// begin >= end, an alignment that is not a positive power of two, or bad option values.
SolveResult solve(const int64_t* size, const int64_t* begin, const int64_t* end, std::size_t n,
                  const SolveOptions& options);

// Max over time of the sum of aligned sizes of live allocations; no layout can use less.
int64_t lower_bound(const int64_t* size, const int64_t* begin, const int64_t* end, std::size_t n,
                    int64_t alignment);

}  // namespace xema::layout
