"""Quality tiers as plan data: a tier's fixed-budget step cache (``StepCacheSchedule``), what a
deployment's tier runs (``QualityTierSpec``, ``DEFAULT_TIERS``) and one tier of a template as
planned (``TierPlan``, in ``PlanEntry.tiers``). Frozen and JSON like the rest of the plan
(``xema_ray.plan``); ``docs/quality.md`` says what each tier is."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StepCacheSchedule(BaseModel):
    """A fixed-budget step cache (the ``fast`` tier's ``cache``): which denoising steps run the
    transformer and which reuse its last computed output. A fraction of the request's steps, so
    it scales with ``num_inference_steps``: ``warmup`` of them computed first, then one step in
    ``compute_every``, and the last ``final`` computed; the budget depends on the step count only,
    never on the input (a threshold cache's latency would). Each expert stage (Wan2.2) starts its
    own warm-up: the cache resets at the switch. ``xema_ray.mitigation.step_cache`` runs it.

    Example:
        >>> s = StepCacheSchedule()
        >>> s.computed_steps(50), s.computed_steps(28), s.computed_steps(3)
        (14, 8, 3)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    warmup: float = Field(default=0.1, ge=0, le=1, description="fraction of a stage's steps computed first")
    min_warmup: int = Field(default=2, ge=1, description="warm-up steps at least (a short request computes them all)")
    compute_every: int = Field(default=5, ge=2, description="after warm-up, one step in this many is computed; "
                                                             "the others reuse the cached output")
    final: int = Field(default=1, ge=0, description="last steps of a stage always computed")

    def stage_mask(self, steps: int) -> tuple[int, ...]:
        """1: computed, 0: reused, for a stage of ``steps`` steps."""
        warm = min(steps, max(self.min_warmup, math.ceil(self.warmup * steps)))
        tail = min(self.final, steps - warm)
        middle = steps - warm - tail
        return (1,) * warm + tuple(1 if i % self.compute_every == self.compute_every - 1 else 0
                                   for i in range(middle)) + (1,) * tail

    def mask(self, steps: int, resets: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The request's mask over ``steps`` steps; ``resets``: steps where a new stage begins
        (an expert switch), each starting its own warm-up."""
        bounds = [0, *sorted(r for r in set(resets) if 0 < r < steps), steps]
        return tuple(m for a, b in zip(bounds, bounds[1:], strict=False) for m in self.stage_mask(b - a))

    def computed_steps(self, steps: int, resets: tuple[int, ...] = ()) -> int:
        """Steps that run the transformer (the latency the planner prices)."""
        return sum(self.mask(steps, resets))

    def describe(self) -> str:
        return f"step_cache(warmup {self.warmup:g}, 1/{self.compute_every}, final {self.final})"


#: a weight format: ``model`` (the model's own dtype: bf16 for real models, fp32 for the tiny ones),
#: ``fp8`` (e4m3 weight-only, per-channel scales) or ``int8`` (weight-only, per-channel scales)
WeightFormat = Literal["model", "fp8", "int8"]

#: the tier names a deployment may define (``auto`` is a choice among them, not a tier of its own)
TierName = Literal["lossless", "balanced", "fast"]


class QualityTierSpec(BaseModel):
    """What a quality tier runs: ``{cache, weights}`` (the deployment YAML's ``quality_tiers``).

    Example:
        >>> sorted(DEFAULT_TIERS), DEFAULT_TIERS["lossless"].cache is None
        (['fast', 'lossless'], True)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    cache: StepCacheSchedule | None = Field(default=None, description="a fixed-budget step cache; None: every step")
    weights: WeightFormat = Field(default="model", description="the transformer's weight format: 'model' (its own "
                                                                "dtype), 'fp8' (int8 where the hardware stores no fp8) "
                                                                "or 'int8' (weight-only, docs/quality.md)")


#: the tiers every model serves unless its group defines its own: lossless and the default step cache
DEFAULT_TIERS: dict[str, QualityTierSpec] = {"lossless": QualityTierSpec(),
                                             "fast": QualityTierSpec(cache=StepCacheSchedule())}
#: the default ``balanced`` tier: every step, the transformer's weights stored in fp8 (int8 where the
#: hardware stores no fp8: the CPU); served by default where the model's spec says which layers quantize
BALANCED = QualityTierSpec(weights="fp8")


def check_tiers(tiers: dict[str, QualityTierSpec]) -> dict[str, QualityTierSpec]:
    """Raise ValueError unless ``tiers`` holds ``lossless`` as every step in the model's weights
    and only tier names (``TierName``)."""
    names = TierName.__args__  # type: ignore[attr-defined]
    bad = sorted(set(tiers) - set(names))
    if bad:
        raise ValueError(f"quality_tiers: unknown tier(s) {bad}; a tier is one of {', '.join(names)}")
    if tiers.get("lossless") != QualityTierSpec():
        raise ValueError("quality_tiers: lossless must be served, with no cache and the model's weights "
                         "(it is the default every request gets)")
    return tiers


class TierPlan(BaseModel):
    """One quality tier of a template as planned (``PlanEntry.tiers``): its schedule and what the
    planner predicts for it (the entry's own config otherwise)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    cache: StepCacheSchedule | None = Field(default=None, description="the step cache; None: every step computed")
    weights: WeightFormat = Field(default="model", description="weight format as planned for the table's hardware "
                                                                "('model': the model's own dtype)")
    latency_s: float = Field(ge=0, description="predicted latency of one batch at the template's steps")
    peak_bytes: int = Field(ge=0, description="predicted peak per GPU, the cached outputs included")
    cache_bytes: int = Field(default=0, ge=0, description="device bytes the cached outputs hold (in the peak)")
    step_s: float = Field(default=0.0, ge=0, description="predicted seconds of one denoising step that runs the "
                                                       "denoiser (0: a table priced before steps were)")
    reused_step_s: float = Field(default=0.0, ge=0, description="predicted seconds of one that reuses the cached output "
                                                               "(the loop's work outside the denoiser; 0 without a cache)")
