"""``quality`` (OpenAI's field of ``/v1/images/generations`` and ``/v1/images/edits``) resolved to
one of this deployment's quality tiers (``xema_ray.vocabulary.QualityTier``).

OpenAI's values keep working (gpt-image: ``auto | high | medium | low``; dall-e-3: ``standard | hd``)
and the tier names are accepted as they are:

==========================  =====================================================================
quality                     tier
==========================  =====================================================================
high, hd, standard          lossless
medium                      balanced where the template serves it, else lossless
low                         fast where the template serves it, else the fastest tier it serves
auto                        auto where the template serves a lossy tier, else lossless
lossless, balanced, fast    that tier; a tier the template does not serve is a 422
==========================  =====================================================================

OpenAI's values keep their meaning on every model (a hint, resolved to what is served); a tier
named by its own name is a contract: where the template does not serve it the request is refused
with a 422 naming ``quality`` and the tiers served, never silently run at another. Any other
value is a 422 naming ``quality`` and these values. The tiers a template serves are those its
plan table prices (``PlanEntry.tiers``, the planner's ``tiers`` pass), lossless always;
``auto`` is decided by the model group at the current queue (``serving/group/quality.py``).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from xema_ray.models.options import OptionRefused
from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import QualityTier

#: every value ``quality`` accepts (the document's enum)
QualityValue = Literal["auto", "high", "medium", "low", "standard", "hd", "lossless", "balanced", "fast"]
ACCEPTED: tuple[str, ...] = get_args(QualityValue)

#: what each accepted value asks for, before what is served decides
_ASKED: dict[str, QualityTier] = {
    "high": QualityTier.LOSSLESS, "hd": QualityTier.LOSSLESS, "standard": QualityTier.LOSSLESS,
    "lossless": QualityTier.LOSSLESS, "medium": QualityTier.BALANCED, "balanced": QualityTier.BALANCED,
    "low": QualityTier.FAST, "fast": QualityTier.FAST, "auto": QualityTier.AUTO,
}
#: the lossy tiers, from the most exact to the fastest
_SPEED_ORDER = (QualityTier.LOSSLESS, QualityTier.BALANCED, QualityTier.FAST)


#: the tier names a request may name (they are refused where not served)
TIER_NAMES = frozenset({"lossless", "balanced", "fast"})


def served_tiers(t: RequestTemplate, table: PlanTable | None = None) -> frozenset[QualityTier]:
    """The tiers template ``t`` is served at: lossless, and those ``table`` prices for it."""
    entry = table.entries.get(t.shape_key) if table is not None else None
    priced = {QualityTier(n) for n in entry.tiers} if entry is not None else set()
    return frozenset({QualityTier.LOSSLESS} | priced)


class QualityTierInfo(BaseModel):
    """One quality tier a template is served at, as planned (``TemplateInfo.quality_tiers``)."""

    name: str = Field(description="the tier: the value of ``quality`` that asks for it")
    predicted_latency_s: float = Field(description="predicted latency of one batch at the template's steps")
    predicted_peak_gb: float = Field(description="predicted peak per GPU, the cached outputs included")
    predicted_step_s: float = Field(default=0.0, description="predicted seconds of a denoising step that runs the "
                                                            "denoiser (0: not priced)")
    predicted_reused_step_s: float = Field(default=0.0, description="predicted seconds of a step that reuses the step "
                                                                   "cache's output (0: the tier reuses none)")


def quality_tier_infos(entry: PlanEntry) -> list[QualityTierInfo]:
    """``/v1/templates``' ``quality_tiers`` of a plan entry: lossless first (the entry's own
    prediction where the planner priced no tiers), then the others from the most exact to the fastest."""
    tiers = dict(entry.tiers)
    out = [QualityTierInfo(name="lossless", predicted_latency_s=entry.prediction.latency_s,
                           predicted_peak_gb=entry.prediction.peak_bytes / 1e9)] if "lossless" not in tiers else []
    for name in (t.value for t in _SPEED_ORDER):
        if name in tiers:
            out.append(QualityTierInfo(name=name, predicted_latency_s=tiers[name].latency_s,
                                       predicted_peak_gb=tiers[name].peak_bytes / 1e9,
                                       predicted_step_s=tiers[name].step_s,
                                       predicted_reused_step_s=tiers[name].reused_step_s))
    return out


def resolve_quality(value: str | None, served: frozenset[QualityTier]) -> QualityTier:
    """The tier a request's ``quality`` runs at, given the tiers its template is ``served`` at.

    Args:
        value: the request's ``quality`` (None: not given, lossless); one of ``ACCEPTED`` (the
            request schema refuses any other value with a 422 naming ``quality``).
        served: the template's tiers (``served_tiers``); always holds ``lossless``.

    Example:
        >>> resolve_quality("low", frozenset({QualityTier.LOSSLESS}))
        'lossless'
        >>> resolve_quality("medium", frozenset({QualityTier.LOSSLESS, QualityTier.BALANCED}))
        'balanced'

    Raises:
        OptionRefused: (422, ``quality``) a value not accepted, or a tier named by its name
            that ``served`` lacks (the message lists the served tiers).
    """
    if value is None:
        return QualityTier.LOSSLESS
    if value not in _ASKED:
        raise OptionRefused(f"quality must be one of {', '.join(ACCEPTED)}; got {value!r}", "quality")
    asked = _ASKED[value]
    if asked is QualityTier.AUTO:  # the group picks at its queue; nothing to pick among: lossless
        return asked if len(served) > 1 else QualityTier.LOSSLESS
    if asked in served:
        return asked
    if value in TIER_NAMES:
        tiers = ", ".join(t.value for t in _SPEED_ORDER if t in served)
        raise OptionRefused(f"quality {value!r} is not served for this template; it serves: {tiers}", "quality")
    if asked is QualityTier.FAST:  # the fastest tier served
        return next(t for t in reversed(_SPEED_ORDER) if t in served)
    return QualityTier.LOSSLESS
