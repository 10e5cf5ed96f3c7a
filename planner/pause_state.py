"""What a paused batch holds between denoising steps (step-level preemption), from its trace.

The serving dispatcher pauses a running batch for a more urgent one only when the paused state
plus the incoming batch's planned peak fit the budget (or the state fits the host); it needs
the state's size per plan entry: ``PlanPrediction.pause_bytes``. It is read from the same
meta-device trace the planner already made for the entry's batch (``between_step_bytes``: the
non-weight bytes live at a steady step boundary), with a margin for what the paused frame pins
beyond the trace (the step's guidance output still bound to a local; scheduler tables). The
serving group raises it to what its workers measure when they pause.
"""

from __future__ import annotations

import math

from planner.trace_model import PLANNER_STEPS
from planner.traces import TraceCache
from xema_ray.memory.analysis import between_step_bytes
from xema_ray.plan import PlanEntry

#: paused state measured by the worker / traced between-step bytes, tiny models on CPU (where
#: the scheduler's host tables count too): 0.61-1.93; on a GPU those tables stay on the host
PAUSE_MARGIN = 1.25


def with_pause_bytes(entry: PlanEntry, cache: TraceCache) -> PlanEntry:
    """``entry`` with ``prediction.pause_bytes`` from its batch's trace (a cache hit when planned)."""
    t = entry.config.template
    trace = cache.get(t.with_(batch=entry.config.batch, steps=min(t.steps, PLANNER_STEPS)))
    pause = math.ceil(between_step_bytes(trace) * PAUSE_MARGIN)
    return entry.model_copy(update={"prediction": entry.prediction.model_copy(update={"pause_bytes": pause})})
