"""Temporary serialization (paper §5.2, Figure 6): run chosen segments in sub-batches.

A batch of BS requests (and the CFG pair a pipeline forms from each) runs together, except
inside the chosen modules: there the batch is split into ``sub_batches`` parts that run one
after another and are concatenated again, so only that segment's activations shrink. Any
tensor in the arguments (nested in tuples, lists, dicts) whose leading dimension equals the
batch is split; the rest is passed whole. Outputs are rejoined the same way (a diffusers
output dataclass, a tuple, or a nested dict of conv caches).

Example:
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> spec = get_model_spec("tiny-cogvideox")
    >>> pipe = spec.build_pipeline(BuildOptions())
    >>> h = apply_serialization(pipe, SerializationConfig(modules=("transformer",), sub_batches=2))
    >>> h.remove()
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from xema_ray.mitigation.hooks import HOOK_NAMES, MitigationHandle, hook_module, resolve_module

if TYPE_CHECKING:
    from xema_ray.mitigation.hsdp import Collective
    from xema_ray.models import ModelSpec


class SerializationConfig(BaseModel):
    """Which modules run their batch in parts, and how many."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    modules: tuple[str, ...] = Field(description="pipeline module paths (e.g. 'transformer', 'vae.decoder', a DiT block)")
    sub_batches: int = Field(ge=1, description="parts the batch is split into (capped at the batch size)")


def _batch_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The batch size: the leading dimension of the first tensor argument."""
    leaves, _ = tree_flatten((args, kwargs))
    first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.ndim > 0), None)
    return None if first is None else int(first.shape[0])


def _split(obj: Any, batch: int, bounds: list[tuple[int, int]]) -> list[Any]:
    leaves, spec = tree_flatten(obj)
    parts = []
    for a, b in bounds:
        sub = [t[a:b] if isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] == batch else t for t in leaves]
        parts.append(tree_unflatten(sub, spec))
    return parts


def _join(outputs: list[Any]) -> Any:
    """Concatenate per-part outputs along the batch dimension, keeping their structure."""
    first = outputs[0]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = {f.name: _join([getattr(o, f.name) for o in outputs]) for f in dataclasses.fields(first)}
        return type(first)(**fields)
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=0) if first.ndim > 0 else first
    if isinstance(first, tuple):
        return type(first)(_join([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, list):
        return [_join([o[i] for o in outputs]) for i in range(len(first))]
    if isinstance(first, dict):
        return {k: _join([o[k] for o in outputs]) for k in first}
    if first is None or all(o == first for o in outputs):
        return first
    raise ValueError(f"temporary_serialization: cannot rejoin outputs of type {type(first).__name__}")


class SerializationHook(ModelHook):
    """Run the module once per sub-batch and concatenate."""

    def __init__(self, sub_batches: int) -> None:
        super().__init__()
        self.sub_batches = sub_batches

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward = self.fn_ref.original_forward
        batch = _batch_of(args, kwargs)
        n = min(self.sub_batches, batch or 1)
        if batch is None or n <= 1:
            return forward(*args, **kwargs)
        step = -(-batch // n)
        bounds = [(a, min(a + step, batch)) for a in range(0, batch, step)]
        outputs = []
        for sub_args, sub_kwargs in _split((args, kwargs), batch, bounds):
            outputs.append(forward(*sub_args, **sub_kwargs))
        return _join(outputs)


def apply_serialization(pipe: Any, config: SerializationConfig) -> MitigationHandle:
    """Serialize the batch inside each of ``config.modules``.

    Args:
        pipe: the diffusers pipeline (or any object the module paths resolve against).
        config: where and into how many parts.
    """
    if not config.modules:
        raise ValueError("temporary_serialization: give at least one module path")
    handle = MitigationHandle("temporary_serialization")
    for path in config.modules:
        hook_module(handle, resolve_module(pipe, path), SerializationHook(config.sub_batches), HOOK_NAMES["serialize"])
    return handle


def apply(pipe: Any, spec: ModelSpec, config: SerializationConfig, comm: Collective | None = None) -> MitigationHandle:
    """The primitive's entry point: ``apply_serialization`` on ``pipe`` (``spec`` and ``comm`` unused)."""
    return apply_serialization(pipe, config)
