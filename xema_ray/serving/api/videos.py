"""The OpenAI video job API's schemas and the mapping of ``seconds`` / ``size`` onto a served template.

``POST /v1/videos`` takes what ``openai.videos.create`` sends (``prompt``, ``model``, ``seconds``,
``size``; JSON or multipart) plus our diffusion knobs. ``seconds`` becomes frames at the model's
frame rate the way these models count them (CogVideoX's 49 frames at 8 fps are 6 s: one frame
plus ``seconds × fps``); ``size`` and that frame count go to the nearest served template, within
25 % per dimension and 25 % of the duration (or one latent frame, whichever is more). Anything
further is a 400 that lists what is served. The ``Video`` object reports the size and duration
the job really has.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from xema_ray.lora_pool import LoraUse
from xema_ray.serving.api.schemas import MAX_SEED, UnsupportedTemplate, current_limits, integral_floats, parse_size
from xema_ray.serving.frame_rate import video_fps
from xema_ray.serving.jobs.store import JobRecord, JobStoreConfig
from xema_ray.templates import RequestTemplate

SIZE_TOLERANCE = 0.25
DURATION_TOLERANCE = 0.25


class VideoCreate(BaseModel):
    """``POST /v1/videos`` (OpenAI's ``VideoCreateParams`` plus diffusion knobs). Strict types: a
    multipart body's numeric fields are converted before validation (``video_jobs``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=64)
    prompt: str = Field(min_length=1)
    seconds: str | float | None = Field(default=None, description="clip length in seconds, e.g. '1' or '1.5'")
    size: str | None = Field(default=None, max_length=11, description="WIDTHxHEIGHT; default: the smallest served size")
    num_frames: int | None = Field(default=None, ge=1, le=1024, description="exact frames (instead of seconds)")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    num_inference_steps: int | None = Field(default=None, ge=1, le=200)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=50.0, allow_inf_nan=False)
    negative_prompt: str | None = Field(default=None, description="models that run classifier-free guidance take it")
    lora: list[LoraUse] | None = Field(default=None, max_length=16, description="LoRA adapters of the model (GET "
                                       "/v1/adapters) stacked on this job, each {name, scale} (a JSON body)")
    true_cfg_scale: float | None = Field(default=None, ge=0.0, le=50.0, allow_inf_nan=False,
                                         description="Qwen-Image only (no video model takes it)")
    guidance_scale_2: float | None = Field(default=None, ge=0.0, le=50.0, allow_inf_nan=False,
                                           description="a two-expert model's low-noise expert guidance (Wan2.2 "
                                                       "A14B; default: guidance_scale, as diffusers); models of one "
                                                       "expert refuse it")
    input_reference: Any = Field(default=None, description="image-to-video: the first frame, as a file "
                                 "(multipart/form-data) or a 'data:image/png;base64,...' URL (JSON); PNG, JPEG or "
                                 "WebP, scaled to cover the served size and centre-cropped (docs/api.md 'Image inputs')")

    #: form fields that carry files (``validation.read_body``)
    file_fields: ClassVar[tuple[str, ...]] = ("input_reference",)

    @model_validator(mode="before")
    @classmethod
    def _whole_numbers(cls, data: Any) -> Any:
        return integral_floats(cls, data)

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, v: Any) -> str | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise ValueError("seconds must be a number of seconds, e.g. '4'")
        try:
            x = float(v)
        except ValueError:
            raise ValueError(f"seconds must be a number of seconds, e.g. '4', got {v!r}") from None
        if not (math.isfinite(x) and 0 < x <= 3600):
            raise ValueError(f"seconds must be in (0, 3600], got {v!r}")
        return str(v)

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_size(v)
        return v

    @field_validator("negative_prompt")
    @classmethod
    def _negative(cls, v: str | None) -> str | None:
        limit = current_limits().max_prompt_chars
        if v is not None and len(v) > limit:
            raise ValueError(f"negative_prompt is {len(v)} characters; at most {limit} are accepted")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str) -> str:
        limit = current_limits().max_prompt_chars
        if len(v) > limit:
            raise ValueError(f"prompt is {len(v)} characters; at most {limit} are accepted")
        if not v.strip():
            raise ValueError("prompt must contain non-whitespace text")
        return v


class VideoError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    """OpenAI's ``Video`` object."""

    id: str
    object: Literal["video"] = "video"
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    progress: int = Field(ge=0, le=100)
    prompt: str | None = None
    remixed_from_video_id: str | None = None
    seconds: str
    size: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    error: VideoError | None = None
    stage: Literal["denoise", "decode"] | None = Field(
        default=None, description="while in_progress: denoise, or decode (its latents on the group's decode pool); "
                                  "absent otherwise (an addition to OpenAI's object)")
    emulated: bool | None = Field(default=None, description="true: served by an emulated box (no model ran; "
                                                            "docs/emulated.md); absent otherwise")

    def body(self) -> dict[str, Any]:
        """The JSON object (``emulated`` only where it is true: older clients see the same keys)."""
        out = self.model_dump(mode="json")
        if not self.emulated:
            out.pop("emulated")
        if self.stage is None:
            out.pop("stage")
        return out


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    deleted: bool = True
    object: Literal["video.deleted"] = "video.deleted"


