"""The one assembly of a traced pipeline call: what analysis, confirmation and verify put on a
pipeline so that running it yields a trace ``expand_steps`` can read.

Three callers trace a pipeline, and all of them go through ``assembled``:

- analysis (``xema_ray.analyzer.run.trace_template``): the analyzer builds the model's pipeline
  and runs the call itself, with its shims, markers, CUDA-like attention and block replay;
- confirmation (``xema_ray.analyzer.mitigated.trace_with_mitigations``, the planner's word on a
  mitigated plan): the same call on a pipeline whose mitigations were applied first;
- verify (``xema_ray.measure.verify``): the serving worker builds its pipeline and runs the batch
  (its engine enters ``shape_only_execution`` on meta and installs the batch's mitigations);
  ``assembled`` adds the markers around it and the block replay beneath the batch's hooks.

The rest of this module is the plumbing those pieces are made of: the scheduler's timesteps kept
on the host, the markers, the shape-only environment of the serving engine.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from xema_ray.analyzer.block_replay import BlockReplay, transformer_blocks
from xema_ray.analyzer.steps import DIT_BEGIN, STEP_BOUNDARY
from xema_ray.analyzer.tracer import AllocationTracer, cuda_like_attention

if TYPE_CHECKING:
    from xema_ray.models import ModelSpec
    from xema_ray.templates import RequestTemplate

#: installs a block replay on a pipeline, entered beneath the hooks present when it is entered
ReplayInstaller = Callable[[Any], contextlib.AbstractContextManager[None]]


class Marking(Protocol):
    """What the markers write to: the tracer, or the segment profiler's timeline."""

    def mark(self, label: str) -> None: ...


@contextlib.contextmanager
def assembled(
    pipe: Any,
    tracer: AllocationTracer,
    device: str,
    *,
    call: tuple[ModelSpec, RequestTemplate] | None = None,
    markers: bool = True,
    hooks: contextlib.AbstractContextManager[Any] | None = None,
    replay_blocks: bool = False,
    names: dict[int, str] | None = None,
    beneath: Callable[[ReplayInstaller], None] | None = None,
) -> Iterator[BlockReplay | None]:
    """Assemble ``pipe`` for a call traced by ``tracer`` on ``device``; the caller enters the
    tracer (analysis: innermost; verify: around the worker's load too) and makes the call.

    Entered in this order, left in the reverse one:

    1. ``call`` (the model and template of a call the analyzer makes itself): the model's
       value-reading shims (meta only), no autograd, the scheduler's timesteps on the host;
    2. ``markers``: step, DiT-entry and decode markers, host inputs moved onto ``device`` as the
       DiT is entered;
    3. ``call``: attention allocating what CUDA's kernels allocate, transformers' mask shims (meta);
    4. ``hooks``: what the caller installs for the call (mitigations);
    5. ``replay_blocks``: DiT block replay (``block_replay``) beneath every hook then on the blocks,
       which are named from ``names`` (default: by position). A caller whose hooks go on later,
       in code it runs (the serving engine installs a batch's mitigations when it executes it),
       passes ``beneath``: it receives the replay's installer, to enter beneath those hooks.

    Yields the block replay installed here (None: none, or handed to ``beneath``), for its counts.
    """
    replay = None
    with contextlib.ExitStack() as stack:
        if call is not None:
            spec, template = call
            stack.enter_context(spec.tracing_shims(template) if device == "meta" else contextlib.nullcontext())
            stack.enter_context(torch.no_grad())
            stack.enter_context(_scheduler_on_host(pipe))
        if markers:
            stack.enter_context(_markers(pipe, tracer, device))
        if call is not None:
            from xema_ray.models.text_encoders import meta_shims

            stack.enter_context(cuda_like_attention(tracer))
            if device == "meta":
                stack.enter_context(meta_shims())
        if replay_blocks and beneath is not None:
            beneath(lambda p: BlockReplay(tracer, transformer_blocks(p, names or {})).installed())
        elif replay_blocks:
            # the blocks as the call is assembled, before the hooks go on
            replay = BlockReplay(tracer, transformer_blocks(pipe, names or {}))
        if hooks is not None:
            stack.enter_context(hooks)
        if replay is not None:
            stack.enter_context(replay.installed())
        yield replay


# ---------------------------------------------------------------------------- pipeline plumbing
def components(pipe: Any) -> list[tuple[str, nn.Module]]:
    """The pipeline's module components, by name."""
    return [(name, c) for name, c in pipe.components.items() if isinstance(c, nn.Module)]


def module_names(pipe: Any) -> dict[int, str]:
    """Every sub-module's dotted name (``component.path``), by id: what a trace calls it."""
    names: dict[int, str] = {}
    for comp, module in components(pipe):
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
def _markers(pipe: Any, tracer: Marking, device: str) -> Iterator[None]:
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

    for comp in _denoisers(pipe):
        handles.append(comp.register_forward_pre_hook(dit_pre, with_kwargs=True))
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


def trace_markers(pipe: Any, tracer: Marking, device: str) -> contextlib.AbstractContextManager[None]:
    """The analyzer's step / DiT / decode markers on ``pipe`` (what ``expand_steps`` reads), set
    on anything that takes marks (the segment profiler's timeline too)."""
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

    handles = [comp.register_forward_pre_hook(to_meta, with_kwargs=True) for comp in _denoisers(pipe)]
    try:
        with spec.tracing_shims(template), _scheduler_on_host(pipe), cuda_like_attention(None), meta_shims():
            yield
    finally:
        for h in handles:
            h.remove()


def _denoisers(pipe: Any) -> list[nn.Module]:
    """The pipeline's DiTs: ``transformer`` and, for a two-expert model, ``transformer_2``."""
    return [c for c in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None)) if isinstance(c, nn.Module)]
