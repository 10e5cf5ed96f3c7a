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
auto                        auto where the template serves it, else lossless
lossless, balanced, fast    that tier where served, else as medium / low
==========================  =====================================================================

Any other value is a 422 naming ``quality`` and these values. A template serves ``lossless``
only until its plan table names other tiers (``served_tiers``): every value resolves to
``lossless`` there, and the request runs exactly as without ``quality``.
"""

from __future__ import annotations

from typing import Literal, get_args

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


def served_tiers(t: RequestTemplate) -> frozenset[QualityTier]:
    """The tiers template ``t`` is served at. Every template is planned lossless; a plan table that
    plans other tiers per template adds them here."""
    del t  # one tier for every template until plans name more
    return frozenset({QualityTier.LOSSLESS})


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
    """
    if value is None:
        return QualityTier.LOSSLESS
    if value not in _ASKED:
        raise ValueError(f"quality must be one of {', '.join(ACCEPTED)}; got {value!r}")
    asked = _ASKED[value]
    if asked in served:
        return asked
    if asked is QualityTier.FAST:  # the fastest tier served
        return next(t for t in reversed(_SPEED_ORDER) if t in served)
    return QualityTier.LOSSLESS
