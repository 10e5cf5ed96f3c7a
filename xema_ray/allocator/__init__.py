"""The static allocator (paper §6): one package for the one mechanism built in ``allocator_ext/``.

Modules map onto the C++ library's targets and what surrounds them:

- ``solver``: the layout solver binding (``_solver``, target ``_solver`` over ``xema_layout_core``):
  ``solve_layout``, ``StaticLayout``, ``ReplayPlan``.
- ``runtime``: the runtime allocator binding (``libxema_alloc.so``, target ``xema_alloc``) through
  ctypes: ``StaticAllocator`` (CUDA or host arena), its statistics.
- ``cuda``: installing it as torch's ``CUDAPluggableAllocator``, warm-up and pinned kernels
  (GPU only; never at import).
- ``oom``: an allocation every region and the driver refused: the library's record of it and
  ``ArenaOutOfMemory``.
- ``host_tensors``: a CPU worker's tensors mirrored into the host arena, so its batches meet the
  arena's limits as a device's would (the out-of-memory path on a CPU).
- ``recording``: a real run's allocation events as the runtime allocator saw them.
- ``replay``: a trace through the host arena with a layout armed (CPU proof of a layout).
- ``device_allocs``: allocations a GPU makes that the meta trace does not (per GPU model,
  recorded once on the GPU), and their inclusion in a trace before solving.
- ``margins``: the one definition of the dynamic region and of the planner's layout allowance.
- ``caching_sim``, ``report``, ``synthetic``, ``plot``: PyTorch's caching allocator simulated on a
  trace, layout reports, synthetic traces, the Figure 7 plot (``plot`` imports matplotlib).
"""

from xema_ray.allocator.caching_sim import CachingAllocatorResult, simulate_arrays, simulate_caching_allocator
from xema_ray.allocator.margins import DYNAMIC_FRACTION, LAYOUT_OVERHEAD, dynamic_region_bytes, reserved_with_layout
from xema_ray.allocator.report import LayoutReport, layout_report, markdown_table
from xema_ray.allocator.solver import (
    DEFAULT_ALIGNMENT,
    LAYOUT_SCHEMA_VERSION,
    ReplayPlan,
    SolverOptions,
    StaticLayout,
    StaticLayoutFile,
    first_overlap,
    lower_bound,
    solve_arrays,
    solve_layout,
)

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DYNAMIC_FRACTION",
    "LAYOUT_OVERHEAD",
    "LAYOUT_SCHEMA_VERSION",
    "CachingAllocatorResult",
    "LayoutReport",
    "ReplayPlan",
    "SolverOptions",
    "StaticLayout",
    "StaticLayoutFile",
    "dynamic_region_bytes",
    "first_overlap",
    "layout_report",
    "lower_bound",
    "markdown_table",
    "reserved_with_layout",
    "simulate_arrays",
    "simulate_caching_allocator",
    "solve_arrays",
    "solve_layout",
]
