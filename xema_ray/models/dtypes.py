"""The dtypes of a model group's components: the group's compute dtype, components a deployment keeps
in their stored dtype (CogVideoX-5b's fp32 VAE), the log line of a cast on load, and the input casts
a mixed-dtype pipeline needs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

if TYPE_CHECKING:
    from xema_ray.models.base import ModelSpec

logger = logging.getLogger("xema_ray.models.base")


#: the dtypes a deployment may name (YAML ``dtype`` / ``component_dtypes``)
DTypeName = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtypes(spec: ModelSpec, dtype: str | None = None, components: dict[str, str] | None = None
                 ) -> tuple[torch.dtype, tuple[tuple[str, torch.dtype], ...]]:
    """The dtype a model group computes in and its components kept in another one, resolved from a
    deployment's names: ``dtype`` None = bfloat16 for real models, float32 for tiny ones.

    Raises:
        ValueError: a component the model does not have, or the transformer (it is the group's
            ``dtype``: its inputs are made in it).

    Example:
        >>> from xema_ray.models import get_model_spec
        >>> model_dtypes(get_model_spec("cogvideox-5b"), None, {"vae": "float32"})
        (torch.bfloat16, (('vae', torch.float32),))
    """
    base = DTYPES[dtype] if dtype else (torch.bfloat16 if spec.size == "real" else torch.float32)
    kept = []
    for name, d in sorted((components or {}).items()):
        allowed = [c for c in spec.component_names() if c != "transformer"]
        if name not in allowed:
            raise ValueError(f"component_dtypes: {spec.name} has no component {name!r} to keep in another dtype "
                             f"(allowed: {', '.join(allowed)}; the transformer runs in the group's dtype)")
        if DTYPES[d] != base:
            kept.append((name, DTYPES[d]))
    return base, tuple(kept)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def log_cast(model: str, component: str, stored: torch.dtype | None, dtype: torch.dtype) -> None:
    """One log line per component a checkpoint stores in another dtype than it is loaded in: cast on
    load, as diffusers' ``from_pretrained(torch_dtype=...)`` does. Keeping it as stored is the
    deployment's choice (``component_dtypes``), which the plans are then traced with."""
    if stored is None or stored == dtype:
        return
    keep = ("set the group's dtype to compute in it" if component == "transformer"
            else f"keep it with component_dtypes: {{{component}: {_dtype_name(stored)}}}")
    logger.info("%s %s: stored as %s, cast to %s on load (%s)", model, component, _dtype_name(stored),
                _dtype_name(dtype), keep)


def cast_inputs_to_own_dtype(component: nn.Module) -> None:
    """Let a component of a pipeline whose components differ in dtype (an fp32 VAE beside a bf16
    transformer) take its inputs in another dtype: the component and its direct children cast
    floating tensor arguments to the component's dtype as they are called (forward pre-hooks, so
    ``vae.decode`` -> ``vae.decoder(z)`` is covered), as diffusers pipelines that call
    ``latents.to(vae.dtype)`` do themselves (CogVideoX's does not). The cast copy is a real
    allocation: the analyzer's trace counts it as the worker makes it."""
    own = next((p.dtype for p in component.parameters() if p.is_floating_point()), None)
    if own is None:
        return

    def cast(x: Any) -> Any:
        return x.to(own) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != own else x

    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    for module in (component, *component.children()):
        module.register_forward_pre_hook(hook, with_kwargs=True)
