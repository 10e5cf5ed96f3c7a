"""The execution engine: one batch of one template, end to end, on one worker (paper §8).

``ExecutionEngine.execute(batch)`` takes a ``Batch`` (an ``ExecutionConfig`` plus the requests)
and returns a ``BatchResult``: PNG or MP4 bytes per request, per-phase timings and memory
statistics. For the duration of the batch it installs, in this order and all removed afterwards:

1. the config's mitigations, through the mitigation library's single entry point
   ``xema_ray.mitigation.apply_mitigations(pipe, spec, mitigations)`` (imported lazily: the
   engine works without that package as long as a config asks for no mitigation);
2. the static layout named by ``layout_ref`` at the batch's step count, through an injected
   ``ArmLayout`` call that yields the layout's report (the allocator binding owns how; on CPU
   none is installed and the result says so);
3. sequence parallelism over the batch's SP group when ``ulysses x ring > 1``.

Every rank of an SP group executes the same batch (same prompts and seeds, so the same initial
noise); the transformer splits and gathers the sequence internally. Only the group's rank 0
decodes and encodes: the others stop at the latents, which they hold too.

Determinism: each request's noise comes from its own CPU generator seeded with its seed, so a
request's output does not depend on which device runs it; the encoders are bit-exact.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from xema_ray.models import ModelSpec
from xema_ray.models.base import TextEncoderPlacement
from xema_ray.parallel.groups import ProcessGroups
from xema_ray.parallel.sp import SPBackend, apply_sequence_parallel
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.platforms import MemoryStats, Platform, current_platform
from xema_ray.runtime.adapters import AdapterPool, LoraUse, enter_adapters  # LoRA adapters (xema_ray.lora)
from xema_ray.runtime.decode_worker import HandedLatents
from xema_ray.runtime.encode import encode_mp4, encode_png, encode_wav
from xema_ray.runtime.pause import PauseControl
from xema_ray.runtime.phase_clock import PhaseClock
from xema_ray.runtime.progress import StepObserver, step_callback
from xema_ray.runtime.references import batch_references
# what crosses the worker boundary, light to import (the Router and the group speak them without torch)
from xema_ray.runtime.requests import DEFAULT_VIDEO_FPS, GenerationRequest, RequestOutput  # noqa: F401  (re-exported)
from xema_ray.runtime.request_errors import attributed, encode_attributed, encode_negatives
from xema_ray.runtime.text import EncodedPrompts
from xema_ray.vocabulary import Phase

if TYPE_CHECKING:
    from xema_ray.allocator.runtime import RequestReport


class ArmLayout(Protocol):
    """Arms a static layout around one batch: ``arm(layout_ref, steps)`` enters for the batch's
    pipeline call and yields the layout's report, filled when it exits (hits, misses, fallback);
    None where nothing was armed (no arena reserved, the layout not loaded). ``steps``: the
    batch's denoising steps, so a layout solved for the template's count is repeated to them."""

    def __call__(self, layout_ref: str, steps: int) -> contextlib.AbstractContextManager[RequestReport | None]: ...


class PipelineRun(NamedTuple):
    """What one pipeline call gives back (``ExecutionEngine.run_pipeline``)."""

    output: Any  #: the pipeline's output
    phases: dict[Phase, float]  #: seconds by phase
    sp_rank: int  #: this worker's rank in the batch's SP group (0: none)
    armed: bool  #: the batch's static layout was armed (``ArmLayout`` called)
    layout: RequestReport | None  #: the armed layout's report, filled at its exit (None: none armed)
    prompts: EncodedPrompts  #: the batch's encoded prompts (token counts, truncation)



class MitigationLibraryMissing(ValueError):
    """A config asks for mitigations but ``xema_ray.mitigation`` is not importable."""


class Batch(BaseModel):
    """What a worker executes: requests of one template under one execution config."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: ExecutionConfig
    requests: tuple[GenerationRequest, ...] = Field(min_length=1)
    guidance_scale: float | None = Field(default=None, description="None = the model's default")
    guidance_scale_2: float | None = Field(default=None, description="a two-expert model's low-noise expert "
                                                                     "guidance (None: guidance_scale's, as diffusers)")
    steps: int = Field(ge=1, description="denoising steps it runs (resolved by the API: the request's own or its "
                       "template's; the same plan serves any: memory does not depend on the step count)")

    @model_validator(mode="after")
    def _check(self) -> Batch:
        if len(self.requests) != self.config.batch:
            raise ValueError(
                f"batch of {len(self.requests)} requests does not match the config's batch size {self.config.batch}"
            )
        return self


