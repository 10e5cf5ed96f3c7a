"""Which of a model's weights may be stored quantized, and what each weight format holds
(``docs/quality.md``, "The balanced tier").

A model's spec names the transformer layers kept in its own dtype (``QuantRule.kept``); every other
``nn.Linear`` of the transformer is stored weight-only quantized by the ``balanced`` tier
(``xema_ray.mitigation.weight_quant`` does it with torchao). The bytes here are torchao's own
layouts (0.18), counted without building them, so that the cost model and the planner can price a
format before anything is quantized; a test holds them equal to torchao's tensors:

* ``fp8``: ``float8_e4m3fn`` values (1 byte) and one fp32 scale per output channel;
* ``int8``: ``int8`` values (1 byte), one fp32 scale and one int8 zero point per output channel.

A bias stays in the model's dtype.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

if TYPE_CHECKING:
    from xema_ray.models.base import ModelSpec

#: a stored weight format other than the model's own dtype
QuantFormat = Literal["fp8", "int8"]
#: bytes per output channel beside the values: the fp32 scale (and int8's zero point)
_PER_CHANNEL = {"fp8": 4, "int8": 5}


class QuantRule(BaseModel):
    """A model's quantizable weights: the transformer's linear layers but those ``kept``.

    Example:
        >>> r = QuantRule(kept=(r"^proj_out$",), source="example")
        >>> r.quantizes("blocks.0.ff", nn.Linear(4, 4)), r.quantizes("proj_out", nn.Linear(4, 4))
        (True, False)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kept: tuple[str, ...] = Field(description="regular expressions over the transformer's module names: layers kept "
                                              "in the model's dtype (embeddings, modulation, output)")
    source: str = Field(description="where the list comes from (published practice), and what is not measured yet")

    def quantizes(self, name: str, module: nn.Module) -> bool:
        """Whether the transformer's module ``name`` is stored quantized."""
        return isinstance(module, nn.Linear) and not any(re.search(k, name) for k in self.kept)


def quantized_linear_bytes(module: nn.Linear, fmt: QuantFormat) -> int:
    """Bytes of one linear layer stored in ``fmt`` (values, per-channel scales, the bias as it is).

    Example:
        >>> quantized_linear_bytes(nn.Linear(32, 64, bias=False), "int8")
        2368
    """
    out_f, in_f = module.weight.shape
    bias = module.bias.numel() * module.bias.element_size() if module.bias is not None else 0
    return out_f * in_f + out_f * _PER_CHANNEL[fmt] + bias


def transformer_bytes(transformer: nn.Module, rule: QuantRule, fmt: QuantFormat | None) -> tuple[int, int]:
    """(bytes of the quantizable layers, bytes of the rest) of ``transformer`` (meta is enough),
    the quantizable ones stored in ``fmt`` (None: in the model's dtype)."""
    quant = rest = 0
    counted: set[int] = set()
    for name, m in transformer.named_modules():
        if rule.quantizes(name, m):
            assert isinstance(m, nn.Linear)
            counted.update(id(p) for p in m.parameters(recurse=False))
            quant += (quantized_linear_bytes(m, fmt) if fmt is not None else
                      sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)))
    for p in transformer.parameters():
        if id(p) not in counted:
            rest += p.numel() * p.element_size()
    return quant, rest


def _meta_transformer(spec: ModelSpec) -> nn.Module:
    import torch

    from xema_ray.models.build_options import BuildOptions

    return spec.build_transformer(BuildOptions(device="meta", dtype=torch.bfloat16 if spec.size == "real"
                                               else torch.float32))


@functools.cache
def quantized_savings(spec: ModelSpec, fmt: QuantFormat) -> tuple[int, int]:
    """(bytes ``fmt`` saves over the model's dtype on the whole transformer, bytes of the largest
    quantized layer's weight dequantized to the model's dtype: the transient a matmul adds)."""
    rule = spec.weight_quant
    if rule is None:
        return 0, 0
    transformer = _meta_transformer(spec)
    stored, _ = transformer_bytes(transformer, rule, fmt)
    model, _ = transformer_bytes(transformer, rule, None)
    largest = max((m.weight.numel() * m.weight.element_size() for n, m in transformer.named_modules()
                   if rule.quantizes(n, m)), default=0)
    return model - stored, largest


@functools.cache
def block_bytes_ratio(spec: ModelSpec, fmt: QuantFormat) -> float:
    """The DiT blocks' weight bytes in ``fmt`` over their bytes in the model's dtype (a meta build of
    the transformer, once per process): what the cost model scales a block's weight reads and
    host copies by. 1.0 where the model quantizes nothing."""
    rule = spec.weight_quant
    if rule is None:
        return 1.0
    transformer = _meta_transformer(spec)
    stored = model = 0
    for _, block in spec.dit_blocks(transformer):
        q, rest = transformer_bytes(block, QuantRule(kept=(), source=rule.source), fmt)
        q0, _ = transformer_bytes(block, QuantRule(kept=(), source=rule.source), None)
        stored, model = stored + q + rest, model + q0 + rest
    return stored / model if model else 1.0
