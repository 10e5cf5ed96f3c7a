"""Fixed-budget step caching: the ``fast`` quality tier's primitive (``docs/quality.md``).

A denoising step whose mask entry is 0 does not run the transformer: each of the step's passes
(a CFG pair run as two calls is two passes) returns the output its pass computed at the last
computed step, kept in a buffer allocated once, at the first computed step, and copied into in
place afterwards. The mask is fixed before the request starts (``StepCacheSchedule.mask``: a
fraction of the request's steps, warm-up first), so the request's latency depends on its step
count only, never on its input, and the planner can price it. A mask of all ones (a request too
short to skip any step, or the analyzer's trace) computes every step and still keeps the buffers:
the trace holds the cached outputs' bytes from the first step to the end of the call, where they
are in the real run.

The step a transformer call belongs to is told by its ``timestep`` argument: the pipelines make
one per step and pass it to every pass of that step (held by a weak reference, so no tensor of
a step outlives it here). A two-expert model (Wan2.2) hooks both experts with one state: the
expert that runs changes at the switch, its first step is a computed one (the mask starts a new
warm-up there, ``StepCacheSchedule.mask(resets=...)``) and the other expert's buffers are dropped.

What cache-dit offers (DBCache, its static ``steps_computation_mask``) is used for block-level
reuse (``apply_block_cache``: first/last blocks computed, the middle from its cached residual),
where the blocks are large enough for its per-block bookkeeping to pay; ``docs/quality.md`` says
where each is used and why.

Example:
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> from xema_ray.tier_plan import StepCacheSchedule
    >>> spec = get_model_spec("tiny-flux2")
    >>> pipe = spec.build_pipeline(BuildOptions())
    >>> handle = apply(pipe, spec, StepCacheConfig(mask=StepCacheSchedule().mask(8)))
    >>> handle.remove()
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from xema_ray.mitigation.hooks import HOOK_NAMES, MitigationHandle, hook_module

if TYPE_CHECKING:
    from xema_ray.mitigation.hsdp import Collective
    from xema_ray.models import ModelSpec
    from xema_ray.tier_plan import StepCacheSchedule

#: the denoiser components a pipeline may hold (Wan2.2: two experts)
DENOISERS = ("transformer", "transformer_2")


class StepCacheConfig(BaseModel):
    """One request's step mask (``StepCacheSchedule.mask`` at its step count)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mask: tuple[int, ...] = Field(min_length=1, description="per denoising step: 1 computed, 0 reuses the cache")

    @field_validator("mask")
    @classmethod
    def _binary(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(m not in (0, 1) for m in v):
            raise ValueError(f"a step mask holds 0 and 1 only, got {sorted(set(v))}")
        if v[0] != 1:
            raise ValueError("a step mask computes its first step (there is nothing to reuse before it)")
        return v

    @property
    def skips(self) -> int:
        """Steps that reuse the cache (0: the request runs lossless)."""
        return self.mask.count(0)

    @classmethod
    def for_request(cls, schedule: StepCacheSchedule, steps: int, resets: tuple[int, ...] = ()) -> StepCacheConfig:
        """``schedule``'s mask for a request of ``steps`` steps (``resets``: expert switches)."""
        return cls(mask=schedule.mask(steps, resets))


@dataclass
class _State:
    """The step a call belongs to and the cached outputs, shared by the hooks of every expert."""

    mask: tuple[int, ...]
    step: int = -1
    last_value: float | None = None  # the step's timestep value
    last_timestep: Any = None  # weakref to the step's timestep tensor (meta device: no values)
    expert: int | None = None  # id of the expert that computed the cached outputs
    passes: int = 0  # calls made in the current step
    cached: dict[int, tuple[list[torch.Tensor], Any]] = field(default_factory=dict)  # pass -> (leaves, spec)
    computed: int = 0
    reused: int = 0

    def begin_call(self, timestep: Any) -> int:
        """The pass index of this call within its step: a new step when the timestep's value is
        new (a step's passes share it; LTX-2 expands it per pass, so identity would not do); on
        the meta device, where there are no values, when the timestep tensor is another object."""
        if isinstance(timestep, torch.Tensor) and timestep.device.type != "meta":
            value = float(timestep.reshape(-1)[0])  # one read per call: steps' timesteps differ, a step's passes' do not
            new = value != self.last_value
            self.last_value = value
        else:
            alive = self.last_timestep() if self.last_timestep is not None else None
            new = alive is None or alive is not timestep
            self.last_timestep = weakref.ref(timestep) if isinstance(timestep, torch.Tensor) else None
        if new:
            self.step += 1
            self.passes = 0
        index = self.passes
        self.passes += 1
        return index

    def computes(self) -> bool:
        return self.step >= len(self.mask) or self.mask[self.step] == 1


class StepCacheHook(ModelHook):
    """On a denoiser: run and keep the output at a computed step, return the kept one at a
    reused step."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        s = self.state
        index = s.begin_call(kwargs.get("timestep"))
        if s.expert is not None and s.expert != id(module):  # the expert switch: the cache resets
            s.cached.clear()
        s.expert = id(module)
        kept = s.cached.get(index)
        if s.computes() or kept is None:
            out = self.fn_ref.original_forward(*args, **kwargs)
            leaves, spec = tree_flatten(out)
            if kept is None or [getattr(t, "shape", None) for t in kept[0]] != [getattr(t, "shape", None) for t in leaves]:
                # allocated once, at the first computed step: the buffers the trace carries across the loop
                s.cached[index] = ([t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves], spec)
            else:
                for dst, src in zip(kept[0], leaves, strict=True):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)
            s.computed += 1
            return out
        s.reused += 1
        leaves, spec = kept
        # a copy: the pipeline owns what a call returns (it may scale or slice it)
        return tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t for t in leaves], spec)

    def reset_state(self, module: nn.Module) -> nn.Module:
        self.state.cached.clear()
        return module


def apply_step_cache(denoisers: list[nn.Module], config: StepCacheConfig) -> tuple[MitigationHandle, _State]:
    """Hook ``denoisers`` (one model's experts, in order) with one shared step cache.

    Args:
        denoisers: the pipeline's transformer(s).
        config: the request's mask.

    Returns:
        The handle (``remove()`` detaches the hooks and drops the cached outputs) and the shared
        state (computed and reused call counts, for tests and the engine's report).
    """
    if not denoisers:
        raise ValueError("step_cache: the pipeline has no transformer to cache")
    state = _State(mask=config.mask)
    handle = MitigationHandle("step_cache")
    for d in denoisers:
        hook_module(handle, d, StepCacheHook(state), HOOK_NAMES["step_cache"])
    handle.add_undo(state.cached.clear)
    return handle, state


def apply(pipe: Any, spec: ModelSpec, config: StepCacheConfig, comm: Collective | None = None) -> MitigationHandle:
    """The primitive's entry point: ``apply_step_cache`` on the pipeline's denoisers (``comm``
    unused: every rank of an SP group computes the same steps)."""
    del spec, comm
    denoisers = [getattr(pipe, n) for n in DENOISERS if getattr(pipe, n, None) is not None]
    return apply_step_cache(denoisers, config)[0]


def cached_output_bytes(spec: ModelSpec, latent_elements: int, rows: int, itemsize: int) -> int:
    """Device bytes the cached outputs hold: one transformer output (``latent_elements`` per
    row, the latent's size) per pass of a step, ``rows`` requests (the analyzer traces them; the
    planner's analytic figure where no trace is at hand)."""
    passes = spec.transformer_passes_per_step()
    return sum(p * rows for p in passes) * latent_elements * itemsize


class BlockCacheConfig(BaseModel):
    """Block-level reuse through cache-dit's DBCache with its static mask: the first ``fn`` and
    last ``bn`` blocks of each block list computed at every step, the middle ones replaced by
    their cached residual at a masked step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mask: tuple[int, ...] = Field(min_length=1)
    fn: int = Field(default=1, ge=1, description="front blocks computed at every step")
    bn: int = Field(default=0, ge=0, description="back blocks computed at every step")


def apply_block_cache(pipe: Any, config: BlockCacheConfig) -> MitigationHandle:
    """cache-dit's DBCache on ``pipe`` with ``config.mask`` as a static step mask (a pipeline
    cache-dit has an adapter for: Flux, Wan, CogVideoX, LTX, Qwen-Image). ``remove()`` releases
    its hooks (``cache_dit.disable_cache``)."""
    import cache_dit  # heavy to import: only where block reuse is asked for

    cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(
        Fn_compute_blocks=config.fn, Bn_compute_blocks=config.bn, num_inference_steps=len(config.mask),
        max_warmup_steps=config.mask.index(0) if 0 in config.mask else len(config.mask),
        steps_computation_mask=list(config.mask), steps_computation_policy="static"))
    handle = MitigationHandle("block_cache")
    handle.add_undo(lambda: cache_dit.disable_cache(pipe))
    return handle