class PhaseTimings(BaseModel):
    """Wall-clock seconds per phase (``xema_ray.vocabulary.Phase``: text, denoise, decode, encode) on
    this worker (device work synchronised at each boundary)."""

    model_config = ConfigDict(frozen=True)

    text_s: float = Field(ge=0, description="prompt -> embeddings (stand-in or the text encoder)")
    denoise_s: float = Field(ge=0, description="latent preparation and the denoising loop")
    decode_s: float = Field(ge=0, description="VAE decode (+ audio VAE and vocoder) and post-processing")
    encode_s: float = Field(ge=0, description="PNG / MP4 / WAV encoding")
    total_s: float = Field(ge=0, description="the whole batch, including mitigation and SP set-up")


class BatchResult(BaseModel):
    """What ``execute`` returns: outputs on the group's output rank, timings and memory on all."""

    model_config = ConfigDict(frozen=True)

    template: str
    config_hash: str
    sp_rank: int = Field(description="this worker's rank in its SP group (0 when SP = 1)")
    outputs: list[RequestOutput] = Field(description="empty on ranks other than the SP group's rank 0")
    timings: PhaseTimings
    memory: MemoryStats
    mitigations: int = Field(description="mitigation actions installed for the batch")
    layout_armed: bool = Field(description="the static layout was armed for this batch")
    residency_bytes_moved: int = Field(default=0, description="weight bytes a residency switch moved before the batch")
    host_weight_bytes: int = Field(default=0, description="weight bytes homed on host memory while the batch ran")
    layout_status: str | None = Field(default=None, description="the worker's static layouts: armed, or why not")
    layout_note: str | None = Field(default=None, description="why this batch ran without the layout its plan names "
                                                              "(None: armed as planned, or the plan has none)")
    layout_hits: int = Field(default=0, description="allocations the armed layout placed")
    layout_misses: int = Field(default=0, description="allocations that fell back to the dynamic region")
    layout_reserved_bytes: int = Field(default=0, description="bytes the static allocator held after the batch (0: not armed)")
    pauses: int = Field(default=0, description="times the batch was paused at a step boundary (preempted)")
    steps_computed: int | None = Field(default=None, description="denoising steps that ran the transformer (fewer "
                                       "than the batch's under a step-cached quality tier; None: not reported)")
    paused_s: float = Field(default=0.0, ge=0, description="seconds the batch spent paused")
    handed: list[HandedLatents] = Field(default_factory=list, description="a plan with a decode pool "
                                        "(config.decode): each request's latents for the pool, in place of outputs")


@contextlib.contextmanager
def apply_config_mitigations(pipe: Any, spec: ModelSpec, mitigations: tuple[Mitigation, ...],
                             sp_group: Any = None) -> Iterator[None]:
    """Install ``mitigations`` through the mitigation library for the ``with`` block. HSDP shards
    weights across the batch's SP group (the ranks that run the same batch), so it gets that
    group's process group as its collective.

    Raises:
        MitigationLibraryMissing: mitigations were asked for and ``xema_ray.mitigation`` (or its
            ``apply_mitigations``) is not available.
    """
    if not mitigations:
        yield
        return
    try:
        from xema_ray.mitigation import apply_mitigations
    except ImportError as e:
        kinds = sorted({m.kind for m in mitigations})
        raise MitigationLibraryMissing(
            f"the config asks for {len(mitigations)} mitigation(s) ({', '.join(kinds)}) but the mitigation "
            f"library cannot be imported ({e}); install xema_ray.mitigation or run the config without mitigations"
        ) from e
    comm = None
    if any(m.kind == "hsdp" for m in mitigations):
        if sp_group is None:
            raise ValueError("hsdp shards weights across the SP group; this batch runs without one (SP = 1)")
        from xema_ray.mitigation.hsdp import ProcessGroupCollective

        comm = ProcessGroupCollective(sp_group.group)
    with apply_mitigations(pipe, spec, mitigations, comm=comm):
        yield


