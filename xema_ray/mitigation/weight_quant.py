"""Quantized weights: the ``balanced`` quality tier's primitive (``docs/quality.md``).

The transformer's quantizable linear layers (its spec's ``weight_quant``: every ``nn.Linear`` but
the layers it keeps in the model's dtype) are stored weight-only with torchao (0.18):
``Float8WeightOnlyConfig`` (``fp8``: e4m3 values, a scale per output channel) or
``Int8WeightOnlyConfig`` (``int8``: values, a scale and a zero point per output channel). A
quantized layer dequantizes its weight in the matmul: the activations and the arithmetic stay in
the model's dtype (on a GPU without fp8 compute, such as the A6000, fp8 is storage only).

A worker quantizes at load (``quantize_transformer``, in place) when every plan it runs is
quantized; a worker whose group serves both lossless and ``balanced`` keeps a quantized copy
beside its own transformer (``quantized_copy``) and swaps it in for a ``balanced`` batch
(``apply``: the usual ``Config`` + ``apply(pipe, spec, config, comm)``, its handle swapping back).
Quantization on the meta device is shape-only and exact in bytes: ``xema analyze --weights`` and
``xema verify`` count torchao's own tensors.

Example:
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> spec = get_model_spec("tiny-flux2")
    >>> pipe = spec.build_pipeline(BuildOptions())
    >>> lossless = pipe.transformer
    >>> config = WeightQuantConfig(format="int8")
    >>> with apply(pipe, spec, config, copy=quantized_copy(pipe.transformer, spec, config)):
    ...     blocks = pipe.transformer.transformer_blocks
    ...     round(stored_bytes(blocks) / stored_bytes(lossless.transformer_blocks), 2)
    0.28
    >>> pipe.transformer is lossless
    True
"""

from __future__ import annotations

import copy as copying
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.mitigation.hooks import MitigationHandle
from xema_ray.models.weight_formats import QuantFormat

if TYPE_CHECKING:
    from xema_ray.mitigation.hsdp import Collective
    from xema_ray.models import ModelSpec


class WeightQuantConfig(BaseModel):
    """The weight format of a quantized tier."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: QuantFormat = Field(description="fp8 (e4m3, per-channel scales) or int8 (per-channel scales, zero points)")


def _torchao_config(fmt: QuantFormat) -> Any:
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return Float8WeightOnlyConfig() if fmt == "fp8" else Int8WeightOnlyConfig()


def quantize_transformer(transformer: nn.Module, spec: ModelSpec, config: WeightQuantConfig) -> nn.Module:
    """``transformer`` with its quantizable layers stored in ``config.format``, in place (returned).

    Raises:
        ValueError: the model's spec names no quantizable weights.
    """
    rule = spec.weight_quant
    if rule is None:
        raise ValueError(f"{spec.name}: its spec names no quantizable weights (weight_quant); it runs in its dtype only")
    from torchao.quantization import quantize_

    with torch.no_grad():
        quantize_(transformer, _torchao_config(config.format), filter_fn=lambda m, fqn: rule.quantizes(fqn, m))
    return transformer


def quantized_copy(transformer: nn.Module, spec: ModelSpec, config: WeightQuantConfig) -> nn.Module:
    """A quantized copy of ``transformer`` (the original untouched), on the same device."""
    return quantize_transformer(copying.deepcopy(transformer), spec, config)


def tensor_leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes: itself, or a tensor subclass's inner tensors
    (torchao's quantized weights: values, scales, zero points)."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [leaf for n in names for leaf in tensor_leaves(getattr(t, n))]


def stored_bytes(module: nn.Module) -> int:
    """Bytes ``module``'s parameters and buffers hold, quantized ones as stored."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(x.numel() * x.element_size() for t in tensors for x in tensor_leaves(t))


def apply(pipe: Any, spec: ModelSpec, config: WeightQuantConfig, comm: Collective | None = None,
          copy: nn.Module | None = None) -> MitigationHandle:
    """``pipe.transformer`` in ``config.format`` until the handle is removed: ``copy`` (a
    ``quantized_copy`` the worker keeps) swapped in and back out; without a copy the pipeline's own
    transformer is quantized in place (the handle's removal leaves it so). ``comm`` is unused."""
    handle = MitigationHandle("weight_quant")
    if copy is None:
        quantize_transformer(pipe.transformer, spec, config)
        return handle
    own = pipe.transformer
    pipe.transformer = copy

    def back() -> None:
        pipe.transformer = own

    handle.add_undo(back)
    return handle
