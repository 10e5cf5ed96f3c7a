"""Static layout benchmark: lower bound, static layout, simulated caching allocator, solve time.

For each trace it reports the lower bound (max live bytes), the paper's Algorithm 1 as published
(largest first, best fit, nothing else), our solver with its defaults (hoisting, compaction, time
segments, refinement), and PyTorch's caching allocator simulated on the same trace; with the
solve time of both solvers (median of ``--repeat`` runs). Traces:

* synthetic: DiT-like requests and random traces (always);
* real: the analyzer's shape-only traces of the paper's templates
  (``xema_ray.analyzer.run.trace_template``; skipped if it is not importable, or with
  ``--synthetic-only``). Tracing real models on the meta device takes seconds to a minute each;
  ``--trace-cache DIR`` keeps them between runs.

Prints a markdown table, writes everything as JSON to ``--out``, optionally the Figure 7 plot of
each trace (``--plots DIR``) and an ablation of the solver's options (``--ablation``).

    python bench/bench_layout.py --out out/bench_layout.json --plots out/layout_plots --ablation
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.allocator import SolverOptions, StaticLayout, simulate_caching_allocator, solve_layout
from xema_ray.allocator.synthetic import diffusion_like_trace, random_trace
from xema_ray.memory.trace import MemoryTrace

BENCH_SCHEMA_VERSION = 1
GIB = float(1 << 30)

# The paper's Algorithm 1: size order, best fit, no compaction / cuts / refinement. Allocations that
# overlap all others (weights) are stacked first: they conflict with everything, so this changes no
# gap Algorithm 1 could use, and without it LTX-2's 4,049 weights make every query scan them
# (1.68 M allocations: minutes instead of seconds).
ALGORITHM_1 = SolverOptions(orders=("size",), hoist_universal=True, compact=False, segment_size=0, refine_iterations=0,
                            descent=False)

# (model, height, width, frames): the templates the issue names, 50 steps, batch 1.
REAL_TEMPLATES = [
    ("cogvideox-5b", 480, 720, 49),
    ("cogvideox-5b", 720, 1280, 49),
    ("flux2", 1024, 1024, 1),
    ("ltx2", 704, 1280, 49),
]

ABLATION = {
    "Algorithm 1": ALGORITHM_1,
    "+ compaction pass": ALGORITHM_1.model_copy(update={"compact": True}),
    "+ time segments": ALGORITHM_1.model_copy(update={"compact": True, "segment_size": 4096}),
    "+ refinement (default)": SolverOptions(),
    "default, orders size+size_longer_first": SolverOptions(orders=("size", "size_longer_first")),
    "default, orders area": SolverOptions(orders=("area",)),
    "default, orders lifetime": SolverOptions(orders=("lifetime",)),
    "default without compaction": SolverOptions(compact=False),
}


class BenchRow(BaseModel):
    """One trace's numbers. Bytes; ratios are to the lower bound; seconds are medians."""

    model_config = ConfigDict(extra="forbid")

    trace: str
    source: str = Field(description="'synthetic' or 'analyzer'")
    allocations: int
    events: int
    lower_bound_bytes: int
    algorithm1_reserved_bytes: int
    algorithm1_seconds: float
    static_reserved_bytes: int
    static_greedy_reserved_bytes: int = Field(description="ours before refinement")
    static_seconds: float
    static_order: str
    static_segments: int
    static_refine_rounds: int
    caching_reserved_bytes: int
    caching_active_peak_bytes: int
    trace_seconds: float | None = Field(default=None, description="time to trace (analyzer only)")
    ablation: dict[str, int] = Field(default_factory=dict, description="reserved bytes per option set")

    def ratio(self, value: int) -> float:
        return value / self.lower_bound_bytes if self.lower_bound_bytes else 1.0


class BenchReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = BENCH_SCHEMA_VERSION
    repeat: int
    rows: list[BenchRow]


def synthetic_traces() -> Iterator[tuple[str, Callable[[], MemoryTrace]]]:
    yield "synthetic DiT 42 blocks x 50 steps", lambda: diffusion_like_trace(blocks=42, steps=50, vae_chunks=6)
    yield "synthetic DiT 42 blocks x 170 steps", lambda: diffusion_like_trace(blocks=42, steps=170, vae_chunks=6)
    yield "random 100k, <=64 live", lambda: random_trace(100_000, seed=1, max_live=64)
    yield "random 100k, <=256 live", lambda: random_trace(100_000, seed=2, max_live=256)


def real_traces(cache: Path | None) -> Iterator[tuple[str, Callable[[], MemoryTrace]]]:
    try:
        from xema_ray.analyzer.run import trace_template
        from xema_ray.templates import RequestTemplate
    except ImportError as e:
        print(f"analyzer not importable ({e}); real traces skipped", file=sys.stderr)
        return
    for model, height, width, frames in REAL_TEMPLATES:
        template = RequestTemplate(model=model, height=height, width=width, frames=frames)

        def load(template: RequestTemplate = template) -> MemoryTrace:
            path = cache / (template.key.replace("/", "_") + ".json") if cache else None
            if path is not None and path.is_file():
                return MemoryTrace.load(path)
            trace = trace_template(template)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                trace.save(path)
            return trace

        yield template.key, load


