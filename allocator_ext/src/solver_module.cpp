// Python binding of the layout solver: numpy in, numpy out. Installed as xema_ray.allocator._solver;
// the Python wrapper (xema_ray/allocator/solver.py) validates and types everything around it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "layout_solver.h"

namespace py = pybind11;

namespace {

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

std::size_t common_length(const Int64Array& size, const Int64Array& begin, const Int64Array& end) {
  if (size.ndim() != 1 || begin.ndim() != 1 || end.ndim() != 1) {
    throw std::invalid_argument("size, begin and end must be 1-D arrays (got ndim " +
                                std::to_string(size.ndim()) + ", " + std::to_string(begin.ndim()) +
                                ", " + std::to_string(end.ndim()) + ")");
  }
  if (size.shape(0) != begin.shape(0) || size.shape(0) != end.shape(0)) {
    throw std::invalid_argument("size, begin and end differ in length: " +
                                std::to_string(size.shape(0)) + ", " +
                                std::to_string(begin.shape(0)) + ", " +
                                std::to_string(end.shape(0)));
  }
  return static_cast<std::size_t>(size.shape(0));
}

py::dict solve(const Int64Array& size, const Int64Array& begin, const Int64Array& end,
               int64_t alignment, const std::vector<std::string>& orders, bool hoist_universal,
               bool compact, int64_t segment_size, double segment_max_crossing,
               int refine_iterations, bool descent) {
  const std::size_t n = common_length(size, begin, end);
  xema::layout::SolveOptions options;
  options.alignment = alignment;
  options.hoist_universal = hoist_universal;
  options.compact = compact;
  options.segment_size = segment_size;
  options.segment_max_crossing = segment_max_crossing;
  options.refine_iterations = refine_iterations;
  options.descent = descent;
  options.orders.clear();
  for (const auto& name : orders) options.orders.push_back(xema::layout::parse_order(name));

  xema::layout::SolveResult result;
  double seconds = 0.0;
  {
    // The arrays stay referenced by the caller's frame, so their buffers outlive the solve.
    py::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    result = xema::layout::solve(size.data(), begin.data(), end.data(), n, options);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  Int64Array offsets(static_cast<py::ssize_t>(n));
  std::copy(result.offsets.begin(), result.offsets.end(), offsets.mutable_data());
  py::dict candidates;
  for (std::size_t k = 0; k < options.orders.size(); ++k) {
    candidates[py::str(xema::layout::order_name(options.orders[k]))] =
        result.reserved_per_order[k];
  }
  py::dict out;
  out["offsets"] = offsets;
  out["reserved"] = result.reserved;
  out["lower_bound"] = result.lower_bound;
  out["order"] = std::string(xema::layout::order_name(result.order));
  out["candidates"] = candidates;
  out["seconds"] = seconds;
  out["reserved_greedy"] = result.reserved_greedy;
  out["segments"] = result.segments;
  out["crossers"] = result.crossers;
  out["refine_rounds"] = result.refine_rounds;
  return out;
}

int64_t lower_bound(const Int64Array& size, const Int64Array& begin, const Int64Array& end,
                    int64_t alignment) {
  const std::size_t n = common_length(size, begin, end);
  py::gil_scoped_release release;
  return xema::layout::lower_bound(size.data(), begin.data(), end.data(), n, alignment);
}

}  // namespace

PYBIND11_MODULE(_solver, m) {
  m.doc() = "Static memory layout solver (Xema Algorithm 1) over numpy arrays";
  m.def("solve", &solve, py::arg("size"), py::arg("begin"), py::arg("end"),
        py::arg("alignment") = 512,
        py::arg("orders") = std::vector<std::string>{"size", "long_first"},
        py::arg("hoist_universal") = true, py::arg("compact") = true,
        py::arg("segment_size") = 4096, py::arg("segment_max_crossing") = 0.1,
        py::arg("refine_iterations") = 48, py::arg("descent") = true,
        "Place every allocation; returns a dict with offsets (int64 array), reserved, "
        "lower_bound, order, candidates (the greedy's reserved per order, before compaction), "
        "seconds, reserved_greedy (before refinement and descent), segments, crossers and "
        "refine_rounds.");
  m.def("lower_bound", &lower_bound, py::arg("size"), py::arg("begin"), py::arg("end"),
        py::arg("alignment") = 512, "Max live aligned bytes at any instant.");
}