def _fmt_seconds(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")


def served_seconds(t: RequestTemplate) -> str:
    """The template's duration as the API reports it: (frames - 1) / fps."""
    return _fmt_seconds((t.frames - 1) / video_fps(t))


def _describe(ts: list[RequestTemplate]) -> str:
    return ", ".join(f"{t.width}x{t.height} for {served_seconds(t)} s ({t.frames} frames)" for t in ts)


def map_video_request(req: VideoCreate, served: dict[str, RequestTemplate], references: int = 0) -> RequestTemplate:
    """The served template for a job request with ``references`` input images (0 or 1), or
    UnsupportedTemplate listing what is served."""
    every = [t for t in served.values() if t.model == req.model]
    ours = sorted((t for t in every if t.references == references), key=lambda t: (t.width * t.height, t.frames))
    if not every:
        models = sorted({t.model for t in served.values() if t.spec.kind == "video"})
        raise UnsupportedTemplate(f"model {req.model!r} is not served for video; video models: {', '.join(models)}",
                                  sorted(served), "model")
    if not ours and every[0].spec.kind == "video":
        keys = sorted(t.shape_key for t in every)
        if references:
            models = sorted({t.model for t in served.values() if t.spec.kind == "video" and t.references})
            raise UnsupportedTemplate(f"{req.model} is not served with an input_reference (image-to-video); models "
                                      f"that are: {', '.join(models) or 'none'}", keys, "input_reference")
        raise UnsupportedTemplate(f"{req.model} is an image-to-video model: send an input_reference", keys,
                                  "input_reference")
    keys = [t.shape_key for t in ours]
    if ours[0].spec.kind != "video":
        raise UnsupportedTemplate(f"{req.model} is an image model; use /v1/images/generations", keys, "model")
    if req.size is None:
        w, h = ours[0].width, ours[0].height
    else:
        w, h = parse_size(req.size)
    by_size = [t for t in ours
               if abs(t.width - w) <= SIZE_TOLERANCE * w and abs(t.height - h) <= SIZE_TOLERANCE * h]
    if not by_size:
        raise UnsupportedTemplate(f"{req.model} does not serve a size near {w}x{h}; served: {_describe(ours)}", keys,
                                  "size")
    best = min(abs(math.log(t.width / w)) + abs(math.log(t.height / h)) for t in by_size)
    sized = [t for t in by_size if abs(math.log(t.width / w)) + abs(math.log(t.height / h)) == best]
    if req.num_frames is not None:
        match = [t for t in sized if t.frames == req.num_frames]
        if not match:
            raise UnsupportedTemplate(
                f"{req.model} does not serve {req.num_frames} frames at {sized[0].width}x{sized[0].height}; "
                f"served: {_describe(ours)}", keys, "num_frames")
        t = match[0]
    elif req.seconds is None:
        t = min(sized, key=lambda t: t.frames)
    else:
        want = float(req.seconds)
        fps = video_fps(sized[0])
        t = min(sized, key=lambda t: abs((t.frames - 1) / fps - want))
        slack = max(DURATION_TOLERANCE * want, t.spec.temporal_compression / fps)
        if abs((t.frames - 1) / fps - want) > slack + 1e-9:
            raise UnsupportedTemplate(
                f"{req.model} does not serve {req.seconds} s ({1 + round(want * fps)} frames at {fps:g} fps) at "
                f"{t.width}x{t.height}; served: {_describe(ours)}", keys, "seconds")
    return t  # the options (steps included) are the model's to check: ``xema_ray.serving.api.options``


def video_view(rec: JobRecord, emulated: bool = False) -> Video:
    """A stored job as the OpenAI ``Video`` object (``emulated``: the box serving it is emulated)."""
    pct = 100 if rec.status == "completed" else min(99, int(rec.progress * 100))
    err = VideoError(code=rec.error_code or "generation_failed", message=rec.error_message or "") \
        if rec.status == "failed" else None
    return Video(id=rec.id, created_at=int(rec.created_at), model=rec.model, progress=pct, prompt=rec.prompt,
                 seconds=rec.seconds, size=rec.size, status=rec.status, error=err,
                 completed_at=int(rec.completed_at) if rec.completed_at else None,
                 expires_at=int(rec.expires_at) if rec.expires_at else None, emulated=True if emulated else None,
                 stage=rec.stage if rec.status == "in_progress" else None)


def poll_after_ms(rec: JobRecord, cfg: JobStoreConfig, now: float | None = None) -> int:
    """The ``openai-poll-after-ms`` hint: a tenth of the predicted remaining time, so a poller sees
    about ten progress values, within the configured bounds."""
    now = time.time() if now is None else now
    remaining = rec.predicted_s if rec.status == "queued" else rec.remaining_s()
    if rec.status == "in_progress" and rec.progress_at is not None:
        remaining -= now - rec.progress_at  # time already spent on the current step
    return int(min(cfg.poll_max_ms, max(cfg.poll_min_ms, remaining * 100.0)))
