"""``quality: auto`` decided at the queue (``docs/quality.md``): lossless while the queue lets a
lossless request meet its SLO; under load, the fastest served tier whose predicted latency meets
it; where none does, lossless (a lossy answer would be late all the same).

Example:
    >>> from xema_ray.plan import ExecutionConfig, PlanEntry, PlanPrediction
    >>> from xema_ray.tier_plan import StepCacheSchedule, TierPlan
    >>> from xema_ray.templates import RequestTemplate
    >>> t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=50)
    >>> e = PlanEntry(config=ExecutionConfig(template=t), prediction=PlanPrediction(
    ...     peak_bytes=1, latency_s=1.0, goodput_rps=1.0, slo_s=2.5, latency_source="estimated"),
    ...     tiers={"lossless": TierPlan(latency_s=1.0, peak_bytes=1),
    ...            "fast": TierPlan(cache=StepCacheSchedule(), latency_s=0.5, peak_bytes=2)})
    >>> choose_auto(e, queued=0, groups=1), choose_auto(e, queued=2, groups=1), choose_auto(e, queued=9, groups=1)
    ('lossless', 'fast', 'lossless')
"""

from __future__ import annotations

import math

from xema_ray.plan import PlanEntry

#: the tiers from the most exact to the fastest
SPEED_ORDER = ("lossless", "balanced", "fast")


def choose_auto(entry: PlanEntry, queued: int, groups: int) -> str:
    """The tier an ``auto`` request of ``entry``'s template runs at, with ``queued`` requests of
    the template ahead of it and ``groups`` SP groups serving it (each queued batch waits a
    lossless batch's latency on one of them).

    Args:
        entry: the template's plan (its ``tiers`` priced by the planner).
        queued: requests of the template waiting before this one.
        groups: batches of the template that run at once.
    """
    slo = entry.prediction.slo_s
    wait = math.ceil(queued / max(1, entry.config.batch)) * entry.prediction.latency_s / max(1, groups)
    if wait + entry.prediction.latency_s <= slo:
        return "lossless"
    served = [n for n in SPEED_ORDER if n in entry.tiers and n != "lossless"]
    for name in reversed(served):
        if wait + entry.tiers[name].latency_s <= slo:
            return name
    return "lossless"
