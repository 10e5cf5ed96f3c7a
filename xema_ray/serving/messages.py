"""What crosses between the Router and a ModelGroup: the typed request, results and status (with the
group's static-layout counters), and the errors a group answers with (each maps to an HTTP status in
``api/errors.py``). They cross the replica boundary by pickle: an exception keeps its values in
``args``. At the bottom of ``serving/``: the Router (``api/``), the groups, the job lifecycle and the
console all speak them, so this module imports no room of ``serving/``."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xema_ray.lora_pool import LoraUse
from xema_ray.models.options import STEPS_MAX
from xema_ray.runtime.requests import GenerationRequest, RequestOutput
from xema_ray.scheduling.batch_key import BatchKey, Guidance
from xema_ray.vocabulary import QualityTier


class TemplateLayoutStats(BaseModel):
    """One template's static-layout counters since the group started."""

    model_config = ConfigDict(extra="forbid")

    layout_ref: str | None = Field(default=None, description="the plan entry's layout (None: the plan has none)")
    batches: int = Field(default=0, ge=0, description="batches run for this template")
    armed_batches: int = Field(default=0, ge=0, description="batches run with the layout armed")
    hits: int = Field(default=0, ge=0, description="allocations placed at their planned offset")
    fallbacks: int = Field(default=0, ge=0, description="allocations the layout did not know, served by the dynamic path")
    reserved_bytes: int = Field(default=0, ge=0, description="bytes the static allocator held after the last batch (0: not armed)")
    not_armed: str | None = Field(default=None, description="why the last batch ran without its layout (None: it was armed, "
                                                            "or the workers' status says why none is)")
    out_of_memory: int = Field(default=0, ge=0, description="batches that failed out of device memory (each a JSON 503; "
                                                            "the worker served on)")
    last_out_of_memory: str | None = Field(default=None, description="the last such failure: the entry, bytes asked, "
                                                                     "bytes free")


class WorkerMemory(BaseModel):
    """One worker's memory in the last batch it ran (``MemoryStats``: the device allocator's counters
    on a GPU, the process's resident set on CPU; ``source`` says which), for the console's view."""

    model_config = ConfigDict(extra="forbid")

    template: str = Field(description="the template of that batch")
    peak_bytes: int = Field(ge=0, description="peak during the batch")
    current_bytes: int = Field(ge=0, description="in use at the end of the batch")
    source: str = Field(description="where the numbers come from (MemoryStats.source), e.g. rss on CPU")


class GroupLayoutStats(BaseModel):
    """A model group's static layouts: the workers' status (armed, or why not) and counters per template."""

    model_config = ConfigDict(extra="forbid")

    status: str = Field(description="what the workers said at load: layouts armed per batch, or 'not armed: why'")
    templates: dict[str, TemplateLayoutStats] = Field(default_factory=dict)
    workers: dict[int, WorkerMemory] = Field(default_factory=dict, description="per worker index: its last batch's memory")


class GroupUnavailable(RuntimeError):
    """The worker set failed twice for a batch, or could not be rebuilt (HTTP 503 with the reason)."""


class InvalidRequest(ValueError):
    """A request that cannot run (HTTP 422 naming the field; 404 where the field names something
    that is not there, e.g. an adapter not loaded); refused before it joins a batch."""

    def __init__(self, message: str, param: str | None, status: int = 422) -> None:
        super().__init__(message, param, status)  # all in args: it crosses the replica -> router boundary by pickle
        self.param = param
        self.status = status

    def __str__(self) -> str:
        return str(self.args[0])


class RequestFailedAlone(RuntimeError):
    """A request whose batch failed, run again alone, failed again with an error that is not about
    its input (HTTP 500 naming it: a bug), while its batch neighbours were served
    (``xema_ray.serving.group.isolation``)."""

    def __init__(self, message: str, request_id: str) -> None:
        super().__init__(message, request_id)  # both in args: it crosses the replica -> router boundary by pickle
        self.request_id = request_id

    def __str__(self) -> str:
        return str(self.args[0])


class RetryLater(RuntimeError):
    """A refusal the client may retry after ``retry_after_s`` (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        # both values in args: the exception crosses the replica -> router boundary by pickle
        super().__init__(message, retry_after_s)
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return str(self.args[0])


class QueueFull(RetryLater):
    """The template's queue is full (HTTP 503 with Retry-After)."""




