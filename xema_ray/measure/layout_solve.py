"""Static layouts per plan entry (paper §6): solved from the serving worker's own allocation
stream, stored next to the plan table, validated and armed by the worker.

``solve_entry_layout(config)`` runs the worker's load + execute on the meta device (as ``xema
verify`` does), with the analyzer's step markers, expands the traced steps to the template's
(the analyzer checks each step repeats the same allocations), keeps the request's allocations
(everything after the weights are placed) and solves their layout (Algorithm 1, C++): for a
template of 10 or more steps, the layout of its first 6 or 7 steps and tail, repeated for the
other steps (``xema_ray.allocator.step_repeat``: a 50-step LTX-2 1080p layout is solved from
303 k allocations instead of 2.4 M, its file 9.5 MB instead of ~55 MB) where that is exactly the
full stream's layout, else the full stream's. The stream is always that of a process started with
``PYTHONHASHSEED=0`` (``xema_ray.hash_seed``), as the serving workers are. The file
(``xema_ray.allocator.artifact``) is ``<plan table>.layouts/<layout_id>.json``: versioned (``LAYOUT_FILE_VERSION``), hashed
(``layout_id`` is the solved layout's content hash, checked again on load) and tagged with the
GPU model it is for (flash attention's scratch and cuBLAS workspaces differ per GPU). Where the
layouts folder holds a record of that GPU model's GPU-only allocations taken against the same
stream (``device-allocs/<gpu>.json``, ``xema_ray.allocator.device_allocs``), they are included
before solving; the artifact carries the entry it included (or why none) and the rows the runtime
plan leaves out (allocations the GPU makes on another stream).

``xema_ray.allocator.layout_replay.replay(layout, trace)`` feeds a request's allocation stream through the
C++ runtime allocator's host arena with the layout armed: ``xema verify`` uses it to prove, on a
CPU, that the worker's stream is the one the layout was solved for.
"""


from __future__ import annotations

from pathlib import Path

import numpy as np

from xema_ray.allocator import step_repeat
from xema_ray.allocator.artifact import LayoutArtifact, content_id
from xema_ray.allocator.device_allocs import include, lookup
from xema_ray.allocator.solver import SolverOptions, StaticLayout, lower_bound, solve_arrays
from xema_ray.allocator.step_repeat import MIN_STEPS, StepRepeat, solved_steps
from xema_ray.memory.trace import MemoryTrace
from xema_ray.plan import ExecutionConfig


def solve_entry_layout(config: ExecutionConfig, gpu: str, layouts_dir: Path | None = None) -> LayoutArtifact:
    """Solve ``config``'s layout from the serving worker's allocation stream for one batch (steps
    expanded; the load excluded: weights are placed before any request, the layout covers what a
    request allocates).

    With ``MIN_STEPS`` or more steps and no GPU-only allocations to include, the 6- or 7-step
    stream is solved and repeated (``xema_ray.allocator.step_repeat``) where its expansion is exactly the
    worker's full stream and valid; else (the artifact's ``repeat_note`` says why) the full
    stream is solved.

    Args:
        config: the plan entry's configuration.
        gpu: the GPU model the layout is for ('any' on CPU tables).
        layouts_dir: the table's layouts folder; where it holds a record of GPU-only allocations
            for ``gpu`` taken against this very stream (``xema_ray.allocator.device_allocs``), they
            are put into the stream before solving, and the artifact says so (or why not).
    """
    from xema_ray.measure.verify import worker_streams

    steps = config.template.steps
    # an expert swap's steps differ by design (the prefetch, the switch): its full stream is solved
    swap = config.experts is not None and config.experts.strategy == "swap_prefetched"
    repeat = steps >= MIN_STEPS and not swap
    traces = worker_streams(config, (steps, solved_steps(steps)) if repeat else (steps,))
    trace = traces[0]
    entry, note, _ = lookup(layouts_dir, gpu, trace) if gpu != "any" else (None, "CPU table: no GPU model", None)
    planned = np.ones(len(trace), dtype=bool)
    rep, repeat_note, short, full = None, "", None, None
    if entry is not None:
        trace, planned = include(trace, entry)
        repeat_note = "GPU-only allocations included: the full stream is solved" if repeat else ""
    elif repeat:
        short, full, rep, repeat_note = _solve_repeated(trace, traces[1])
    if short is None:
        layout = solve_arrays(trace.size, trace.begin, trace.end, n_events=trace.n_events)
        layout.meta.update(trace.meta)
        layout.verify()
        full, stored = layout, layout
    else:
        stored = short
    assert full is not None
    return LayoutArtifact(layout_id=content_id(full), gpu=gpu, template=config.template.shape_key,
                          config_hash=config.config_hash(), steps=steps,
                          loaded_bytes=trace.loaded_bytes, layout=stored.to_file(), step_repeat=rep,
                          repeat_note=repeat_note, device_allocs=entry, device_allocs_note=note,
                          unplanned_rows=[int(i) for i in np.flatnonzero(~planned)])


#: above this many allocations the solver's compaction pass is skipped. Measured on LTX-2
#: 1920x1088x49's 6-step stream (302,919 allocations): 10 of its 17.6 CPU s, and the same reserved
#: bytes without it (the refinement and descent reach the lower bound either way).
COMPACT_MAX_ALLOCATIONS = 100_000


def repeat_options(n: int) -> SolverOptions:
    """Solver options for a short stream of ``n`` allocations (part of the layout's identity)."""
    return SolverOptions() if n <= COMPACT_MAX_ALLOCATIONS else SolverOptions(compact=False)


def _solve_repeated(full: MemoryTrace, short: MemoryTrace
                    ) -> tuple[StaticLayout | None, StaticLayout | None, StepRepeat | None, str]:
    """The short stream's layout that repeats to ``full``'s, its expansion and how; or (None,
    None, None, why not)."""
    bounds, n = short.step_bounds, solved_steps(len(full.step_bounds))
    if len(bounds) != n:
        return None, None, None, f"the {n}-step stream has {len(bounds)} step bounds"
    a, b = bounds[1], bounds[3]  # the window: steps 2 and 3, [bounds[1], bounds[3]) (bounds[k]: step k+1's start)
    rep = StepRepeat(steps=len(full.step_bounds), solved_steps=n, pattern_begin=a, pattern_events=b - a,
                     lower_bound_bytes=lower_bound(full.size, full.begin, full.end) if len(full) else 0)
    held = step_repeat.held_from_pattern_start(short.begin, short.end, rep)
    solved = solve_arrays(short.size, held, short.end, n_events=short.n_events, options=repeat_options(len(short)))
    layout = StaticLayout(**{**solved.__dict__, "begin": short.begin.copy(),
                             "lower_bound_bytes": lower_bound(short.size, short.begin, short.end) if len(short) else 0})
    layout.meta.update(short.meta)
    expanded = step_repeat.expand(layout, rep, rep.steps)
    order = np.argsort(full.begin, kind="stable")
    if not (np.array_equal(expanded.begin, full.begin[order]) and np.array_equal(expanded.end, full.end[order])
            and np.array_equal(expanded.size, full.size[order]) and expanded.n_events == full.n_events):
        return None, None, None, f"the {n}-step stream repeated is not the full stream"
    try:
        step_repeat.verify(layout, rep)
    except ValueError as e:
        return None, None, None, f"the repeated layout is not valid ({e})"
    return layout, expanded, rep, ""


