"""Building a component's module tree on the meta device: every parameter a shape, no memory.

``build_on_meta`` is the first half of loading (``xema_ray.models.loading.materialize`` is the
second: each tensor's value at its home); analysis uses the meta tree as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from xema_ray.models.base import default_dtype


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Construct modules with every parameter on the meta device (moved there as it is
    registered, before any constructor initialises it) and every buffer real on the CPU: buffers
    are small values computed by constructors (rotary frequencies, normalisation statistics)
    that no checkpoint or seed could supply. accelerate's ``init_empty_weights`` does the same."""
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


#: ``torch.nn.init`` functions constructors call on their parameters (Linear, Conv, Embedding,
#: norms): on a meta parameter they compute nothing, at ~0.1 ms a call (LTX-2's 3,267 linear
#: layers: 0.3 s of its transformer's 0.47 s build)
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_")


@contextlib.contextmanager
def no_init_on_meta() -> Iterator[None]:
    """``torch.nn.init``'s initialisers return a meta tensor as it is (it has no values to set);
    every other tensor (a buffer a constructor computes on the CPU) is initialised as usual."""
    init = nn.init
    original = {name: getattr(init, name) for name in _INIT_FUNCTIONS if hasattr(init, name)}

    def skipping(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            return tensor if isinstance(tensor, torch.Tensor) and tensor.is_meta else fn(tensor, *args, **kwargs)
        return call

    for name, fn in original.items():
        setattr(init, name, skipping(fn))
    try:
        yield
    finally:
        for name, fn in original.items():
            setattr(init, name, fn)


def build_on_meta(cls: type[Any], config: dict[str, Any], dtype: torch.dtype, real_buffers: bool = True) -> nn.Module:
    """The component's module tree with its parameters on the meta device (no memory, seconds
    for 32 B parameters) and its buffers computed on the CPU (``real_buffers``; else on meta too).

    Built outside any active dispatch mode: the tree is only shapes, not an allocation of any
    device, so an allocation tracer around a worker's load (``xema verify``) counts each weight
    once, when ``materialize`` places it."""
    from torch.utils._python_dispatch import _disable_current_modes

    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    where = parameters_on_meta() if real_buffers else torch.device("meta")
    with _disable_current_modes(), default_dtype(dtype), where, no_init_on_meta():
        model = cls.from_config(cfg)
    return model.eval().requires_grad_(False)
