"""The per-request options (``guidance_scale``, ``negative_prompt``, ``true_cfg_scale``,
``guidance_scale_2``, ``num_inference_steps``) checked against the model's own rules before admission, and resolved into
what the model group runs (``RequestOptions``).

Every generation endpoint calls ``resolve_options`` after it has matched the template: a value the
model's pipeline would refuse is a 422 naming the field and the model's range, an option the model
does not take a 400 naming the served models that do (``xema_ray.models.options``). Nothing that
passes here can fail its batch for a range the pipeline enforces.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.models.options import OptionRefused, OptionRules
from xema_ray.plan import PlanTable
from xema_ray.profiling.phases import fallback_shares
from xema_ray.scheduling.batch import DispatchPlan
from xema_ray.serving.api.quality import resolve_quality, served_tiers
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import QualityTier


class RequestOptions(BaseModel):
    """A request's options as its model group runs them (None: the model's default). The step count
    is resolved here, once: every layer below carries it as an ``int``."""

    model_config = ConfigDict(frozen=True)

    guidance_scale: float | None = Field(default=None, description="the guidance (Qwen-Image: the true CFG scale)")
    guidance_scale_2: float | None = Field(default=None, description="a two-expert model's low-noise expert's "
                                                                     "guidance (None: guidance_scale's, as diffusers)")
    negative_prompt: str | None = Field(default=None, description="replaces the model's default negative prompt")
    steps: int = Field(ge=1, description="the denoising steps the request runs: its own, else its template's")
    quality: QualityTier = Field(default=QualityTier.LOSSLESS, description="the tier the request's quality resolved "
                                                                           "to (``quality.resolve_quality``)")


def takers(served: dict[str, RequestTemplate]) -> dict[str, list[str]]:
    """Option -> the served models whose pipeline takes it (for a 400's message)."""
    out: dict[str, list[str]] = {"negative_prompt": [], "true_cfg_scale": [], "guidance_scale_2": []}
    for model in sorted({t.model for t in served.values()}):
        rules = rules_of(model, served)
        for option in out:
            if getattr(rules, option):
                out[option].append(model)
    return out


def rules_of(model: str, served: dict[str, RequestTemplate]) -> OptionRules:
    """``model``'s option rules (its spec's; the first served template names the spec)."""
    t = next(t for t in served.values() if t.model == model)
    return t.spec.option_rules()


def resolve_options(t: RequestTemplate, served: dict[str, RequestTemplate], req: Any,
                    table: PlanTable | None = None) -> RequestOptions:
    """``req``'s options for template ``t``, checked. Raises ``OptionRefused`` (422 / 400).

    Args:
        t: the template the request maps to.
        served: every served template (for the models named in a 400).
        req: the parsed request (``guidance_scale``, ``negative_prompt``, ``true_cfg_scale``,
            ``num_inference_steps``, ``quality``; a missing attribute counts as not given).
        table: the plan table served (the tiers each template is priced at); None: lossless only.
    """
    guidance = getattr(req, "guidance_scale", None)
    negative = getattr(req, "negative_prompt", None)
    true_cfg = getattr(req, "true_cfg_scale", None)
    steps = getattr(req, "num_inference_steps", None)
    guidance_2 = getattr(req, "guidance_scale_2", None)
    rules = t.spec.option_rules()
    rules.check(t.model, guidance, negative, true_cfg, steps, takers(served), guidance_scale_2=guidance_2)
    if true_cfg is not None:  # the model's guidance is its true CFG scale (OptionRules.true_cfg_scale)
        if guidance is not None and guidance != true_cfg:
            raise OptionRefused(f"{t.model}: guidance_scale ({guidance!r}) and true_cfg_scale ({true_cfg!r}) are the "
                                "same scale for this model; give one, or the same value", "true_cfg_scale")
        guidance = true_cfg
    guidance, guidance_2 = t.spec.guidance_as_given(t, guidance, guidance_2)  # the default named: the default's key
    # the one place "not given" means the template's steps: below the API every layer carries the int
    return RequestOptions(guidance_scale=guidance, guidance_scale_2=guidance_2, negative_prompt=negative,
                          steps=t.steps if steps is None else steps, quality=_quality(t, req, table))


def _quality(t: RequestTemplate, req: Any, table: PlanTable | None) -> QualityTier:
    """``req``'s tier. LoRA adapters apply to the model's own weights only, so a request with
    adapters runs no tier of quantized weights: ``balanced`` by name, and OpenAI's ``medium``,
    run lossless (``quality_note`` says so in the answer)."""
    served = served_tiers(t, table)
    value = getattr(req, "quality", None)
    if _adapters_skip_balanced(req, served):
        served = served - {QualityTier.BALANCED}
        if value == QualityTier.BALANCED.value:
            return QualityTier.LOSSLESS
    return resolve_quality(value, served)


def _adapters_skip_balanced(req: Any, served: frozenset[QualityTier]) -> bool:
    return bool(getattr(req, "lora", None)) and QualityTier.BALANCED in served


def quality_note(t: RequestTemplate, req: Any, table: PlanTable | None) -> dict[str, str]:
    """The ``X-Xema-Quality-Note`` header of a request that named ``balanced`` with adapters (served
    lossless: adapters apply to the model's own weights); empty otherwise."""
    if getattr(req, "quality", None) == QualityTier.BALANCED.value and _adapters_skip_balanced(req, served_tiers(t, table)):
        return {"X-Xema-Quality-Note": "balanced asked; LoRA adapters apply to the model's own weights, not "
                                       "quantized ones: served lossless"}
    return {}


def option_error(e: OptionRefused) -> dict[str, Any]:
    """``error_response`` keyword arguments for a refused option."""
    return {"status": e.status, "message": str(e), "param": e.param,
            "code": "unsupported_option" if e.status == 400 else "out_of_range"}


def scaled_to_steps(seconds: float, t: RequestTemplate, steps: int) -> float:
    """A prediction for ``t`` at its own step count, scaled to ``steps`` (its own: unchanged): the
    denoising share (``fallback_shares``) scales with the steps, the rest does not."""
    if steps == t.steps:
        return seconds
    d = fallback_shares(t.spec.kind == "video").denoise
    plan = DispatchPlan(batch=1, sp=1, slo_s=seconds, latency_s=seconds, steps=t.steps, denoise_frac=d,
                        decode_encode_frac=1.0 - d)
    return plan.for_steps(steps).latency_s


def document_options(components: dict[str, Any], served: dict[str, RequestTemplate],
                     kinds: dict[str, str]) -> None:
    """Each request schema of ``kinds`` (schema name -> model kind) gets its served models' option
    rules: ``x-model-options`` (per model: guidance range, steps range, whether it takes a
    negative prompt / true CFG), a line per model in the options' descriptions, and the options'
    bounds narrowed to the widest any of these models accepts."""
    for name, kind in kinds.items():
        schema = components.get(name)
        props = schema.get("properties") if schema else None
        if schema is None or props is None:
            continue
        rules = {m: rules_of(m, served) for m in sorted({t.model for t in served.values() if t.spec.kind == kind})}
        if not rules:
            continue
        schema["x-model-options"] = {m: {"guidance_scale": {"minimum": r.guidance_min, "maximum": r.guidance_max},
                                         "num_inference_steps": {"minimum": r.steps_min, "maximum": r.steps_max},
                                         "negative_prompt": r.negative_prompt, "true_cfg_scale": r.true_cfg_scale,
                                         "guidance_scale_2": r.guidance_scale_2}
                                     for m, r in rules.items()}
        per_model = "; ".join(f"{m}: {r.describe()}" for m, r in rules.items())
        for option in ("guidance_scale", "num_inference_steps", "negative_prompt", "true_cfg_scale", "guidance_scale_2"):
            if option in props:
                base = props[option].get("description", "")
                props[option]["description"] = (base + ". " if base else "") + f"Per model (x-model-options): {per_model}"
        steps_max = max(r.steps_max for r in rules.values())
        _bound(props.get("num_inference_steps"), "maximum", steps_max)
        _bound(props.get("guidance_scale"), "minimum", min(r.guidance_min for r in rules.values()))


def _bound(prop: dict[str, Any] | None, key: str, value: float) -> None:
    """Set ``key`` on the number branch of an optional field's schema."""
    if prop is None:
        return
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("integer", "number"):
            branch[key] = value