class GroupRequest(BaseModel):
    """One request for a model group: the Router's ``generate`` (a synchronous request) or the job
    reconciler's ``submit_job`` (a video job: ``request_id`` is the job's id). Its values are
    checked by the group (``validated``), so that a request that cannot run fails alone, naming
    its field, instead of failing the batch it would join."""

    model_config = ConfigDict(frozen=True)

    template: str = Field(description="the template's shape key (the group's plan for it)")
    request_id: str
    prompt: str
    seed: int
    guidance_scale: float | None = None
    guidance_scale_2: float | None = Field(default=None, description="a two-expert model's low-noise expert "
                                                                     "guidance (None: guidance_scale's)")
    references: tuple[bytes, ...] = Field(default=(), repr=False, description="the request's reference images (PNG "
                                          "at its template's reference size, checked by the API)")
    lora: tuple[LoraUse, ...] = Field(default=(), description="LoRA adapters and scales (checked by the group)")
    negative_prompt: str | None = Field(default=None, description="None: the model's default negative prompt")
    steps: int = Field(description="the denoising steps it runs, resolved by the API (its own or its template's; "
                                   "the Router checked the model's range: ``xema_ray.models.options``)")
    quality: QualityTier = Field(default=QualityTier.LOSSLESS, description="the quality tier the request runs at "
                                 "(the API's ``quality`` resolved against the template's served tiers)")

    @property
    def guidance(self) -> Guidance:
        """Both experts' guidance scales (None: the model's default; the second: the first's)."""
        return self.guidance_scale, self.guidance_scale_2

    @property
    def batch_key(self) -> BatchKey:
        """What its batch cannot mix (``xema_ray.scheduling.batch_key``): its steps, guidance and tier."""
        return BatchKey(steps=self.steps, guidance=self.guidance, quality=str(self.quality))

    def check_references(self, wants: int) -> None:
        """Raise ``InvalidRequest`` (naming ``image``) unless the request brings its template's
        ``wants`` reference images: a batch's rows each need that count."""
        if len(self.references) != wants:
            raise InvalidRequest(f"template {self.template} takes {wants} reference image(s), the request has "
                                 f"{len(self.references)}", "image")

    def validated(self) -> GenerationRequest:
        """The request as the batch builder will see it, checked now. Raises ``InvalidRequest``
        (HTTP 422) naming the field."""
        for name, g in (("guidance_scale", self.guidance_scale), ("guidance_scale_2", self.guidance_scale_2)):
            if g is not None and not (isinstance(g, int | float) and math.isfinite(g)):
                raise InvalidRequest(f"{name} must be a finite number, got {g!r}", name)
        if not (isinstance(self.steps, int) and 1 <= self.steps <= STEPS_MAX):
            raise InvalidRequest(f"num_inference_steps must be in [1, {STEPS_MAX}], got {self.steps!r}",
                                 "num_inference_steps")
        try:
            return GenerationRequest(request_id=self.request_id, prompt=self.prompt, seed=self.seed,
                                     negative_prompt=self.negative_prompt, references=self.references, lora=self.lora)
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err.get("loc") else None
            raise InvalidRequest(f"{field}: {err['msg']}", field) from None


class GenerateResult(RequestOutput):
    """One request's encoded output and where it ran (the Router turns the latter into headers)."""

    batch_id: int = Field(description="the dispatcher's batch the request ran in")
    batch_size: int = Field(ge=1, description="requests of its (sub-)batch")
    workers: tuple[int, ...] = Field(description="ranks of the SP group it ran on")
    batch_seconds: float = Field(ge=0, description="seconds its sub-batch took on the workers")
    queued_s: float | None = Field(default=None, ge=0, description="seconds it waited in the group's queue "
                                                                   "before its sub-batch started")
    replica: str | None = Field(default=None, description="the group replica that ran it (its job-store owner id)")
    group_seconds: float | None = Field(default=None, ge=0, description="seconds it spent in the group (queued + "
                                                                       "its batch); the rest of its latency is the front end's")
    quality: str = Field(default="lossless", description="the quality tier it was served at (X-Xema-Quality)")
    quality_note: str | None = Field(default=None, description="why it was served at another tier than asked "
                                                               "(a request too short to skip a step ran lossless)")


class GroupStatus(BaseModel):
    """A group's state for ``/healthz`` (sent as its ``model_dump()``)."""

    model: str
    status: Literal["ok", "degraded"]
    reason: str | None = Field(default=None, description="why it is degraded (rebuilding, the last failure)")
    workers: int
    generation: int = Field(description="worker sets built so far: 1 after start, +1 per rebuild")
    queued: int
    static_layouts: GroupLayoutStats
    running: int
    paused: int
    jobs: int = Field(description="video jobs queued or running here")
    owner: str = Field(description="this replica as the owner of its jobs")
    plans_hash: str | None = Field(default=None, description="content hash of the plans it serves (plan_reload)")
    plans_swapping: bool = Field(default=False, description="a new plan table is being swapped in (new batches held)")
    plans_swapped: int = Field(default=0, description="plan tables swapped in since this replica started")
    plans_reload_error: str | None = Field(default=None, description="why the last new plan table could not be "
                                                                       "swapped in (the group serves its previous plans)")