def timed_solve(trace: MemoryTrace, options: SolverOptions, repeat: int) -> tuple[StaticLayout, float]:
    runs = [solve_layout(trace, options) for _ in range(repeat)]
    return runs[-1], statistics.median(r.solve_seconds for r in runs)


def bench_one(name: str, source: str, make: Callable[[], MemoryTrace], repeat: int, ablation: bool,
              plots: Path | None) -> BenchRow:
    t0 = time.perf_counter()
    trace = make()
    trace_seconds = time.perf_counter() - t0 if source == "analyzer" else None
    paper, paper_s = timed_solve(trace, ALGORITHM_1, repeat)
    ours, ours_s = timed_solve(trace, SolverOptions(), repeat)
    ours.verify()
    caching = simulate_caching_allocator(trace)
    row = BenchRow(
        trace=name,
        source=source,
        allocations=len(trace),
        events=trace.n_events,
        lower_bound_bytes=ours.lower_bound_bytes,
        algorithm1_reserved_bytes=paper.reserved_bytes,
        algorithm1_seconds=paper_s,
        static_reserved_bytes=ours.reserved_bytes,
        static_greedy_reserved_bytes=ours.greedy_reserved_bytes,
        static_seconds=ours_s,
        static_order=ours.order,
        static_segments=ours.segments,
        static_refine_rounds=ours.refine_rounds,
        caching_reserved_bytes=caching.reserved_peak_bytes,
        caching_active_peak_bytes=caching.active_peak_bytes,
        trace_seconds=trace_seconds,
    )
    if ablation:
        row.ablation = {label: solve_layout(trace, opts).reserved_bytes for label, opts in ABLATION.items()}
    if plots is not None:
        from xema_ray.allocator.plot import plot_address_time

        plots.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        plot_address_time(trace, ours, caching, plots / f"{safe}.png", title=name)
    return row


def markdown(rows: list[BenchRow]) -> str:
    lines = [
        "| trace | allocations | lower bound (GiB) | Algorithm 1 | ours | caching allocator (sim.) "
        "| Algorithm 1 solve (s) | ours solve (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.trace} | {r.allocations:,} | {r.lower_bound_bytes / GIB:.2f} "
            f"| {r.algorithm1_reserved_bytes / GIB:.2f} ({r.ratio(r.algorithm1_reserved_bytes):.3f}x) "
            f"| {r.static_reserved_bytes / GIB:.2f} ({r.ratio(r.static_reserved_bytes):.3f}x) "
            f"| {r.caching_reserved_bytes / GIB:.2f} ({r.ratio(r.caching_reserved_bytes):.3f}x) "
            f"| {r.algorithm1_seconds:.2f} | {r.static_seconds:.2f} |"
        )
    return "\n".join(lines)


def ablation_markdown(rows: list[BenchRow]) -> str:
    labels = list(ABLATION)
    lines = ["| options | " + " | ".join(r.trace for r in rows) + " |", "| --- |" + " ---: |" * len(rows)]
    for label in labels:
        cells = [f"{r.ratio(r.ablation[label]):.4f}" if label in r.ablation else "-" for r in rows]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON report path")
    ap.add_argument("--repeat", type=int, default=3, help="solves per configuration (median time)")
    ap.add_argument("--synthetic-only", action="store_true", help="skip the analyzer's real traces")
    ap.add_argument("--real-only", action="store_true", help="skip the synthetic traces")
    ap.add_argument("--trace-cache", type=Path, default=None, help="directory to keep real traces in")
    ap.add_argument("--plots", type=Path, default=None, help="directory for Figure 7 plots")
    ap.add_argument("--ablation", action="store_true", help="also solve with each option set")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")

    jobs: list[tuple[str, str, Callable[[], MemoryTrace]]] = []
    if not args.real_only:
        jobs += [(name, "synthetic", make) for name, make in synthetic_traces()]
    if not args.synthetic_only:
        jobs += [(name, "analyzer", make) for name, make in real_traces(args.trace_cache)]

    rows: list[BenchRow] = []
    for name, source, make in jobs:
        print(f"... {name}", file=sys.stderr, flush=True)
        rows.append(bench_one(name, source, make, args.repeat, args.ablation, args.plots))

    report = BenchReport(repeat=args.repeat, rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report.model_dump_json(indent=1))
    print(markdown(rows))
    if args.ablation:
        print()
        print("Reserved / lower bound per solver option set:")
        print()
        print(ablation_markdown(rows))


if __name__ == "__main__":
    main()
