"""Static memory layout (paper §6): the solver binding, the caching-allocator baseline, reports
and the Figure 7 plot. The plot lives in ``xema_ray.layout.plot`` (imports matplotlib)."""

from xema_ray.layout.caching_sim import CachingAllocatorResult, simulate_arrays, simulate_caching_allocator
from xema_ray.layout.report import LayoutReport, layout_report, markdown_table
from xema_ray.layout.solver import (
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
    "LAYOUT_SCHEMA_VERSION",
    "CachingAllocatorResult",
    "LayoutReport",
    "ReplayPlan",
    "SolverOptions",
    "StaticLayout",
    "StaticLayoutFile",
    "first_overlap",
    "layout_report",
    "lower_bound",
    "markdown_table",
    "simulate_arrays",
    "simulate_caching_allocator",
    "solve_arrays",
    "solve_layout",
]
