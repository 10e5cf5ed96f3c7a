"""The Memory Analyzer (paper §3.3, §7.2): a shape-only run of the real pipeline for a template.

``trace_template`` builds the model's real diffusers pipeline on the meta device, runs one call
for the template under ``AllocationTracer`` and returns the whole request's ``MemoryTrace``:
resident weights, inputs, every denoising step and the VAE decode. The call is assembled by
``xema_ray.analyzer.assembly`` (the one assembly analysis, confirmation and verify share).

Denoising steps repeat the same allocation pattern exactly (template-static execution), so only
three steps are traced and the rest replicated (``xema_ray.analyzer.steps``). That keeps a 50-step
CogVideoX analysis to seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from xema_ray.analyzer.assembly import assembled, components, module_names
from xema_ray.analyzer.block_replay import BlockReplay
from xema_ray.analyzer.experts import label_experts
from xema_ray.analyzer.steps import expand_steps, steps_to_trace
from xema_ray.analyzer.tracer import AllocationTracer
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.models import BuildOptions, ModelSpec
from xema_ray.templates import RequestTemplate
from xema_ray.tier_plan import WeightFormat

TRACER_VERSION = "2"  # 2: step bounds typed (MemoryTrace.step_bounds), not in meta


@dataclass(frozen=True)
class TraceOptions:
    """How to run the shape-only pass.

    Attributes:
        device: "meta" (analysis) or "cpu" (reference run of a tiny model).
        dtype: parameter/activation dtype; None = bf16 for real models, fp32 for tiny ones.
        count_host: count host tensors too (only for the meta-vs-CPU correctness test).
        replicate: trace two steps and replicate; False traces every step (reference runs).
        memoise: reuse meta-kernel results per operator signature (exact; False only to check it).
        prompt: the prompt the stand-in embeddings are derived from.
        seed: generator seed for the initial noise.
    """

    device: str = "meta"
    dtype: torch.dtype | None = None
    count_host: bool = False
    replicate: bool = True
    memoise: bool = True
    prompt: str = "a photo of a cat"
    seed: int = 0
    #: trace the model's real text encoder (built from its config) in the text phase, placed
    #: "device" (resident all request), "streamed" (layers through the device during set-up) or
    #: "cpu" (nothing on the device: the embeddings arrive as inputs); None = stand-in inputs
    text_encoder: str | None = None
    #: run each distinct DiT block call once and replay its allocations for the other blocks
    #: (``block_replay``; meta device only, exact: the tests compare event for event)
    replay_blocks: bool = False
    #: components kept in a dtype of their own (``BuildOptions.component_dtypes``): an fp32 VAE
    #: beside a bf16 transformer holds and decodes in twice the bytes, which the trace must count
    component_dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    #: the transformer's weight format (``xema analyze --weights``): its quantizable layers stored
    #: so (torchao's own tensors, values and scales), dequantized in each matmul (traced)
    weights: WeightFormat = "model"


def build_for_trace(spec: ModelSpec, opts: TraceOptions, dtype: torch.dtype) -> Any:
    """``spec``'s pipeline on ``opts.device`` in ``dtype``, its transformer in ``opts.weights``."""
    pipe = spec.build_pipeline(BuildOptions(device=opts.device, dtype=dtype, component_dtypes=opts.component_dtypes))
    if opts.weights != "model":
        from xema_ray.mitigation.weight_quant import WeightQuantConfig, quantize_transformer

        quantize_transformer(pipe.transformer, spec, WeightQuantConfig(format=opts.weights))
    return pipe


def default_dtype_for(spec: ModelSpec) -> torch.dtype:
    return torch.bfloat16 if spec.size == "real" else torch.float32


def trace_template(
    template: RequestTemplate,
    options: TraceOptions | None = None,
    pipeline: Any | None = None,
    prepare: Callable[[Any, AllocationTracer], contextlib.AbstractContextManager[None]] | None = None,
    scheduler_config: Mapping[str, Any] | None = None,
) -> MemoryTrace:
    """The memory trace of one request of ``template`` (batch included).

    Args:
        template: what to trace.
        options: device, dtype and replication (defaults: meta, model's dtype, replicate).
        pipeline: a pipeline already built for ``options.device`` (default: built here).
        prepare: optional ``(pipeline, tracer) -> context manager`` entered around the call, for
            callers that install mitigations (the mitigation library) before tracing.
        scheduler_config: the scheduler the serving worker loads (a checkpoint's own:
            ``xema_ray.models.base.checkpoint_scheduler_config``); a model of several experts has
            its steps named after the expert that runs them on it (None: the spec's scheduler).

    Example:
        >>> t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=4)
        >>> trace = trace_template(t)
        >>> trace.peak() > trace.resident_bytes()
        True
    """
    opts = options or TraceOptions()
    spec = template.spec
    dtype = opts.dtype or default_dtype_for(spec)
    if opts.device == "meta" and spec.size == "real" and opts.count_host:
        raise ValueError("count_host is for tiny-model reference tests; a real model's host tensors would be huge")
    pipe = pipeline if pipeline is not None else build_for_trace(spec, opts, dtype)
    traced = steps_to_trace(spec.settling_steps_for(template), spec.step_lifetime)
    traced_steps = min(template.steps, traced) if opts.replicate else template.steps
    stages = spec.expert_stages(template, scheduler_config)
    # replicated steps must be alike: one expert runs them all, the others' steps are named after
    # their experts (so are all steps on a scheduler other than the one the pipeline was built with)
    one_expert = len(stages) > 1 and (traced_steps < template.steps or scheduler_config is not None)
    tracer, replay = _traced_call(pipe, spec, template, traced_steps, opts, dtype, prepare=prepare,
                                  one_expert=one_expert)
    raw = tracer.raw()
    raw.meta.update(_trace_meta(template, opts, dtype, traced_steps, replay, tracer))
    trace = expand_steps(raw, template.steps, spec.step_lifetime)
    return label_experts(trace, stages) if one_expert else trace


