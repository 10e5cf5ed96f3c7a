"""HTTP API schemas (OpenAI-style) and the mapping of a request onto a template.

Every field is validated here so that a bad request gets a 422 naming the field, and a request
for a shape the deployment does not serve gets a 400 listing what it does serve. Everything a
request carries into a batch is checked here, per request, so that no request can make the
batch it joins fail (the seeds it derives included).

Text-field limits come from ``RequestLimits`` (``ServeConfig.limits``); the Router installs the
deployment's limits in its process with ``set_limits`` (each Router replica is its own process).
"""

from __future__ import annotations

import re
import types
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from xema_ray.lora_pool import LoraUse
from xema_ray.serving.api.quality import QualityTierInfo, QualityValue
from xema_ray.templates import RequestTemplate

MAX_PROMPT_CHARS = 10_000
MAX_SEED = 2**63 - 1  # seeds feed torch.Generator.manual_seed, which takes a signed 64-bit integer
#: the most images one image request asks for (``n``)
MAX_IMAGES = 10
#: an image request's largest ``seed``: image ``i`` of ``n`` runs with ``seed + i``, so the last of the
#: most images a request can ask for is still a seed (one bound whatever ``n``: the document states it
#: as a plain maximum, with no rule between two fields)
MAX_IMAGE_SEED = MAX_SEED - MAX_IMAGES + 1
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


class RequestLimits(BaseModel):
    """Per-request size limits (``ServeConfig.limits``); each refusal names the limit.

    Example:
        >>> RequestLimits(max_prompt_chars=2000).max_body_bytes
        4194304
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(default=4 * 2**20, ge=1024, description="request body (HTTP 413 beyond)")
    max_prompt_chars: int = Field(default=MAX_PROMPT_CHARS, ge=1, description="prompt length in characters")
    max_text_chars: int = Field(default=256, ge=1, description="other free-text fields: user, quality, style")
    max_in_flight: int = Field(default=320, ge=1, description="generation requests one Router replica holds "
                                                             "before answering 503 with Retry-After")
    busy_retry_after_s: int = Field(default=2, ge=1, description="Retry-After of that 503")


_limits = RequestLimits()


def set_limits(limits: RequestLimits) -> None:
    """Install the deployment's limits in this process (the Router does, at start-up)."""
    global _limits
    _limits = limits


def current_limits() -> RequestLimits:
    return _limits


def _check_text(v: str | None, info: ValidationInfo, limit: int) -> str | None:
    if v is not None and len(v) > limit:
        raise ValueError(f"{info.field_name} is {len(v)} characters; at most {limit} are accepted")
    return v


def _takes_int(annotation: object) -> bool:
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return int in args


def integral_floats(model: type[BaseModel], data: object) -> object:
    """``data`` with a whole float (``121.0``) as an int in ``model``'s int fields: JSON Schema counts
    it an integer, so the document's integers take it; a fractional one stays and is refused."""
    if not isinstance(data, dict):
        return data
    return {k: int(v) if isinstance(v, float) and v.is_integer() and k in model.model_fields
            and _takes_int(model.model_fields[k].annotation) else v for k, v in data.items()}


def parse_size(size: str) -> tuple[int, int]:
    """'1024x768' -> (width, height)."""
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. '1024x1024'), got {size!r}")
    return int(m.group(1)), int(m.group(2))


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=64)
    prompt: str = Field(min_length=1)
    size: str = Field(max_length=11, description="WIDTHxHEIGHT")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    lora: list[LoraUse] | None = Field(
        default=None, max_length=16, description="LoRA adapters of the model (GET /v1/adapters) stacked on this request, "
                                                 "each {name, scale}; requests with different adapters share a batch")
    negative_prompt: str | None = Field(default=None, description="what to steer away from: models that run "
                                        "classifier-free guidance take it (see each model's options in /v1/templates)")
    true_cfg_scale: float | None = Field(default=None, ge=0.0, le=50.0, allow_inf_nan=False,
                                         description="Qwen-Image's true classifier-free guidance scale (the same "
                                                     "value as its guidance_scale); other models refuse it")

    @model_validator(mode="before")
    @classmethod
    def _whole_numbers(cls, data: object) -> object:
        return integral_floats(cls, data)

    @field_validator("negative_prompt")
    @classmethod
    def _negative(cls, v: str | None, info: ValidationInfo) -> str | None:
        return _check_text(v, info, _limits.max_prompt_chars)

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v)
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str, info: ValidationInfo) -> str:
        _check_text(v, info, _limits.max_prompt_chars)
        if not v.strip():
            raise ValueError("prompt must contain non-whitespace text")
        return v


