"""The cost model's figure for per-sample LoRA: seconds the deltas add to one denoising step.

Roofline per adapted linear layer and stacked adapter, as the cost model treats every kernel:
``max(flops / (peak x matmul_efficiency), bytes / bandwidth)`` with

- flops: ``2 x rows x tokens x rank x (in + out)`` (``x A^T`` then ``h B^T``);
- bytes: the input read again, the output read and written (``baddbmm_`` into it), the gathered
  factors written and read (``rows x rank x (in + out)``), ``h`` written and read.

``tokens`` is the whole sequence of the template for every layer (an upper bound: Flux.2's double
blocks run their image and text linears on their own part of it). The deltas are skinny matmuls,
so most layers come out bandwidth-bound: the figure is mostly the extra passes over activations.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.lora.pool import target_layers
from xema_ray.profiling.hardware import HardwareProfile


class LoraStepCost(BaseModel):
    """Per-sample LoRA's cost in one denoising step of a template."""

    model_config = ConfigDict(frozen=True)

    rank: int
    stacked: int
    rows: int = Field(description="DiT rows: batch x the CFG multiplier")
    tokens: int
    layers: int
    seconds: float = Field(description="the deltas' seconds per step on the hardware (roofline)")
    flops: float
    bytes: float
    bandwidth_bound: int = Field(description="layers whose delta is bound by memory bandwidth")


def lora_step_cost(transformer: nn.Module, hw: HardwareProfile, rows: int, tokens: int, rank: int, stacked: int = 1,
                   width: int = 2) -> LoraStepCost:
    """Seconds per denoising step the per-sample deltas add on ``hw`` (see the module docstring).

    Args:
        transformer: the DiT (meta-built is enough: shapes only).
        hw: the hardware profile.
        rows: DiT batch rows (requests x CFG multiplier).
        tokens: sequence length per row.
        rank: the pool's padded rank.
        stacked: adapters per sample.
        width: bytes per element (bf16: 2).
    """
    flops_rate = hw.bf16_tflops * 1e12 * hw.matmul_efficiency
    bw = hw.mem_gbps * 1e9
    total_s = total_f = total_b = 0.0
    bound = 0
    layers = target_layers({"transformer": transformer})
    for m in layers.values():
        i, o = m.in_features, m.out_features
        f = 2.0 * rows * tokens * rank * (i + o) * stacked
        b = stacked * width * (rows * tokens * (i + 2 * o + 2 * rank) + 2 * rows * rank * (i + o))
        t_f, t_b = f / flops_rate, b / bw
        bound += t_b > t_f
        total_s += max(t_f, t_b)
        total_f += f
        total_b += b
    return LoraStepCost(rank=rank, stacked=stacked, rows=rows, tokens=tokens, layers=len(layers), seconds=total_s,
                        flops=total_f, bytes=total_b, bandwidth_bound=bound)