def _traced_call(
    pipe: Any,
    spec: ModelSpec,
    template: RequestTemplate,
    traced_steps: int,
    opts: TraceOptions,
    dtype: torch.dtype,
    *,
    prepare: Callable[[Any, AllocationTracer], contextlib.AbstractContextManager[None]] | None,
    one_expert: bool,
) -> tuple[AllocationTracer, BlockReplay | None]:
    """One pipeline call of ``template`` for its ``traced_steps`` under a tracer that knows the
    pipeline's modules: the tracer, and the block replay the assembly used (None: none)."""
    run_template = template.with_(steps=traced_steps)
    prompts = [opts.prompt] * template.batch
    encoder = _attach_text_encoder(pipe, spec, opts, dtype)
    names = module_names(pipe)
    tracer = AllocationTracer(opts.device, names, count_host=opts.count_host, memoise=opts.memoise)
    for name, module in components(pipe):
        tracer.register_module(name, module)
    if encoder is None:
        inputs = spec.prompt_embeddings(prompts, opts.device, dtype)
        tracer.register_resident(dict(inputs), Category.INPUT)

    generator = torch.Generator(device="cpu").manual_seed(opts.seed)
    # reference images (placeholders of the template's size): their preprocessing, VAE encode and
    # the longer sequence are part of the trace
    call = {**spec.call_kwargs(run_template), **spec.reference_inputs().kwargs(run_template)}
    extra = prepare(pipe, tracer) if prepare is not None else contextlib.nullcontext()
    try:
        with (
            assembled(pipe, tracer, opts.device, call=(spec, run_template), hooks=extra, names=names,
                      replay_blocks=opts.replay_blocks and opts.device == "meta" and not opts.count_host) as replay,
            spec.one_expert_call(pipe) if one_expert else contextlib.nullcontext(),
            tracer,
        ):
            if encoder is not None:  # text encoding is the first part of the text phase
                tracer.mark("begin:text_encoder")
                inputs = spec.encode_prompts(pipe, prompts, torch.device(opts.device), dtype)
                tracer.mark("end:text_encoder")
            spec.pipeline_for(pipe, template)(**call, **inputs, generator=generator, output_type="pt")
            del inputs
    finally:
        if encoder is not None:
            encoder.detach()
    return tracer, replay


def _trace_meta(template: RequestTemplate, opts: TraceOptions, dtype: torch.dtype, traced_steps: int,
                replay: BlockReplay | None, tracer: AllocationTracer) -> dict[str, str]:
    """What a trace records of how it was made (template, device, dtypes, tracer, replay, memo)."""
    meta = {
        "template": template.key,
        "device": opts.device,
        "dtype": str(dtype).removeprefix("torch."),
        "tracer_version": TRACER_VERSION,
        "traced_steps": str(traced_steps),
        "text_encoder": opts.text_encoder or "none",
    }
    if opts.weights != "model":
        meta["weights"] = opts.weights
    if opts.component_dtypes:
        meta["component_dtypes"] = ",".join(f"{c}={str(d).removeprefix('torch.')}" for c, d in opts.component_dtypes)
    if replay is not None:
        meta["block_replay"] = (f"{replay.replayed} replayed ({replay.replayed_hooked} beneath mitigation hooks)"
                                f" / {replay.recorded} recorded")
    if tracer.memo is not None:
        meta["meta_kernel_memo"] = f"{tracer.memo.hits} hits / {tracer.memo.misses} misses"
    return meta


@dataclass
class _AttachedEncoder:
    pipe: Any
    previous: tuple[Any, Any]
    handle: Any = None

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.pipe.text_encoder, self.pipe.tokenizer = self.previous


def _attach_text_encoder(pipe: Any, spec: ModelSpec, opts: TraceOptions, dtype: torch.dtype) -> _AttachedEncoder | None:
    """Give ``pipe`` the model's real text encoder (meta, from its config) for the trace, placed
    as ``opts.text_encoder`` says; None when the trace uses stand-in embeddings (no encoder, or
    an encoder on the host CPU: its embeddings are then inputs, like the stand-ins)."""
    if opts.text_encoder in (None, "cpu") or spec.text_encoder is None:
        return None
    if opts.device != "meta":
        raise ValueError("tracing the text encoder is for the meta device (its weights are not built here)")
    from xema_ray.mitigation.block_offload import BlockOffloadConfig, apply_block_offload
    from xema_ray.models.text_encoders import build_encoder_on_meta, build_tokenizer

    enc_spec = spec.text_encoder
    encoder = build_encoder_on_meta(enc_spec, dtype, real_buffers=False)
    attached = _AttachedEncoder(pipe, (getattr(pipe, "text_encoder", None), getattr(pipe, "tokenizer", None)))
    if opts.text_encoder == "streamed":
        # before the tracer registers resident weights: the streamed layers are not resident
        units = enc_spec.units(encoder)
        attached.handle = apply_block_offload(encoder, units, BlockOffloadConfig(blocks=tuple(range(len(units)))))
        from xema_ray.placement import HostCopy

        for prefix in enc_spec.streamed_host_modules()[len(units):]:  # the vision tower: on the host, never run
            for t in encoder.get_submodule(prefix).parameters():
                t.data = HostCopy(t.data).placeholder()
    pipe.text_encoder, pipe.tokenizer = encoder, build_tokenizer(enc_spec)
    return attached
