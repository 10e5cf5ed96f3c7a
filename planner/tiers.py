"""The planner's ``tiers`` pass: each (template, quality tier) priced (``docs/quality.md``).

A tier is a variant of a template's plan (``xema_ray.tier_plan.QualityTierSpec``): the same
configuration, its denoising steps computed as the tier's fixed-budget mask says. Its latency is
the entry's latency split by phase on the table's hardware (``xema_ray.profiling.phases``): the
denoising phase is ``steps`` computed steps of ``s`` seconds; a reused step still costs
``reused_step_share * s`` (the loop's work outside the denoiser — the scheduler update, the
pipeline's per-step code, the hook and the copy of the cached output), so each skipped step saves
``(1 - share) * s``. The share is the entry's ``PlanPrediction.reused_step_share`` (measured on a
CPU table, the cost model's elsewhere); for a table planned before it was recorded, the cost
model's on the table's hardware (``xema_ray.profiling.costmodel.reused_step_share``), or 0 on
hardware without a profile (what such tables were priced with). Its memory is the entry's peak
plus the cached outputs, one transformer output per pass of a step (``cached_output_bytes``; the
analyzer traces the same buffers, ``trace_with_mitigations(step_cache=True)``, and a test holds
the two equal). A step-cached batch runs without the entry's static layout (its skipped steps
allocate less than the layout's order expects), on the dynamic region the peak already counts.

Example:
    >>> from xema_ray.plan import ExecutionConfig, PlanEntry, PlanPrediction
    >>> from xema_ray.tier_plan import DEFAULT_TIERS
    >>> from xema_ray.templates import RequestTemplate
    >>> t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=50)
    >>> e = PlanEntry(config=ExecutionConfig(template=t), prediction=PlanPrediction(
    ...     peak_bytes=10**6, latency_s=1.0, goodput_rps=1.0, slo_s=2.0, latency_source="estimated"))
    >>> fast = tier_plan(e, DEFAULT_TIERS["fast"], denoise_share=0.95, reused_share=0.2)
    >>> round(fast.latency_s, 3), round(fast.reused_step_s / fast.step_s, 3), fast.peak_bytes - 10**6
    (0.453, 0.2, 1024)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from xema_ray.analyzer.run import default_dtype_for
from xema_ray.mitigation.step_cache import cached_output_bytes
from xema_ray.models import get_model_spec
from xema_ray.plan import PlanEntry, PlanPrediction, PlanTable
from xema_ray.tier_plan import BALANCED, DEFAULT_TIERS, QualityTierSpec, TierPlan, WeightFormat
from xema_ray.profiling.costmodel import reused_step_share
from xema_ray.profiling.phases import phase_shares, table_profile


class TierNotServed(ValueError):
    """``--quality`` names a tier a planned model does not define."""


def cache_bytes(entry: PlanEntry) -> int:
    """Device bytes a step-cached batch of ``entry`` keeps: its transformer outputs, per pass."""
    t = entry.config.batched_template
    spec = t.spec
    itemsize = default_dtype_for(spec).itemsize
    return cached_output_bytes(spec, math.prod(spec.latent_shape(t)) // t.batch, t.batch, itemsize)


def default_tiers(model: str) -> dict[str, QualityTierSpec]:
    """The tiers ``model`` serves unless its group defines its own: ``DEFAULT_TIERS``, and
    ``balanced`` where its spec names quantizable weights (``ModelSpec.weight_quant``)."""
    if get_model_spec(model).weight_quant is None:
        return DEFAULT_TIERS
    return {**DEFAULT_TIERS, "balanced": BALANCED}


def served(model: str, tiers: Mapping[str, Mapping[str, QualityTierSpec]] | None) -> dict[str, QualityTierSpec]:
    """``model``'s tiers (its group's, else ``default_tiers``), less those quantizing the weights of
    a model whose spec names none (it serves them not: the API's 422 names what it serves)."""
    defined = (tiers or {}).get(model) or default_tiers(model)
    quantizes = get_model_spec(model).weight_quant is not None
    return {n: t for n, t in defined.items() if t.weights == "model" or quantizes}


def planned_format(asked: WeightFormat, profile: Any) -> WeightFormat:
    """The weight format a tier asking for ``asked`` stores on the table's hardware (``profile``;
    None: the CPU, which stores int8)."""
    if profile is None:
        return "model" if asked == "model" else "int8"
    return profile.weight_format(asked)  # type: ignore[no-any-return]


def quality_weights(quality: str | None, models: list[str], tiers: Mapping[str, Mapping[str, QualityTierSpec]],
                    hardware: str) -> dict[str, WeightFormat]:
    """``--quality``'s weight format per planned model where the tier quantizes them (its format on
    ``hardware``: fp8 where the GPU takes it, int8 on the CPU): those templates are planned,
    traced and priced with the quantized weights, their offload chosen for them."""
    from planner.latency import LatencyModel

    if quality is None:
        return {}
    profile = None if hardware == "cpu" else LatencyModel(hardware).hardware
    out = {}
    for model in sorted(set(models)):
        tier = served(model, tiers).get(quality)
        if tier is not None and tier.weights != "model":
            out[model] = planned_format(tier.weights, profile)
    return out


def tier_plan(entry: PlanEntry, tier: QualityTierSpec, denoise_share: float, reused_share: float = 0.0,
              profile: Any = None) -> TierPlan:
    """``entry`` at ``tier``: latency with the tier's computed steps, peak with its cached outputs;
    with quantized weights, the entry's configuration with its weights so (``weights_tier``).

    Args:
        entry: the template's (lossless) plan, or its plan at the tier's weights.
        tier: the tier's definition.
        denoise_share: the denoising loop's share of the entry's latency on its hardware.
        reused_share: a reused step's seconds as a share of a computed step's (``reused_share_of``).
        profile: the table's hardware profile (None: the CPU).
    """
    p = entry.prediction
    fmt = planned_format(tier.weights, profile)
    if fmt != entry.config.weights:
        return weights_tier(entry, fmt, profile)
    t = entry.config.template
    step = p.latency_s * denoise_share / t.steps
    if tier.cache is None:
        return TierPlan(cache=None, weights=fmt, latency_s=p.latency_s, peak_bytes=p.peak_bytes, step_s=step)
    resets = tuple(s.first_step for s in t.spec.expert_stages(t)[1:])
    skipped = t.steps - tier.cache.computed_steps(t.steps, resets)
    reused = step * reused_share
    kept = cache_bytes(entry)
    return TierPlan(cache=tier.cache, weights=fmt, latency_s=p.latency_s - skipped * (step - reused),
                    peak_bytes=p.peak_bytes + kept, cache_bytes=kept, step_s=step, reused_step_s=reused)


def reused_share_of(table: PlanTable, entry: PlanEntry) -> float:
    """What a reused step of ``entry`` costs, as a share of a computed one: the entry's own
    (``PlanPrediction.reused_step_share``), else the cost model's on the table's hardware, else 0."""
    if entry.prediction.reused_step_share is not None:
        return entry.prediction.reused_step_share
    profile = table_profile(table)
    return 0.0 if profile is None else reused_step_share(entry.config, profile)


def weights_tier(entry: PlanEntry, fmt: WeightFormat, profile: Any) -> TierPlan:
    """The lossless ``entry``'s configuration run with its transformer's weights in ``fmt``,
    priced by arithmetic (a table planned without the tier; ``xema plan --quality balanced``
    plans it, its offload chosen for the smaller weights, traced): the latency scaled by the cost
    model's ratio on the table's hardware, the peak less the device-resident weights' savings plus
    the largest layer's dequantized copy (``xema_ray.models.weight_formats.quantized_savings``)."""
    from planner.latency import cpu_profile
    from xema_ray.models.weight_formats import quantized_savings
    from xema_ray.profiling.costmodel import cost_model_estimate

    config, p = entry.config, entry.prediction
    hw = profile if profile is not None else cpu_profile()
    quantized = config.model_copy(update={"weights": fmt})
    ratio = cost_model_estimate(quantized, hw).total_s / cost_model_estimate(config, hw).total_s
    spec = config.template.spec
    offloaded = {b for m in config.mitigations if m.kind in ("block_offload", "hsdp") for b in (m.blocks or ())}
    saved, transient = quantized_savings(spec, fmt)
    resident = 1.0 - len(offloaded) / max(1, spec.num_dit_blocks)
    return TierPlan(cache=None, weights=fmt, latency_s=p.latency_s * ratio,
                    peak_bytes=max(0, p.peak_bytes - int(saved * resident) + transient))


def price_tiers(table: PlanTable, tiers: Mapping[str, Mapping[str, QualityTierSpec]] | None = None,
                only: str | None = None) -> PlanTable:
    """``table`` with every entry's tiers priced (``PlanEntry.tiers``).

    Args:
        table: the planned table (lossless entries, their layouts solved).
        tiers: model -> its tiers (the deployment's ``quality_tiers``); a model not named serves
            ``DEFAULT_TIERS``.
        only: plan this one tier (``xema plan --quality``): each entry becomes the tier's (its
            config carries the schedule, its prediction is the tier's) and lists only it.

    Raises:
        TierNotServed: ``only`` is a tier some planned model does not define.
    """
    shares, profile = phase_shares(table), table_profile(table)
    entries = {}
    not_armed = dict(table.provenance.layouts_not_armed)
    for key, e in table.entries.items():
        defined = served(e.config.template.model, tiers)
        if only is not None and only not in defined:
            raise TierNotServed(f"quality {only!r}: {e.config.template.model} serves {', '.join(sorted(defined))}")
        names = [only] if only is not None else sorted(defined)
        reused = reused_share_of(table, e)
        priced = {n: tier_plan(e, defined[n], shares[key].denoise, reused, profile) for n in names}
        entries[key] = e.model_copy(update={"tiers": priced}) if only is None else _as_tier(e, only, priced[only])
        if only is not None and priced[only].cache is not None:
            not_armed[key] = (f"quality {only}: a step-cached batch runs on the dynamic region (its reused steps "
                              "allocate less, in another order, than a static layout is solved for)")
    provenance = table.provenance.model_copy(update={"layouts_not_armed": not_armed})
    return table.model_copy(update={"entries": entries, "provenance": provenance})


def _as_tier(e: PlanEntry, name: str, tier: TierPlan) -> PlanEntry:
    """``e`` planned at one tier: its config runs the tier's cache, its prediction is the tier's."""
    if tier.cache is None and tier.weights == e.config.weights:
        return e.model_copy(update={"tiers": {name: tier}})
    config = e.config.model_copy(update={"step_cache": tier.cache, "weights": tier.weights, "layout_ref": None})
    p = e.prediction
    goodput = 0.0 if tier.latency_s > p.slo_s else config.dp * config.batch / max(tier.latency_s, 1e-9)
    prediction = PlanPrediction(**{**p.model_dump(), "latency_s": tier.latency_s, "peak_bytes": tier.peak_bytes,
                                   "goodput_rps": goodput, "latency_by_batch": {
                                       n: s * tier.latency_s / p.latency_s for n, s in p.latency_by_batch.items()}
                                   if p.latency_s > 0 else {}})
    return e.model_copy(update={"config": config, "prediction": prediction, "tiers": {name: tier}})