class ImageRequest(_Common):
    """``POST /v1/images/generations`` (the OpenAI images API, plus diffusion knobs).

    Unknown options are kept (``extra="allow"``) so that the endpoint can answer 400 naming them."""

    model_config = ConfigDict(extra="allow", strict=True)

    n: int = Field(default=1, ge=1, le=MAX_IMAGES, description="images for this prompt, up to the template's planned "
                                                                "batch (each its own request, with seed, seed+1, ...)")
    seed: int | None = Field(default=None, ge=0, le=MAX_IMAGE_SEED,
                             description=f"image i runs with seed + i: at most 2^63 - {MAX_IMAGES} (the last of {MAX_IMAGES} "
                                         "images is then 2^63 - 1, torch's largest seed)")
    response_format: Literal["b64_json", "url"] = Field(
        default="b64_json", description="url: a link on this server, valid as long as video results (jobs.ttl_s)")
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100,
                                           description="jpeg/webp: 100 - quality; png: zlib level (lossless)")
    background: Literal["auto", "opaque"] | None = Field(default=None, description="transparent backgrounds are not generated")
    num_inference_steps: int | None = Field(default=None, ge=1, le=200)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=50.0, allow_inf_nan=False)
    quality: QualityValue | None = Field(
        default=None, description="OpenAI's values (high, hd, standard: lossless; medium: balanced where served, else "
                                  "lossless; low: fast where served, else the fastest served; auto) or a tier name "
                                  "(lossless, balanced, fast); docs/api.md 'Quality'")
    style: str | None = Field(default=None, description="accepted for OpenAI-client compatibility; ignored")
    moderation: str | None = Field(default=None, description="accepted for OpenAI-client compatibility; ignored")
    user: str | None = None

    @field_validator("style", "moderation", "user")
    @classmethod
    def _text(cls, v: str | None, info: ValidationInfo) -> str | None:
        return _check_text(v, info, _limits.max_text_chars)


class VideoRequest(_Common):
    """``POST /v1/videos/sync``: waits for the video and returns the MP4 (``POST /v1/videos`` makes a job)."""

    num_frames: int = Field(ge=1, le=1024)
    num_inference_steps: int | None = Field(default=None, ge=1, le=200)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=50.0, allow_inf_nan=False)
    guidance_scale_2: float | None = Field(default=None, ge=0.0, le=50.0, allow_inf_nan=False,
                                           description="a two-expert model's low-noise expert guidance (Wan2.2 "
                                                       "A14B; default: guidance_scale, as diffusers); models of one "
                                                       "expert refuse it")
    quality: QualityValue | None = Field(
        default=None, description="the quality tier (lossless, the default; fast; auto) or OpenAI's image values, "
                                  "as on images; a tier the template does not serve is a 422; docs/quality.md")


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImageResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: Literal["png", "jpeg", "webp"] = "png"
    size: str | None = None
    emulated: bool | None = Field(default=None, description="true: served by an emulated box (no model ran; "
                                                            "docs/emulated.md); absent otherwise")


class DecodeInfo(BaseModel):
    """A template's decode pool in ``GET /v1/templates``: its decode workers and each one's GPUs."""

    workers: int
    gpus_per_worker: float


class TemplateInfo(BaseModel):
    """One supported template, its plan and predictions (``GET /v1/templates``)."""

    template: str
    model: str
    width: int
    height: int
    frames: int
    steps: int
    steps_range: tuple[int, int] | None = Field(default=None, description="num_inference_steps a request may ask for "
                                                "(the same plan and layout serve them; latency and SLO scale)")
    options: str | None = Field(default=None, description="the model's request options and their ranges")
    references: int = Field(default=0, description="reference images a request brings (edits, image-to-video)")
    reference_size: str | None = Field(default=None, description="WIDTHxHEIGHT the references are encoded at")
    latent_length: int
    plan: str
    predicted_latency_s: float
    predicted_peak_gb: float
    slo_s: float
    quality_tiers: list[QualityTierInfo] = Field(default_factory=list, description="the tiers served, lossless "
                                                 "first, each with its predictions (docs/quality.md)")
    decode: DecodeInfo | None = Field(default=None, description="the decode pool the template's latents are handed "
                                      "to, as planned (config.decode; docs/decode-stage.md); null: decoded in place")


class UnsupportedTemplate(ValueError):
    """A well-formed request for a shape this deployment does not serve (HTTP 400)."""

    def __init__(self, message: str, supported: list[str], param: str | None = None) -> None:
        super().__init__(message, supported, param)  # all in args: it may cross processes by pickle
        self.supported = supported
        self.param = param

    def __str__(self) -> str:
        return str(self.args[0])


def match_template(model: str, width: int, height: int, frames: int, served: dict[str, RequestTemplate],
                   kind: Literal["image", "video"]) -> RequestTemplate:
    """The served template for (model, size, frames), or UnsupportedTemplate listing the served ones."""
    ours = sorted(k for k, t in served.items() if t.model == model)
    if not ours:
        models = sorted({t.model for t in served.values()})
        raise UnsupportedTemplate(f"model {model!r} is not served; served models: {', '.join(models)}", sorted(served),
                                  "model")
    spec_kind = served[ours[0]].spec.kind
    if spec_kind != kind:
        raise UnsupportedTemplate(
            f"{model} is a{'n' if spec_kind == 'image' else ''} {spec_kind} model; use "
            f"{'/v1/images/generations' if spec_kind == 'image' else '/v1/videos'}", ours, "model")
    key = f"{model}/{width}x{height}x{frames}"
    if key not in served:
        param = "size" if not any(served[k].width == width and served[k].height == height for k in ours) else "num_frames"
        raise UnsupportedTemplate(f"{model} does not serve {width}x{height}x{frames}; served: {', '.join(ours)}", ours,
                                  param)
    return served[key]
