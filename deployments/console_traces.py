"""The memory trace of a served template at its planned configuration, for the operator view
(``/v1/console/traces/{template}``; the Router gets ``trace_view`` from ``build_app``, as the serving
library does not import the planner).

Made from the analyzer's data as the planner sees it (``planner.trace_model``): the template's
shape-only trace on the meta device at the planned batch (the planner's steps), turned into the
reserved bytes per GPU of the planned configuration by the planner's memory model, once without
and once with the plan's mitigations. Pressure intervals are those of the unmitigated curve
against the budget; each mitigation's span is where applying it alone changes the curve. Traced
once per template and configuration in this process (a few seconds for a real-size model, well
under one for the tiny ones), in a thread, one at a time.
"""

from __future__ import annotations

import threading

import numpy as np

from xema_ray.plan import ExecutionConfig, Mitigation, PlanEntry
from xema_ray.serving.console.schemas import Span, TraceView, mitigation_label
from xema_ray.vocabulary import Phase

#: buckets a curve is down-sampled to (a laptop-wide SVG has about this many pixels)
MAX_POINTS = 600

_LOCK = threading.Lock()
_CACHE: dict[tuple[str, str], TraceView] = {}


def _buckets(n: int) -> np.ndarray:
    """First event of each bucket (at most ``MAX_POINTS``)."""
    if n <= MAX_POINTS:
        return np.arange(n, dtype=np.int64)
    return np.unique(np.linspace(0, n, MAX_POINTS + 1).astype(np.int64)[:-1])


def _bucket_max(curve: np.ndarray, starts: np.ndarray) -> list[int]:
    return [int(v) for v in np.maximum.reduceat(curve, starts)]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) runs where ``mask`` is true."""
    if not mask.any():
        return []
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist(), strict=True))


def _mitigation_spans(model, cfg0: ExecutionConfig, base: np.ndarray, mitigations: tuple[Mitigation, ...]) -> list[Span]:  # type: ignore[no-untyped-def]
    out = []
    tol = max(1.0, float(base.max()) * 1e-3)
    for m in mitigations:
        if m.events is not None:
            out.append(Span(start=m.events[0], stop=m.events[1], label=mitigation_label(m)))
            continue
        alone, _ = model.reserved_curve(cfg0.model_copy(update={"mitigations": (m,)}))
        changed = np.abs(alone - base) > tol
        # one span per mitigation: from where it first changes the curve to where it last does
        runs = _runs(changed)
        if runs:
            out.append(Span(start=runs[0][0], stop=runs[-1][1], label=mitigation_label(m)))
        else:
            out.append(Span(start=0, stop=0, label=mitigation_label(m) + ": changes nothing at this batch"))
    return out


def trace_view(template_key: str, entry: PlanEntry, budget: int) -> TraceView:
    """The trace view of ``entry`` (cached per template and configuration)."""
    key = (template_key, entry.config.config_hash())
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _compute(template_key, entry, budget)
        return _CACHE[key]


def _compute(template_key: str, entry: PlanEntry, budget: int) -> TraceView:
    from planner.trace_model import PLANNER_STEPS, TracePlannerModel
    from planner.traces import TraceCache

    cfg = entry.config
    t = cfg.template
    model = TracePlannerModel(t, lambda c: 0.0, TraceCache())
    cfg0 = cfg.model_copy(update={"mitigations": ()})
    base, prof = model.reserved_curve(cfg0)
    mitigated, _ = model.reserved_curve(cfg)
    starts = _buckets(len(base))
    intervals = model.memory(cfg0, budget).intervals
    pressure = [Span(start=iv.start, stop=iv.stop, peak_bytes=iv.peak_bytes,
                     label=f"+{(iv.peak_bytes - budget) / 1e6:.1f} MB over the budget"
                           + (f" in {', '.join(iv.phases)}" if iv.phases else ""))
                for iv in intervals]
    phases = [Span(start=s, stop=e, label=str(p.value)) for p in Phase for s, e in prof.group_runs(p)]
    return TraceView(
        template=template_key, config=cfg.describe(), events=len(base), steps_traced=min(t.steps, PLANNER_STEPS),
        budget_bytes=budget, x=[int(v) for v in starts], unmitigated=_bucket_max(base, starts),
        mitigated=_bucket_max(mitigated, starts), predicted_peak_bytes=entry.prediction.peak_bytes,
        pressure=pressure, mitigations=_mitigation_spans(model, cfg0, base, cfg.mitigations),
        phases=sorted(phases, key=lambda s: s.start))
