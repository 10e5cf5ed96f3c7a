"""Activation offload: long-lived activations wait on the host between their uses.

Two kinds of long-lived activation carry memory across the parts of a request that do not
read them, and each gets a hook:

- **Conv caches of causal VAEs** (``ConvCacheOffloadHook``). CogVideoX's VAE decodes a few
  latent frames at a time; every causal convolution returns the last frames of its input as a
  cache that the *same* convolution reads on the next frame batch. Until then the caches of all
  convolutions sit on the device: at CogVideoX-5B 720p they are 24 of the 42 GB of VAE
  activations at the decode peak. The hook moves each cache to the host as it is returned and
  brings it back when that convolution runs again. Caches of convolutions with a temporal
  kernel of 1 (the spatial norms' ``conv_y``/``conv_b``, which return their whole input as a
  cache) are never read: they are dropped, not moved.
- **Arguments reused across calls** (``ReusedInputOffloadHook``), e.g. the prompt embeddings
  (CFG-concatenated) that every denoising step passes to the transformer again: after a call,
  an argument that was also an argument of the previous call (same tensor object) moves to the
  host in place, and comes back when the module is called again. They are then off the device
  during scheduler steps and the whole VAE decode.

Example:
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> spec = get_model_spec("tiny-cogvideox")
    >>> pipe = spec.build_pipeline(BuildOptions())
    >>> h = apply(pipe, spec, ActivationOffloadConfig(modules=("vae.decoder",)))
    >>> h.remove()
"""

from __future__ import annotations

import inspect
import weakref
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.utils._pytree import tree_leaves

from xema_ray.platforms import streams as _device
from xema_ray.mitigation.hooks import HOOK_NAMES, MitigationHandle, hook_module, resolve_module
from xema_ray.placement import HostCopy, OffloadedTensor

if TYPE_CHECKING:
    from xema_ray.mitigation.hsdp import Collective
    from xema_ray.models import ModelSpec


class ActivationOffloadConfig(BaseModel):
    """Where activations are offloaded and how many."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    modules: tuple[str, ...] = Field(description="pipeline module paths, e.g. 'vae.decoder' or 'transformer'")
    max_tensors: int | None = Field(
        default=None, ge=1,
        description="conv caches: offload the caches of at most this many convolutions, highest "
        "resolution (last in module order) first; reused inputs: at most this many arguments "
        "per call, largest first. None = all",
    )
    min_bytes: int = Field(default=0, ge=0, description="leave tensors smaller than this on the device")


class ConvCacheOffloadHook(ModelHook):
    """On a causal conv ``forward(x, conv_cache=None) -> (y, cache)``: cache to host after,
    back before the next call."""

    def __init__(self, stream: _device.TransferStream, min_bytes: int) -> None:
        super().__init__()
        self.stream = stream
        self.min_bytes = min_bytes

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        cache = kwargs.get("conv_cache")
        if isinstance(cache, OffloadedTensor):
            kwargs["conv_cache"] = cache.load()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], torch.Tensor):
            out, cache = output
            if getattr(module, "time_kernel_size", None) == 1:
                # a temporal kernel of 1 never reads its cache (CogVideoX's causal conv returns
                # its whole input as one anyway): drop it instead of copying it out and back
                return out, None
            if cache.numel() * cache.element_size() >= self.min_bytes:
                # at most one cache copy in flight: compute waits for the previous one (it had this
                # convolution's kernels to finish), so the allocator holds at most one freed cache
                # for the side stream instead of every cache of a frame batch
                self.stream.wait(self.stream.record(), [])
                return out, OffloadedTensor(cache, self.stream)
        return output


class ReusedInputOffloadHook(ModelHook):
    """Offload, after each call, the arguments that the previous call also received."""

    def __init__(self, stream: _device.TransferStream, max_tensors: int | None, min_bytes: int) -> None:
        super().__init__()
        self.stream = stream
        self.max_tensors = max_tensors
        self.min_bytes = min_bytes
        self.previous: list[weakref.ref] = []
        self.current: list[torch.Tensor] = []
        self.offloaded: list[tuple[weakref.ref, HostCopy]] = []

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.restore()
        self.current = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        seen = {id(r()) for r in self.previous if r() is not None}
        reused = [t for t in self.current if id(t) in seen and t.numel() * t.element_size() >= self.min_bytes]
        reused.sort(key=lambda t: -t.numel() * t.element_size())
        if self.max_tensors is not None:
            reused = reused[: self.max_tensors]
        for t in reused:
            host = HostCopy(t.data, stream=self.stream)  # device->host on the side stream
            t.data = host.placeholder()  # in place: the caller's reference now points at the host copy
            self.offloaded.append((weakref.ref(t), host))
        self.previous = [weakref.ref(t) for t in self.current]
        self.current = []
        return output

    def restore(self) -> None:
        for ref, host in self.offloaded:
            t = ref()
            if t is not None:
                t.data = host.to_device(self.stream)
        if self.offloaded:
            # the module reads its arguments right away: order compute after the copies
            self.stream.wait(self.stream.record(), [r().data for r, _ in self.offloaded if r() is not None])
        self.offloaded = []


def _is_cache_producer(module: nn.Module) -> bool:
    """A module that takes a ``conv_cache`` and has no child that does: a causal convolution."""
    def takes_cache(m: nn.Module) -> bool:
        try:
            return "conv_cache" in inspect.signature(m.forward).parameters
        except (TypeError, ValueError):
            return False

    return takes_cache(module) and not any(takes_cache(c) for c in module.modules() if c is not module)


def cache_producers(root: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in root.named_modules() if _is_cache_producer(m)]


def apply(pipe: Any, spec: ModelSpec, config: ActivationOffloadConfig, comm: Collective | None = None) -> MitigationHandle:
    """Offload conv caches under each path that has causal convolutions, reused arguments of
    each other path.

    Args:
        pipe: the diffusers pipeline.
        spec: its model (unused: the paths resolve against ``pipe``).
        config: paths and limits.
        comm: unused (the one primitive signature).
    """
    if not config.modules:
        raise ValueError("activation_offload: give at least one module path")
    handle = MitigationHandle("activation_offload")
    for path in config.modules:
        root = resolve_module(pipe, path)
        device = next((p.device for p in root.parameters()), torch.device("cpu"))
        stream = _device.TransferStream(device)
        producers = cache_producers(root)
        if producers:
            chosen = producers[::-1][: config.max_tensors] if config.max_tensors else producers
            for _, m in chosen:
                hook_module(handle, m, ConvCacheOffloadHook(stream, config.min_bytes), HOOK_NAMES["conv_cache_offload"])
        else:
            hook = ReusedInputOffloadHook(stream, config.max_tensors, config.min_bytes)
            hook_module(handle, root, hook, HOOK_NAMES["input_offload"])
            handle.add_undo(hook.restore)
    return handle
