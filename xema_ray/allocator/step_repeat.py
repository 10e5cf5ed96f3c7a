"""A static layout solved for a few denoising steps and repeated for the rest (paper §6: the
steps of a template allocate the same pattern).

The analyzer's step replication (``xema_ray.analyzer.steps.expand_steps``) builds a request's
stream as: set-up and step 0, step 1, step 2 (the pattern), time-shifted copies of step 2, then
the tail (decode). Every allocation of a step is freed by the end of the next step (the analyzer
refuses streams where one lives longer), but some live longer than one step (LTX-2's latents: made
at a step's start, the previous ones freed two events later), so two of their instances are live
at once: the layout repeats with a period of two steps, a *window*. The stream of ``solved_steps``
steps (6 or 7, the parity of the template's) holds steps 0-1, the window ``W`` (steps 2-3), one
more window ``L`` (steps 4-5) and the tail (a last odd step, decode). Its layout is solved with
``W``'s survivors (made in ``W``, freed in ``L``) held from ``W``'s start, where a previous copy's
survivors sit; then ``W``'s offsets are valid for every middle window, and the full layout is:

    rows made before ``L``          offsets as solved (those living past ``L`` shifted in time)
    middle windows                  ``W``'s rows and offsets, shifted by two steps each
    last window                     ``L``'s rows and offsets, shifted
    tail                            as solved, shifted

``expand`` builds it; the solve (``xema_ray.measure.layout_solve``) checks that its allocations are
exactly the worker's full stream's and that it is valid, else solves the full stream. A layout
that repeats this way is valid iff its expansion with two middle windows is (an instant of a
middle window sees a time-shifted copy of what an instant of the second one sees, and the rows
live across the loop at the same addresses), which is what ``verify`` checks: the whole check at
a fifth of the cost for a 50-step template.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.allocator.solver import StaticLayout, lower_bound

#: steps in the repeated window (two: an allocation may outlive its step, never the next one)
PERIOD = 2
#: the fewest steps repetition is used for (fewer: the full stream is solved, it is small)
MIN_STEPS = 10


def solved_steps(steps: int) -> int:
    """Steps of the stream solved for a ``steps``-step layout: two steps, two windows, and one
    step more when ``steps`` is odd."""
    return 6 + (steps % 2)


class StepRepeat(BaseModel):
    """How a layout solved for ``solved_steps`` steps stands for ``steps`` steps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(ge=6, description="denoising steps of the request the layout is for")
    solved_steps: int = Field(ge=6, le=7, description="denoising steps of the stream the layout was solved from")
    pattern_begin: int = Field(ge=0, description="event of the solved stream where the repeated window (step 2) begins")
    pattern_events: int = Field(ge=1, description="events per window (two steps)")
    lower_bound_bytes: int = Field(ge=0, description="max live bytes of the full stream")


def held_from_pattern_start(begin: np.ndarray, end: np.ndarray, rep: StepRepeat) -> np.ndarray:
    """The solver's ``begin``: the window's survivors (made in it, freed in the next window) held
    from the window's start, where the previous copy's survivors sit."""
    a = rep.pattern_begin
    b = a + rep.pattern_events
    survivor = (begin >= a) & (begin < b) & (end >= b)
    out = begin.copy()
    out[survivor] = a
    return out


def expand(short: StaticLayout, rep: StepRepeat, steps: int) -> StaticLayout:
    """The layout for ``steps`` denoising steps (``rep.steps``: the full stream's), rows in allocation order.

    Args:
        short: the solved ``rep.solved_steps``-step layout (real lifetimes, solved offsets).
        rep: where its repeated window lies.
        steps: how many steps to expand to (of the solved stream's parity; ``verify`` asks for fewer).
    """
    if steps < rep.solved_steps or (steps - rep.solved_steps) % PERIOD:
        raise ValueError(f"a layout solved for {rep.solved_steps} steps expands to {rep.solved_steps} + a multiple of "
                         f"{PERIOD} steps, asked for {steps}")
    a, step = rep.pattern_begin, rep.pattern_events
    b, c = a + step, a + 2 * step  # the last window is [b, c), the tail from c
    extra = (steps - rep.solved_steps) // PERIOD
    shift = extra * step
    begin, end, size, offset = short.begin, short.end, short.size, short.offset
    before = begin < b
    pattern = before & (begin >= a)
    last = (begin >= b) & (begin < c)
    tail = begin >= c
    parts_b, parts_e, parts_s, parts_o = [begin[before]], [np.where(end[before] >= c, end[before] + shift, end[before])], \
        [size[before]], [offset[before]]
    pb, pe, ps, po = begin[pattern], end[pattern], size[pattern], offset[pattern]
    for j in range(extra):  # middle windows: the window's rows, shifted by j + 1 windows
        parts_b.append(pb + (j + 1) * step)
        parts_e.append(pe + (j + 1) * step)
        parts_s.append(ps)
        parts_o.append(po)
    for mask in (last, tail):
        parts_b.append(begin[mask] + shift)
        parts_e.append(end[mask] + shift)
        parts_s.append(size[mask])
        parts_o.append(offset[mask])
    nb, ne, ns, no = (np.concatenate(p) for p in (parts_b, parts_e, parts_s, parts_o))
    order = np.argsort(nb, kind="stable")
    nb, ne, ns, no = nb[order], ne[order], ns[order], no[order]
    lb = rep.lower_bound_bytes if steps == rep.steps else (lower_bound(ns, nb, ne, short.alignment) if len(ns) else 0)
    return StaticLayout(size=ns, begin=nb, end=ne, offset=no, n_events=short.n_events + shift, alignment=short.alignment,
                        reserved_bytes=short.reserved_bytes, lower_bound_bytes=lb, solve_seconds=short.solve_seconds,
                        order=short.order, candidates=dict(short.candidates),
                        greedy_reserved_bytes=short.greedy_reserved_bytes, segments=short.segments,
                        refine_rounds=short.refine_rounds, options=short.options, meta=dict(short.meta))


def verify(short: StaticLayout, rep: StepRepeat) -> None:
    """Raise ``ValueError`` unless the full layout is valid: its expansion with two middle windows
    (or the full one, if shorter) is aligned, inside the region and free of overlaps."""
    expand(short, rep, min(rep.steps, rep.solved_steps + 2 * PERIOD)).verify()