class ExecutionEngine:
    """Runs batches on one worker's loaded pipeline.

    Args:
        pipe: the model's diffusers pipeline, built on ``device`` (``ModelSpec.build_pipeline``).
        spec: the model's spec (shapes, call kwargs, prompt embeddings).
        device: where the pipeline lives.
        dtype: the pipeline's compute dtype (prompt embeddings are made in it).
        groups: the worker set's process groups (needed for configs with SP > 1).
        platform: device abstraction (default: the current platform).
        arm_layout: ``(layout_ref, steps) -> context manager`` that arms a static layout and
            yields its report (``ArmLayout``; the allocator binding provides it where the
            pluggable allocator is installed).
        sp_backend: USP backend, see ``apply_sequence_parallel``.

    Example:
        >>> from xema_ray.models import BuildOptions, get_model_spec
        >>> spec = get_model_spec("tiny-flux2")
        >>> engine = ExecutionEngine(spec.build_pipeline(BuildOptions()), spec, torch.device("cpu"), torch.float32)
        >>> t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2)  # doctest: +SKIP
        >>> engine.execute(Batch(config=ExecutionConfig(template=t),
        ...     requests=(GenerationRequest(request_id="a", prompt="a cat", seed=1),))).outputs[0].media_type  # doctest: +SKIP
        'image/png'
    """

    def __init__(
        self,
        pipe: Any,
        spec: ModelSpec,
        device: torch.device,
        dtype: torch.dtype,
        groups: ProcessGroups | None = None,
        platform: Platform | None = None,
        arm_layout: ArmLayout | None = None,
        sp_backend: SPBackend = "auto",
        text_encoder_placement: TextEncoderPlacement = "device",
    ) -> None:
        from xema_ray.runtime.text import PromptEncoder

        self.pipe = pipe
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.groups = groups
        self.platform = platform or current_platform()
        self.arm_layout = arm_layout
        self.sp_backend = sp_backend
        #: on the meta device the engine runs shape-only (``xema verify``): same code, no values
        self.shape_only = device.type == "meta"
        self.prompts = PromptEncoder(pipe, spec, device, dtype, text_encoder_placement, self.platform)
        self.adapters: AdapterPool | None = None  # LoRA adapters per sample (xema_ray.lora), set by the worker
        #: entered last around each batch, after its mitigations, layout and SP are on the pipeline
        #: (``xema verify`` installs the analyzer's block replay here: beneath every hook)
        self.inner_env: Callable[[Any], contextlib.AbstractContextManager[None]] | None = None
        #: a two-expert model's expert state across batches (``xema_ray.mitigation.expert_swap``),
        #: made by the worker's load when its plans swap the experts
        self.experts: Any = None
        #: the format of the pipeline's own transformer weights (quantized in place at load where
        #: every plan of the worker runs one quantized format), and the quantized copies the worker
        #: keeps beside it for the tiers its group serves (``runtime.worker.hold_weight_formats``)
        self.weights: str = "model"
        self.quantized: dict[str, Any] = {}

    # ------------------------------------------------------------------ validation
    def _check(self, config: ExecutionConfig) -> None:
        if config.template.model != self.spec.name:
            raise ValueError(f"batch is for model {config.template.model!r}, this engine runs {self.spec.name!r}")
        if config.sp > 1:
            if self.groups is None:
                raise ValueError(f"config {config.describe()} needs SP = {config.sp} but this engine has no process groups")
            if self.groups.world_size < config.sp:
                raise ValueError(f"SP = {config.sp} exceeds the worker set's {self.groups.world_size} workers")

    # ------------------------------------------------------------------ running
    def run_pipeline(
        self, config: ExecutionConfig, prompts: list[str], seeds: list[int], guidance_scale: float | None = None,
        output_type: str = "np", observer: StepObserver | None = None, control: PauseControl | None = None,
        negative_prompts: list[str | None] | None = None, *, steps: int,
        request_ids: list[str] | None = None,
        references: list[list[Any]] | None = None,
        adapters: list[tuple[LoraUse, ...]] | None = None,
        guidance_scale_2: float | None = None,
    ) -> PipelineRun:
        """One pipeline call under ``config`` at ``steps`` denoising steps (``adapters``: per sample).
        ``output_type="latent"`` stops before the decoders. ``observer`` hears each
        finished step and may stop the batch (``xema_ray.runtime.progress``); ``control`` lets the
        serving layer pause it at a step boundary (``xema_ray.runtime.pause``: only on a
        thread of its own, which the pause parks). ``negative_prompts``: per request, None for
        the model's default. ``steps``: the batch's denoising steps (a caller with a template
        only passes ``config.template.steps``; at another count the static layout is armed
        repeated to them, or not at all). ``request_ids``: to name the
        requests at fault in a ``RequestFailed``. ``references``: each request's images; None: placeholders.
        ``guidance_scale_2``: a two-expert model's low-noise expert guidance (the API lets only such a
        model's requests name it; None: the spec's default, ``guidance_scale`` where that is given)."""
        self._check(config)
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        ids = request_ids if request_ids is not None else [str(i) for i in range(len(prompts))]
        group = self.groups.select(config.ulysses, config.ring) if config.sp > 1 and self.groups else None
        template = config.template
        if steps != template.steps:
            template = template.model_copy(update={"steps": steps})
        # at another step count the worker arms the layout repeated to it, or drops layout_ref
        armed = config.layout_ref is not None and self.arm_layout is not None
        with attributed(ids, "guidance_scale"):  # the pipeline's own range check: the sub-batch's guidance
            call_kwargs = self.spec.call_kwargs(template, guidance_scale)
            if guidance_scale_2 is not None:
                call_kwargs["guidance_scale_2"] = guidance_scale_2
        if control is not None:
            control.must_offload = armed  # its state would lie in the arena the next armed batch reuses
        with self.platform.running():  # before the layout is armed: the solved stream has only the default's
            own_negatives = encode_negatives(self.prompts, negative_prompts, ids)
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.platform.running())  # the device's own context (emulated: its arena)
            first, layout = self._batch_env(config, group, steps, arm=armed, adapters=adapters)
            env = [first]
            stack.callback(lambda: env[0].close())

            def detach() -> None:  # a pause takes the batch's hooks off the shared pipeline ...
                env[0].close()

            def attach() -> None:  # ... and its resume puts them back (the layout stays disarmed:
                env[0] = self._batch_env(config, group, steps, arm=False, adapters=adapters)[0]  # its order restarted)
            if self.shape_only:
                from xema_ray.analyzer.assembly import shape_only_execution

                stack.enter_context(shape_only_execution(self.pipe, self.spec, template))
                output_type = "latent" if output_type == "latent" else "pt"  # meta tensors cannot become numpy
            # the model's own encoder where it has one (placed as planned, cached), else stand-ins
            encoded = encode_attributed(self.prompts, list(prompts), ids, own_negatives)
            own_negatives = None  # copied into the default rows: freed, the batch holds what was planned
            inputs: dict[str, Any] = encoded.inputs
            t_text = encoded.seconds
            clock = stack.enter_context(PhaseClock(self.pipe, self.platform))
            generators = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
            t1 = time.perf_counter()
            with torch.no_grad():
                out = self.spec.pipeline_for(self.pipe, template)(  # references: xema_ray.models.references
                    **call_kwargs, **self.spec.reference_inputs().kwargs(template, references, len(prompts)), **inputs,
                    generator=generators, output_type=output_type,
                    **step_callback(self.pipe, observer, template.steps, group, group is None or group.rank == 0, self.device,
                                    control, (detach, attach)),
                )
            self.platform.synchronize()
            t_end = time.perf_counter()
        decode_start = clock.first_decode if clock.first_decode is not None else t_end
        phases = {
            Phase.TEXT: t_text + clock.encode_prompt_s,
            Phase.DENOISE: max(0.0, decode_start - t1 - clock.encode_prompt_s),
            Phase.DECODE: t_end - decode_start,
        }
        return PipelineRun(out, phases, group.rank if group is not None else 0, armed, layout, encoded)

    def step_cache_for(self, config: ExecutionConfig, steps: int) -> Any:
        """The batch's step mask (``xema_ray.mitigation.step_cache.StepCacheConfig``) where its
        config carries a quality tier's schedule and the batch is long enough to skip a step;
        None: every step computed (lossless). A two-expert model's switch restarts the warm-up.
        On the meta device the cache is installed whatever the mask, so that ``xema verify``
        counts its buffers over the few steps it runs."""
        if config.step_cache is None:
            return None
        from xema_ray.mitigation.step_cache import StepCacheConfig

        at_steps = config.template.model_copy(update={"steps": steps})
        scheduler_config = getattr(getattr(self.pipe, "scheduler", None), "config", None)
        resets = tuple(s.first_step for s in self.spec.expert_stages(at_steps, scheduler_config)[1:])
        cache = StepCacheConfig.for_request(config.step_cache, steps, resets)
        # shape-only (``xema verify``): the few steps it runs skip none, but the buffers count
        return cache if cache.skips or self.shape_only else None

    def _swap_weights(self, fmt: str) -> contextlib.AbstractContextManager[Any]:
        """The quantized copy of the transformer in ``fmt`` in place of the pipeline's own, for a batch."""
        from xema_ray.mitigation.weight_quant import WeightQuantConfig, apply

        copy = self.quantized.get(fmt)
        if copy is None or fmt == "model":
            raise ValueError(f"weights {fmt}: this worker holds {self.weights} weights and copies in "
                             f"{sorted(self.quantized) or 'no other format'}")
        return apply(self.pipe, self.spec, WeightQuantConfig(format=fmt), copy=copy)  # type: ignore[arg-type]

    def _batch_env(self, config: ExecutionConfig, group: Any, steps: int, arm: bool,
                   adapters: Any = None) -> tuple[contextlib.ExitStack, RequestReport | None]:
        """The batch's mitigations, static layout (armed at ``steps``), SP and adapters, entered on
        the pipeline (closing the stack takes them off; a resume enters them again, copying back
        adapters moved out meanwhile), and the armed layout's report (filled when the stack closes)."""
        env = contextlib.ExitStack()
        layout: RequestReport | None = None
        try:
            if config.weights != self.weights:  # first: the batch's mitigations hook the transformer it runs
                if adapters is not None and any(adapters):
                    raise ValueError(f"lora: adapters apply to the model's own weights, not to a {config.weights} "
                                     "copy (the API refuses them with quality balanced)")
                env.enter_context(self._swap_weights(config.weights))
            env.enter_context(apply_config_mitigations(self.pipe, self.spec, config.mitigations, group))
            if config.experts is not None:
                from xema_ray.mitigation.expert_swap import apply_expert_swap

                # the switch and the prefetch at the batch's own step count, on the loaded scheduler
                at_steps = config.template.model_copy(update={"steps": steps})
                env.enter_context(apply_expert_swap(self.pipe, self.spec, at_steps, config.experts, self.experts))
            cache = self.step_cache_for(config, steps)
            if cache is not None:
                from xema_ray.mitigation.step_cache import apply as apply_step_cache

                env.enter_context(apply_step_cache(self.pipe, self.spec, cache))
            if arm:
                assert self.arm_layout is not None and config.layout_ref is not None
                layout = env.enter_context(self.arm_layout(config.layout_ref, steps))
            if group is not None:
                for name in ("transformer", "transformer_2"):  # a two-expert model splits both experts
                    if getattr(self.pipe, name, None) is not None:
                        env.enter_context(apply_sequence_parallel(getattr(self.pipe, name),
                                                                  self.spec.sequence_parallel_split(), group, self.sp_backend))
            enter_adapters(env, self, adapters)
            if self.inner_env is not None:
                env.enter_context(self.inner_env(self.pipe))
        except BaseException:
            env.close()
            raise
        return env, layout

    def execute(self, batch: Batch, observer: StepObserver | None = None, control: PauseControl | None = None) -> BatchResult:
        """Run ``batch`` end to end; see the module docstring. ``observer``, ``control``: see
        ``run_pipeline``."""
        t0 = time.perf_counter()
        self.platform.reset_peak_memory()
        config = batch.config
        group_rank = self.groups.select(config.ulysses, config.ring).rank if config.sp > 1 and self.groups else 0
        output_rank = group_rank == 0
        hand_over = output_rank and config.decode is not None and not self.shape_only  # the pool decodes
        prompts = [r.prompt for r in batch.requests]
        seeds = [r.seed for r in batch.requests]
        try:
            run = self.run_pipeline(
                config, prompts, seeds, batch.guidance_scale,
                output_type="np" if output_rank and not hand_over else "latent",
                observer=observer, control=control, negative_prompts=[r.negative_prompt for r in batch.requests],
                steps=batch.steps, request_ids=[r.request_id for r in batch.requests],
                adapters=[r.lora for r in batch.requests], guidance_scale_2=batch.guidance_scale_2,
                references=batch_references(config.template.references, batch.requests, self.shape_only),
            )
        except BaseException:
            if observer is not None and output_rank:
                ended = getattr(observer, "on_failed", None)  # optional (``StepObserver``)
                if ended is not None:
                    ended()
            raise
        if observer is not None and output_rank and not hand_over:
            observer.on_decoded()
        t_enc = time.perf_counter()
        handed = self._hand_over(batch, run.output, run.prompts) if hand_over else []
        outputs = self._encode(batch, run.output, run.prompts) if output_rank and not self.shape_only and not hand_over else []
        encode_s = time.perf_counter() - t_enc
        return BatchResult(
            template=config.template.key,
            config_hash=config.config_hash(),
            sp_rank=run.sp_rank,
            outputs=outputs,
            timings=PhaseTimings(
                text_s=run.phases[Phase.TEXT], denoise_s=run.phases[Phase.DENOISE], decode_s=run.phases[Phase.DECODE],
                encode_s=encode_s, total_s=time.perf_counter() - t0,
            ),
            memory=self.platform.memory_stats(),
            mitigations=len(config.mitigations),
            layout_armed=run.armed,
            layout_hits=run.layout.hits if run.layout is not None else 0,
            layout_misses=run.layout.misses if run.layout is not None else 0,
            steps_computed=self._steps_computed(config, batch.steps),
            handed=handed,
        )

    def _steps_computed(self, config: ExecutionConfig, steps: int) -> int:
        cache = self.step_cache_for(config, steps)
        return steps if cache is None else steps - cache.skips

    # ------------------------------------------------------------------ outputs
    @staticmethod
    def _prompt_fields(p: EncodedPrompts, k: int) -> dict[str, Any]:
        return {"prompt_tokens": p.tokens[k], "prompt_truncated": p.truncated[k]}

    def _hand_over(self, batch: Batch, out: Any, prompts: EncodedPrompts) -> list[HandedLatents]:
        """Each request's latents (the pipeline's ``output_type="latent"`` output) for the decode pool,
        on the host: the group puts them in Ray's object store."""
        latents = out.frames if hasattr(out, "frames") else out.images
        host = latents.detach().to("cpu", torch.float32).numpy()  # numpy: zero-copy in the object store
        return [HandedLatents(request_id=r.request_id, seed=r.seed, latents=host[k:k + 1].copy(),
                              **self._prompt_fields(prompts, k)) for k, r in enumerate(batch.requests)]

    def _encode(self, batch: Batch, out: Any, prompts: EncodedPrompts) -> list[RequestOutput]:
        t = batch.config.template
        outputs = []
        if self.spec.kind == "image":
            images = np.asarray(out.images)
            for k, (req, img) in enumerate(zip(batch.requests, images, strict=True)):
                outputs.append(
                    RequestOutput(
                        request_id=req.request_id, seed=req.seed, media_type="image/png", data=encode_png(img),
                        width=img.shape[1], height=img.shape[0], frames=1, **self._prompt_fields(prompts, k),
                    )
                )
            return outputs
        videos = np.asarray(out.frames)  # [B, F, H, W, 3]
        audio = getattr(out, "audio", None)
        fps = float(getattr(self.spec, "frame_rate", DEFAULT_VIDEO_FPS))
        for i, (req, frames) in enumerate(zip(batch.requests, videos, strict=True)):
            wav = None
            if audio is not None:
                track = audio[i].float().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio[i])
                rate = int(getattr(self.spec, "vocoder_config", {}).get("output_sampling_rate", 24000))
                wav = encode_wav(track, rate)
            outputs.append(
                RequestOutput(
                    request_id=req.request_id, seed=req.seed, media_type="video/mp4", data=encode_mp4(frames, fps),
                    width=frames.shape[2], height=frames.shape[1], frames=frames.shape[0], audio_wav=wav,
                    **self._prompt_fields(prompts, i),
                )
            )
        if len(outputs) != len(batch.requests) or t.frames < 1:
            raise RuntimeError(f"pipeline returned {len(outputs)} outputs for {len(batch.requests)} requests")
        return outputs
