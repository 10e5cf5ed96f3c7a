"""Static layout vs lower bound vs PyTorch's caching allocator for one trace: what
``xema analyze ... --layout`` prints and ``bench/bench_layout.py`` tabulates.

Example:
    >>> from xema_ray.allocator.synthetic import diffusion_like_trace
    >>> report = layout_report(diffusion_like_trace(blocks=2, steps=2), name="toy")
    >>> report.static_reserved_bytes >= report.lower_bound_bytes
    True
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.allocator.caching_sim import simulate_caching_allocator
from xema_ray.allocator.solver import SolverOptions, StaticLayout, solve_layout
from xema_ray.memory.trace import MemoryTrace

_GIB = float(1 << 30)


class LayoutReport(BaseModel):
    """Reserved memory of one trace under each allocator. Bytes; ratios are to the lower bound."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="What was traced (template key or generator).")
    allocations: int = Field(ge=0)
    events: int = Field(ge=0)
    lower_bound_bytes: int = Field(ge=0, description="Max live bytes at any instant.")
    static_reserved_bytes: int = Field(ge=0, description="Static layout's reserved peak.")
    caching_reserved_bytes: int = Field(ge=0, description="Simulated caching allocator's reserved peak.")
    solve_seconds: float = Field(ge=0, description="Wall time of the C++ solve.")
    order: str = Field(description="Visit order that won.")
    candidates: dict[str, int] = Field(description="Static reserved bytes per visit order tried.")

    @property
    def static_ratio(self) -> float:
        return self.static_reserved_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    @property
    def caching_ratio(self) -> float:
        return self.caching_reserved_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0


def layout_report(
    trace: MemoryTrace, *, name: str | None = None, options: SolverOptions | None = None
) -> LayoutReport:
    """Solve the layout of ``trace`` and simulate the caching allocator on it.

    Args:
        trace: the trace.
        name: row label; the trace's ``meta["template"]`` (or "trace") when omitted.
        options: solver options.
    """
    layout = solve_layout(trace, options)
    return report_from(trace, layout, name=name)


def report_from(trace: MemoryTrace, layout: StaticLayout, *, name: str | None = None) -> LayoutReport:
    """A report for a layout already solved (the caching allocator is simulated here)."""
    caching = simulate_caching_allocator(trace)
    return LayoutReport(
        name=name or trace.meta.get("template", "trace"),
        allocations=len(trace),
        events=trace.n_events,
        lower_bound_bytes=layout.lower_bound_bytes,
        static_reserved_bytes=layout.reserved_bytes,
        caching_reserved_bytes=caching.reserved_peak_bytes,
        solve_seconds=layout.solve_seconds,
        order=layout.order,
        candidates=layout.candidates,
    )


def markdown_table(reports: list[LayoutReport]) -> str:
    """Reports as a markdown table (GiB = 2^30 bytes)."""
    lines = [
        "| trace | allocations | lower bound (GiB) | static layout (GiB) | static / LB "
        "| caching allocator (GiB) | caching / LB | solve (s) | order |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in reports:
        lines.append(
            f"| {r.name} | {r.allocations:,} | {r.lower_bound_bytes / _GIB:.3f} | {r.static_reserved_bytes / _GIB:.3f} "
            f"| {r.static_ratio:.4f} | {r.caching_reserved_bytes / _GIB:.3f} | {r.caching_ratio:.4f} "
            f"| {r.solve_seconds:.3f} | {r.order} |"
        )
    return "\n".join(lines)
