"""Plots in the style of the paper's Figures 2 and 13: memory over allocation events, the budget,
pressure intervals shaded, DiT and VAE phases marked; plus the per-phase event CDF."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xema_ray.memory.analysis import event_phases, expert_uses, pressure_intervals
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.vocabulary import Phase, phase_of_trace

_MAX_POINTS = 4000  # envelope points per curve: enough to show every peak of a 300k-event trace


def _envelope(curve: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, min, max over equal buckets, so down-sampling never hides a peak."""
    n = len(curve)
    if n <= _MAX_POINTS:
        x = np.arange(n)
        return x, curve, curve
    edges = np.linspace(0, n, _MAX_POINTS + 1).astype(np.int64)
    lo = np.minimum.reduceat(curve, edges[:-1])
    hi = np.maximum.reduceat(curve, edges[:-1])
    return edges[:-1], lo, hi


def plot_trace(trace: MemoryTrace, path: str | Path, budget: int | None = None, title: str | None = None) -> None:
    """Write a PNG: (a) active memory over events with phases, budget and pressure intervals;
    (b) the CDF of events relative to each phase's peak (DiT and VAE)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = trace.active_curve()
    fig, (ax, ax_cdf) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    ph = event_phases(trace)
    groups = np.array([phase_of_trace(p) for p in trace.phases] + ["?"])[ph]
    colors = {Phase.DENOISE: "#dbe9f6", Phase.DECODE: "#fde2c8"}
    for group, color in colors.items():
        sel = (groups == group).astype(np.int8)
        edges = np.diff(np.concatenate([[0], sel, [0]]))
        for s, e in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
            ax.axvspan(s, e, color=color, lw=0, label=f"{group.upper()} phase" if s == np.flatnonzero(edges == 1)[0] else None)
    x, lo, hi = _envelope(curve / 1e9)
    ax.fill_between(x, lo, hi, color="#1f4e79", lw=0.6, step="post")
    ax.plot(x, hi, color="#1f4e79", lw=0.6, label="active memory")
    floor = trace.size[trace.category != Category.ACTIVATION].sum() / 1e9
    ax.axhline(floor, color="grey", ls=":", lw=1, label=f"weights + inputs {floor:.1f} GB")
    if budget is not None:
        ax.axhline(budget / 1e9, color="#c00000", ls="--", lw=1.2, label=f"budget {budget / 1e9:.0f} GB")
        for i, iv in enumerate(pressure_intervals(trace, budget, curve)):
            ax.axvspan(iv.start, iv.stop, color="#c00000", alpha=0.35, lw=0, label="pressure interval" if i == 0 else None)
    experts = expert_uses(trace)
    for prev, nxt in zip(experts, experts[1:]):
        ax.axvline(nxt.first_event, color="#7030a0", lw=1.4,
                   label=f"expert switch at step {nxt.first_step}: {prev.component} -> {nxt.component}")
    if experts:
        ax.text(0.01, 0.02, "  ".join(f"{e.component} {e.weight_bytes / 1e9:.1f} GB (steps {e.first_step}-{e.last_step})"
                                      for e in experts), transform=ax.transAxes, fontsize=7, color="#7030a0")
    ax.set_xlabel("allocation event")
    ax.set_ylabel("GB (10^9 bytes)")
    ax.set_xlim(0, max(1, trace.n_events))
    ax.set_title(title or trace.meta.get("template", "memory trace"))
    ax.legend(loc="lower right", fontsize=8)

    for group, color in ((Phase.DENOISE, "#1f77b4"), (Phase.DECODE, "#ff7f0e")):
        sel = groups == group
        if not sel.any():
            continue
        vals = curve[sel] - floor * 1e9
        peak = vals.max()
        if peak <= 0:
            continue
        pct = np.sort(vals / peak * 100)
        ax_cdf.plot(pct, np.arange(1, len(pct) + 1) / len(pct) * 100, color=color,
                    label=f"{group.upper()} (peak {peak / 1e9:.1f} GB)")
    ax_cdf.set_xlabel("memory (% of phase peak, above weights)")
    ax_cdf.set_ylabel("events (%)")
    ax_cdf.set_xlim(0, 100)
    ax_cdf.set_ylim(0, 100)
    ax_cdf.grid(alpha=0.3)
    ax_cdf.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
