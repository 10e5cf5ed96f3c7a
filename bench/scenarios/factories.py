"""Plan entries for tests and scenarios: one factory instead of one per test module.

A hand-made ``PlanEntry`` with a measured latency and a small peak, for serving tests that need a
plan table without planning (the dispatcher batches, preempts and admits by these numbers).

Example:
    >>> from xema_ray.templates import RequestTemplate
    >>> e = plan_entry(RequestTemplate(model="tiny-flux2", width=64, height=64, steps=4), batch=2, latency_s=1.0)
    >>> (e.config.batch, e.prediction.latency_s)
    (2, 1.0)
"""

from __future__ import annotations

from xema_ray.plan import ExecutionConfig, PlanEntry, PlanPrediction
from xema_ray.templates import RequestTemplate


def plan_entry(t: RequestTemplate, *, batch: int = 1, ulysses: int = 1, dp: int = 1, latency_s: float = 0.5,
               slo_s: float = 30.0, layout_ref: str | None = None, peak_bytes: int = 10**7,
               goodput_rps: float = 1.0) -> PlanEntry:
    """A plan entry for ``t`` whose prediction says ``latency_s`` (measured) under ``slo_s``.

    Args:
        t: the template.
        batch, ulysses, dp: the execution configuration's batch size, SP degree and data parallelism.
        latency_s, slo_s, peak_bytes, goodput_rps: the prediction.
        layout_ref: a static layout's id, or None.
    """
    cfg = ExecutionConfig(template=t, batch=batch, ulysses=ulysses, dp=dp, layout_ref=layout_ref)
    return PlanEntry(config=cfg, prediction=PlanPrediction(peak_bytes=peak_bytes, latency_s=latency_s,
                                                           goodput_rps=goodput_rps, slo_s=slo_s,
                                                           latency_source="measured"))
