"""The Memory Analyzer (paper §3.3, §7.2): a shape-only run of the real pipeline for a template.

``trace_template`` builds the model's real diffusers pipeline on the meta device, runs one call
for the template under ``AllocationTracer`` and returns the whole request's ``MemoryTrace``:
resident weights, inputs, every denoising step and the VAE decode.

Denoising steps repeat the same allocation pattern exactly (template-static execution), so only
three steps are traced: step 0 also carries one-off set-up, steps 1 and 2 are the steady state.
The analyzer checks that steps 1 and 2 are identical and replicates step 2 for the remaining
steps. That keeps a 50-step CogVideoX analysis to seconds.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from xema_ray.analyzer.block_replay import BlockReplay, transformer_blocks
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.analyzer.tracer import (
    ALLOC,
    FREE,
    MIN_BLOCK_SIZE,
    AllocationTracer,
    RawTrace,
    cuda_like_attention,
    raw_to_arrays,
)
from xema_ray.models import BuildOptions, ModelSpec
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import Phase, trace_decode, trace_step

TRACER_VERSION = "2"  # 2: step bounds typed (MemoryTrace.step_bounds), not in meta
STEP_BOUNDARY = "scheduler_step"
REPLICATE_FROM = 3  # traced steps when replicating: step 0 carries set-up, steps 1 and 2 must match
DIT_BEGIN = "dit_begin"


class StepPatternError(RuntimeError):
    """Two traced denoising steps differ, so one step cannot stand for all of them."""


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


def default_dtype_for(spec: ModelSpec) -> torch.dtype:
    return torch.bfloat16 if spec.size == "real" else torch.float32


def trace_template(
    template: RequestTemplate,
    options: TraceOptions | None = None,
    pipeline: Any | None = None,
    prepare: Callable[[Any, AllocationTracer], contextlib.AbstractContextManager[None]] | None = None,
) -> MemoryTrace:
    """The memory trace of one request of ``template`` (batch included).

    Args:
        template: what to trace.
        options: device, dtype and replication (defaults: meta, model's dtype, replicate).
        pipeline: a pipeline already built for ``options.device`` (default: built here).
        prepare: optional ``(pipeline, tracer) -> context manager`` entered around the call, for
            callers that install mitigations (the mitigation library) before tracing.

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
    pipe = pipeline if pipeline is not None else spec.build_pipeline(BuildOptions(device=opts.device, dtype=dtype))
    traced_steps = min(template.steps, REPLICATE_FROM) if opts.replicate else template.steps
    run_template = template.with_(steps=traced_steps)

    prompts = [opts.prompt] * template.batch
    encoder = _attach_text_encoder(pipe, spec, opts, dtype)
    names = _module_names(pipe)
    tracer = AllocationTracer(opts.device, names, count_host=opts.count_host, memoise=opts.memoise)
    replay = (BlockReplay(tracer, transformer_blocks(pipe, names))
              if opts.replay_blocks and opts.device == "meta" and not opts.count_host else None)
    for name, module in _components(pipe):
        tracer.register_module(name, module)
    if encoder is None:
        inputs = spec.prompt_embeddings(prompts, opts.device, dtype)
        tracer.register_resident(dict(inputs), Category.INPUT)

    generator = torch.Generator(device="cpu").manual_seed(opts.seed)
    call = dict(spec.call_kwargs(run_template))
    extra = prepare(pipe, tracer) if prepare is not None else contextlib.nullcontext()
    shims = spec.tracing_shims(run_template) if opts.device == "meta" else contextlib.nullcontext()
    from xema_ray.models.text_encoders import meta_shims

    try:
        with (
            shims,
            torch.no_grad(),
            _scheduler_on_host(pipe),
            _markers(pipe, tracer, opts.device),
            cuda_like_attention(tracer),
            meta_shims() if opts.device == "meta" else contextlib.nullcontext(),
            extra,
            replay.installed() if replay is not None else contextlib.nullcontext(),
            tracer,
        ):
            if encoder is not None:  # text encoding is the first part of the text phase
                tracer.mark("begin:text_encoder")
                inputs = spec.encode_prompts(pipe, prompts, torch.device(opts.device), dtype)
                tracer.mark("end:text_encoder")
            pipe(**call, **inputs, generator=generator, output_type="pt")
            del inputs
    finally:
        if encoder is not None:
            encoder.detach()
    raw = tracer.raw()
    raw.meta.update(
        {
            "template": template.key,
            "device": opts.device,
            "dtype": str(dtype).removeprefix("torch."),
            "tracer_version": TRACER_VERSION,
            "traced_steps": str(traced_steps),
            "text_encoder": opts.text_encoder or "none",
        }
    )
    if replay is not None:
        raw.meta["block_replay"] = (f"{replay.replayed} replayed ({replay.replayed_hooked} beneath mitigation hooks)"
                                    f" / {replay.recorded} recorded")
    if tracer.memo is not None:
        raw.meta["meta_kernel_memo"] = f"{tracer.memo.hits} hits / {tracer.memo.misses} misses"
    return expand_steps(raw, template.steps)


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


# ---------------------------------------------------------------------------- pipeline plumbing
def _components(pipe: Any) -> list[tuple[str, nn.Module]]:
    return [(name, c) for name, c in pipe.components.items() if isinstance(c, nn.Module)]


def _module_names(pipe: Any) -> dict[int, str]:
    names: dict[int, str] = {}
    for comp, module in _components(pipe):
        for path, sub in module.named_modules():
            names.setdefault(id(sub), f"{comp}.{path}" if path else comp)
    return names


@contextlib.contextmanager
def _scheduler_on_host(pipe: Any) -> Iterator[None]:
    """Keep the scheduler's timesteps on the CPU, as on a GPU run where schedulers index their
    tables with the timestep (a meta timestep cannot index). Patched on the class because LTX-2
    deep-copies the scheduler for its audio branch."""
    cls = type(pipe.scheduler)
    original = cls.set_timesteps

    @functools.wraps(original)
    def set_timesteps(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2:  # (num_inference_steps, device, ...)
            args = (args[0], "cpu", *args[2:])
        else:
            kwargs["device"] = "cpu"
        return original(self, *args, **kwargs)

    cls.set_timesteps = set_timesteps
    try:
        yield
    finally:
        cls.set_timesteps = original


def _to_device(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type != device:
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


@contextlib.contextmanager
def _markers(pipe: Any, tracer: AllocationTracer, device: str) -> Iterator[None]:
    """Mark DiT calls, step ends and decode phases; move host timesteps onto the traced device.

    A step boundary is the pipeline scheduler's ``step`` entry. (``callback_on_step_end``
    would be the obvious marker, but the pipelines build its kwargs with ``locals()``, which on
    CPython < 3.13 pins the previous step's tensors in the frame and changes the trace.)"""
    handles = []
    scheduler = pipe.scheduler
    sched_cls = type(scheduler)
    original_step = sched_cls.step

    @functools.wraps(original_step)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is scheduler:  # LTX-2 also steps a deep copy for audio: one marker per step
            tracer.mark(STEP_BOUNDARY)
        return original_step(self, *args, **kwargs)

    sched_cls.step = step

    def dit_pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        tracer.mark(DIT_BEGIN)
        return _to_device(args, device), _to_device(kwargs, device)

    handles.append(pipe.transformer.register_forward_pre_hook(dit_pre, with_kwargs=True))
    patched: list[tuple[nn.Module, str]] = []
    for name in ("vae", "audio_vae"):
        comp = getattr(pipe, name, None)
        if comp is None or not hasattr(comp, "decode"):
            continue
        original = comp.decode

        def decode(*args: Any, _orig: Callable[..., Any] = original, _name: str = name, **kwargs: Any) -> Any:
            tracer.mark(f"begin:{_name}")
            try:
                return _orig(*args, **kwargs)
            finally:
                tracer.mark(f"end:{_name}")

        comp.decode = decode  # instance attribute shadows the method; deleted below
        patched.append((comp, "decode"))
    vocoder = getattr(pipe, "vocoder", None)
    if isinstance(vocoder, nn.Module):
        handles.append(vocoder.register_forward_pre_hook(lambda *_: tracer.mark("begin:vocoder")))
        handles.append(vocoder.register_forward_hook(lambda *_: tracer.mark("end:vocoder")))
    try:
        yield
    finally:
        sched_cls.step = original_step
        for h in handles:
            h.remove()
        for comp, attr in patched:
            delattr(comp, attr)


def trace_markers(pipe: Any, tracer: AllocationTracer, device: str) -> contextlib.AbstractContextManager[None]:
    """The analyzer's step / DiT / decode markers on ``pipe`` (what ``expand_steps`` reads), for
    callers that trace a pipeline run by other code (``xema verify`` tracing the serving worker)."""
    return _markers(pipe, tracer, device)


@contextlib.contextmanager
def shape_only_execution(pipe: Any, spec: ModelSpec, template: RequestTemplate) -> Iterator[None]:
    """What a pipeline call needs to run on the meta device (the analyzer's own set-up): the
    model's value-reading shims, the scheduler on the host, host timesteps moved onto meta as
    the DiT is entered, and attention allocating what CUDA's kernels allocate. The serving
    engine enters it when its device is meta, so ``xema verify`` runs the worker's own code."""

    def to_meta(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return _to_device(args, "meta"), _to_device(kwargs, "meta")

    from xema_ray.models.text_encoders import meta_shims

    handle = pipe.transformer.register_forward_pre_hook(to_meta, with_kwargs=True)
    try:
        with spec.tracing_shims(template), _scheduler_on_host(pipe), cuda_like_attention(None), meta_shims():
            yield
    finally:
        handle.remove()


# ---------------------------------------------------------------------------- step replication
def _step_bounds(raw: RawTrace) -> list[int]:
    """Event index of each scheduler-step entry: region k = [bound[k-1], bound[k]) holds the
    scheduler update of step k-1 and DiT call k, so every tensor a region makes is freed in
    that region or the next (the previous latents die when the next loop iteration rebinds)."""
    bounds = [pos for pos, label in raw.markers if label == STEP_BOUNDARY]
    if not bounds:
        raise StepPatternError("the pipeline call made no denoising step (the scheduler never stepped)")
    return bounds


def _event_signature(kinds: np.ndarray, allocs: np.ndarray, start: int, stop: int,
                     arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Per event (one row each): kind, rounded size, module, op, and where a freed allocation was
    born (position in this region). A free of an earlier allocation keeps only its size: the tensor
    it releases (initial noise in step 1, the previous update in step 2) legitimately differs."""
    a = allocs[start:stop]
    born = arrays["begin"][a]
    inside = (born >= start) & (born < stop)
    nbytes = arrays["nbytes"][a]
    return np.stack([
        kinds[start:stop].astype(np.int64),
        np.where(nbytes > 0, (nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE * MIN_BLOCK_SIZE, 0),  # round_size
        np.where(inside, arrays["module"][a], -1),
        np.where(inside, arrays["op"][a], -1),
        np.where(inside, born - start, -1),
    ], axis=1)


def _local_index(ids: np.ndarray, n: int) -> np.ndarray:
    """``index[a]`` = position of allocation ``a`` in ``ids`` (-1 where absent), for ``a < n``."""
    index = np.full(n, -1, dtype=np.int64)
    index[ids] = np.arange(len(ids), dtype=np.int64)
    return index


def expand_steps(raw: RawTrace, steps: int) -> MemoryTrace:
    """Turn a raw trace of ``k`` traced steps into a ``MemoryTrace`` of ``steps`` steps.

    With ``k == steps`` nothing is replicated. Otherwise ``k`` must be ``REPLICATE_FROM`` (3):
    regions 1 and 2 (the steady state; region 0 also holds the set-up) must be identical, and
    region 2 is repeated for steps 3..steps-1. A free in a copy of an allocation born in the
    previous region is remapped to the previous copy; a free after the loop of an allocation
    of the last traced region goes to the last copy.

    Raises:
        StepPatternError: the two steady-state steps differ, or an allocation outlives two
            regions (state that accumulates across steps), so replication would be wrong.
    """
    arrays = raw_to_arrays(raw)
    bounds = _step_bounds(raw)
    traced = len(bounds)
    kinds = np.asarray(raw.event_kind, dtype=np.int8)
    allocs = np.asarray(raw.event_alloc, dtype=np.int64)
    if traced == steps:
        return _assemble(raw, {k: v for k, v in arrays.items() if k not in ("begin", "end")},
                         arrays["begin"], arrays["end"], raw.n_events, bounds)
    if traced != REPLICATE_FROM:
        raise ValueError(f"replication needs {REPLICATE_FROM} traced steps, got {traced} for {steps} steps")

    s1, s2, s3 = bounds  # region 1 = [s1, s2), region 2 = [s2, s3), tail = [s3, end)
    sig1 = _event_signature(kinds, allocs, s1, s2, arrays)
    sig2 = _event_signature(kinds, allocs, s2, s3, arrays)
    if not np.array_equal(sig1, sig2):
        m = min(len(sig1), len(sig2))
        differ = np.flatnonzero(np.any(sig1[:m] != sig2[:m], axis=1))
        where = int(differ[0]) if len(differ) else m

        def row(sig: np.ndarray) -> tuple[int, ...] | None:
            return tuple(int(v) for v in sig[where]) if where < len(sig) else None

        raise StepPatternError(
            f"denoising steps 1 and 2 differ ({len(sig1)} vs {len(sig2)} events; first difference at event "
            f"{where} of the step: {row(sig1)} vs {row(sig2)})"
        )
    begin = arrays["begin"]
    freed_in_2 = allocs[s2:s3][kinds[s2:s3] == FREE]
    if np.any(begin[freed_in_2] < s1):
        raise StepPatternError("step 2 frees an allocation made before step 1; steps are not self-contained")
    tail_kinds, tail_allocs = kinds[s3:], allocs[s3:]
    tail_freed = tail_allocs[tail_kinds == FREE]
    if np.any((begin[tail_freed] >= s1) & (begin[tail_freed] < s2)):
        raise StepPatternError("an allocation of step 1 is still alive after step 2; it accumulates across steps")

    prev_allocs = allocs[s1:s2][kinds[s1:s2] == ALLOC]  # region 1's allocations, in order
    pat_allocs = allocs[s2:s3][kinds[s2:s3] == ALLOC]  # region 2's allocations, in order
    per_step = len(pat_allocs)
    n_orig = len(raw.records)
    extra = steps - traced  # copies of region 2 beyond the traced one

    def ids_of_copy(c: int) -> np.ndarray:
        """Allocation ids of copy c of region 2: c = -1 is region 1, c = 0 the traced region 2."""
        if c < 0:
            return prev_allocs
        if c == 0:
            return pat_allocs
        return n_orig + (c - 1) * per_step + np.arange(per_step, dtype=np.int64)

    local_in_pat = _local_index(pat_allocs, n_orig)
    pat_kind, pat_alloc = kinds[s2:s3], allocs[s2:s3]
    self_idx = local_in_pat[pat_alloc]
    prev_idx = _local_index(prev_allocs, n_orig)[pat_alloc]
    is_self = self_idx >= 0

    out_kind, out_alloc = [kinds[:s3]], [allocs[:s3]]
    for c in range(1, extra + 1):
        cur, prev = ids_of_copy(c), ids_of_copy(c - 1)
        out_kind.append(pat_kind)
        out_alloc.append(np.where(is_self, cur[np.maximum(self_idx, 0)], prev[np.maximum(prev_idx, 0)]))
    last = ids_of_copy(extra)
    tail_local = local_in_pat[tail_allocs]
    tail_mapped = tail_allocs.copy()
    tail_mapped[tail_local >= 0] = last[tail_local[tail_local >= 0]]
    out_kind.append(tail_kinds)
    out_alloc.append(tail_mapped)
    kinds_n = np.concatenate(out_kind)
    allocs_n = np.concatenate(out_alloc)

    cols = {
        name: np.concatenate([col, np.tile(col[pat_allocs], extra)])
        for name, col in arrays.items()
        if name not in ("begin", "end")
    }
    n_total = n_orig + extra * per_step
    is_alloc = kinds_n == ALLOC
    begin_n = np.full(n_total, -1, dtype=np.int64)
    end_n = np.full(n_total, len(kinds_n), dtype=np.int64)
    begin_n[allocs_n[is_alloc]] = np.flatnonzero(is_alloc)
    is_free = ~is_alloc
    end_n[allocs_n[is_free]] = np.flatnonzero(is_free)
    step_len = s3 - s2
    new_bounds = [s1, s2, s3] + [s3 + i * step_len for i in range(1, extra + 1)]
    return _assemble(raw, cols, begin_n, end_n, len(kinds_n), new_bounds)


def _assemble(
    raw: RawTrace,
    cols: dict[str, np.ndarray],
    begin: np.ndarray,
    end: np.ndarray,
    n_events: int,
    bounds: list[int],
) -> MemoryTrace:
    # Phases by where each allocation was made. Step k runs from the first DiT call (k = 0) or
    # the scheduler entry of step k-1 up to the scheduler entry of step k; the last scheduler
    # update and what follows is "post", with decode phases carved out of it by markers; what runs
    # before the first step is "text" (xema_ray.vocabulary).
    first_dit = next((pos for pos, label in raw.markers if label == DIT_BEGIN), 0)
    starts = [min(first_dit, bounds[0])] + bounds[:-1]
    phases: list[str] = [Phase.TEXT.value] + [trace_step(k) for k in range(len(bounds))]
    # the regions [starts[0], bounds[0]), [bounds[0], bounds[1]), ... are contiguous: phase k + 1
    # for region k, 0 before the first, len(phases) (post) from the last bound on
    edges = np.asarray([starts[0], *bounds], dtype=np.int64)
    phase = np.searchsorted(edges, begin, side="right").astype(np.int32)
    after = begin >= bounds[-1]
    phases.append(Phase.POST.value)
    # decode markers are in traced-event space; events after the loop shifted by the copies
    shift = n_events - raw.n_events
    opened: dict[str, int] = {}
    for pos, label in raw.markers:
        if label.startswith("begin:"):
            opened[label[6:]] = pos + shift
        elif label.startswith("end:") and label[4:] in opened:
            s, e = opened.pop(label[4:]), pos + shift
            phase[(begin >= s) & (begin < e) & after] = len(phases)
            phases.append(trace_decode(label[4:]))
    # canonical row order: by allocation event (replicated copies were appended at the end)
    if len(begin) > 1 and not np.all(begin[1:] >= begin[:-1]):
        order = np.argsort(begin, kind="stable")
        begin, end, phase = begin[order], end[order], phase[order]
        cols = {k: v[order] for k, v in cols.items()}
    nbytes = cols["nbytes"]
    size = ((nbytes + 511) // 512) * 512
    resident = cols["category"] != Category.ACTIVATION
    phase[resident] = 0
    meta = dict(raw.meta)
    meta["trace_hash"] = hashlib.sha256(size.tobytes() + begin.tobytes() + end.tobytes()).hexdigest()[:16]
    return MemoryTrace(
        size=size,
        nbytes=nbytes,
        begin=begin,
        end=end,
        category=cols["category"],
        module=cols["module"],
        phase=phase,
        op=cols["op"],
        free_module=cols["free_module"],
        n_events=n_events,
        modules=list(raw.modules),
        phases=phases,
        ops=list(raw.ops),
        step_bounds=[int(b) for b in bounds],
        meta=meta,
    )
