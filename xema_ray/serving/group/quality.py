"""The quality tier a batch was served at, for its results (the Router's ``X-Xema-Quality``
header, ``/v1/stats`` and the ``quality`` label of the request metrics).

A step-cached tier asked for by a request too short to skip a step ran every step: it was
served lossless, and its result says so (``quality_note``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the group's module imports no torch (the app's builder imports it)
    from xema_ray.runtime.engine import BatchResult


def served_quality(tier: str, steps: int, lead: BatchResult, cached: bool = True) -> dict[str, Any]:
    """``GenerateResult`` fields for a batch run at ``tier`` over ``steps`` steps, ``lead`` its
    SP rank 0's result (``steps_computed``: the steps that ran the transformer); ``cached``: the
    tier's config runs a step cache (a tier of quantized weights alone is served as asked)."""
    if cached and tier != "lossless" and lead.steps_computed is not None and lead.steps_computed >= steps:
        return {"quality": "lossless", "quality_note": f"{tier} asked; {steps} steps are too few to skip one, "
                                                       "every step was computed"}
    return {"quality": tier}
