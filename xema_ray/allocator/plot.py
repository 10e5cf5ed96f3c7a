"""The paper's Figure 7: allocations on the address × time plane, static layout vs caching allocator.

Each allocation is a rectangle (lifetime × address range). The left panel is the static layout
(``StaticLayout``), the right one PyTorch's caching allocator as simulated on the same trace
(``CachingAllocatorResult``), with its segments drawn behind the blocks. Dashed lines mark the
lower bound (max live bytes) and each allocator's reserved peak.

Example:
    >>> from xema_ray.allocator import solve_layout, simulate_caching_allocator
    >>> from xema_ray.allocator.synthetic import diffusion_like_trace
    >>> t = diffusion_like_trace(blocks=2, steps=2)
    >>> path = plot_address_time(t, solve_layout(t), simulate_caching_allocator(t), "/tmp/fig7.png")
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from xema_ray.allocator.caching_sim import CachingAllocatorResult, round_size
from xema_ray.allocator.solver import StaticLayout
from xema_ray.memory.trace import Category, MemoryTrace

_GIB = float(1 << 30)
_COLOURS = {
    int(Category.WEIGHT): "#8c8c8c",
    int(Category.INPUT): "#4c72b0",
    int(Category.ACTIVATION): "#dd8452",
}


def _rectangles(begin: np.ndarray, end: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """(n, 4, 2) polygon vertices for rectangles [begin, end) × [lo, hi) in GiB."""
    b, e = begin.astype(float), end.astype(float)
    y0, y1 = lo / _GIB, hi / _GIB
    return np.stack([np.stack([b, y0], 1), np.stack([e, y0], 1), np.stack([e, y1], 1), np.stack([b, y1], 1)], 1)


def plot_address_time(
    trace: MemoryTrace,
    layout: StaticLayout,
    caching: CachingAllocatorResult,
    path: str | Path,
    *,
    title: str | None = None,
) -> Path:
    """Draw Figure 7 for one trace and write it to ``path`` (format from the suffix).

    Args:
        trace: the trace both allocators placed (categories colour the rectangles).
        layout: its static layout (``solve_layout(trace)``).
        caching: its caching-allocator simulation (``simulate_caching_allocator(trace)``).
        path: output file (.png, .pdf, .svg).
        title: figure title; the trace's ``meta["template"]`` when present.
    """
    if len(layout) != len(trace) or len(caching.address) != len(trace):
        raise ValueError(
            f"trace has {len(trace)} allocations, layout {len(layout)}, caching simulation {len(caching.address)}"
        )
    path = Path(path)
    nz = np.flatnonzero(trace.size > 0)
    colours = [_COLOURS.get(int(c), "#55a868") for c in trace.category[nz]]
    lower = layout.lower_bound_bytes / _GIB

    # An Agg canvas on a bare Figure: no pyplot, so no global backend switch and no display needed.
    fig = Figure(figsize=(13, 5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    static_hi = layout.offset[nz] + (trace.size[nz] + layout.alignment - 1) // layout.alignment * layout.alignment
    caching_hi = caching.address[nz] + np.array([round_size(int(s)) for s in trace.nbytes[nz]], dtype=np.int64)
    panels = (
        (axes[0], "static layout (xema_ray.allocator)", layout.offset[nz], static_hi, layout.reserved_bytes),
        (axes[1], "PyTorch caching allocator (simulated)", caching.address[nz], caching_hi, caching.reserved_peak_bytes),
    )
    for ax, name, lo, hi, reserved in panels:
        if ax is axes[1] and caching.segments:
            seg = np.array([(s.created, s.address, s.address + s.size) for s in caching.segments], dtype=np.int64)
            ends = np.full(len(seg), trace.n_events)
            ax.add_collection(
                PolyCollection(
                    _rectangles(seg[:, 0], ends, seg[:, 1], seg[:, 2]),
                    facecolors="#f0f0f0",
                    edgecolors="#bbbbbb",
                    linewidths=0.3,
                )
            )
        ax.add_collection(
            PolyCollection(
                _rectangles(trace.begin[nz], trace.end[nz], lo, hi),
                facecolors=colours,
                edgecolors="none",
                rasterized=len(nz) > 2000,
            )
        )
        ax.axhline(lower, color="black", linestyle="--", linewidth=0.8, label=f"lower bound {lower:.2f} GiB")
        ax.axhline(
            reserved / _GIB, color="#c44e52", linestyle="--", linewidth=0.8, label=f"reserved {reserved / _GIB:.2f} GiB"
        )
        ax.set_xlim(0, max(trace.n_events, 1))
        ax.set_title(name)
        ax.set_xlabel("time (allocator event)")
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_ylabel("address (GiB)")
    axes[0].set_ylim(0, max(layout.reserved_bytes, caching.reserved_peak_bytes, 1) / _GIB * 1.05)
    fig.suptitle(title or trace.meta.get("template", "memory layout"))
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    return path
