"""What an adapter pool costs: device bytes (the stacks, fixed at load), one adapter's bytes, the
transient gathers per layer, and the extra FLOPs of the per-sample deltas (the cost model's
figure for real models; shapes only, from a meta-built transformer).

The analyzer traces the same intermediates at a template's batch (``xema_ray.analyzer.lora``);
this module is the closed form the benchmark reports beside it, and the worst-case adapters
``xema verify`` and the trace fill a pool with.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.lora.adapter import LoraAdapter, LoraLayer, LoraUse
from xema_ray.lora.pool import AdapterPool, target_layers
from xema_ray.lora_pool import LoraPoolConfig


class LoraCost(BaseModel):
    """A pool's cost on one model (bytes in the model's dtype). A two-expert model (Wan2.2 A14B) holds
    stacks on both experts' layers; an adapter counts toward the expert(s) it adapts (one file of a
    pair: ``expert_adapter_bytes`` of its expert), and a step runs one expert's deltas."""

    model_config = ConfigDict(frozen=True)

    model: str
    rank: int
    slots: int
    stacked: int = Field(description="adapters one sample stacks (the loop over them in each layer)")
    targets: int = Field(description="linear layers carrying a delta (both experts' on a two-expert model)")
    pool_bytes: int = Field(description="the device stacks: slots x rank x sum(in + out) x dtype bytes, every expert")
    expert_pool_bytes: dict[str, int] = Field(default_factory=dict, description="the stacks per expert "
                                                                                "(transformer, transformer_2)")
    adapter_bytes: int = Field(description="one adapter at this rank on every target of every expert (a pair's "
                                           "host copy, and one slot)")
    expert_adapter_bytes: dict[str, int] = Field(default_factory=dict, description="one expert's file of a pair "
                                                                                   "at this rank")
    gather_peak_bytes: int = Field(description="the largest per-layer transient at `rows` rows: gathered A and B "
                                               "for one stacked adapter (h, [rows, tokens, rank], is extra)")
    flop_ratio: float = Field(description="extra FLOPs of the deltas over the target layers' own, per token: "
                                          "stacked x rank x (in + out) / (in x out), weighted by each layer's FLOPs "
                                          "(of the expert a step runs)")


def lora_cost(model: str, transformer: nn.Module, rank: int, slots: int, stacked: int = 1, rows: int = 1,
              dtype: torch.dtype = torch.bfloat16, transformer_2: nn.Module | None = None) -> LoraCost:
    """The closed-form cost of a pool of ``slots`` adapters at ``rank`` on ``transformer`` (meta is
    fine), and on ``transformer_2`` for a two-expert model (its low-noise expert): the pool holds
    stacks on both, as ``AdapterPool`` allocates them.

    Example:
        >>> lora_cost("flux2-dev", meta_transformer, rank=16, slots=4).pool_bytes  # doctest: +SKIP
    """
    experts = {"transformer": transformer} | ({"transformer_2": transformer_2} if transformer_2 is not None else {})
    width = torch.empty((), dtype=dtype).element_size()
    sum_io = {c: sum(m.in_features + m.out_features for m in target_layers({c: comp}).values())
              for c, comp in experts.items()}
    layers = target_layers({"transformer": transformer})  # a step runs one expert (the experts are alike in shape)
    base = sum(m.in_features * m.out_features for m in layers.values())
    extra = sum(stacked * rank * (m.in_features + m.out_features) for m in layers.values())
    gather = max((rows * rank * (m.in_features + m.out_features) * width for m in layers.values()), default=0)
    per_adapter = {c: rank * io * width for c, io in sum_io.items()}
    return LoraCost(model=model, rank=rank, slots=slots, stacked=stacked, targets=len(target_layers(experts)),
                    pool_bytes=slots * sum(per_adapter.values()),
                    expert_pool_bytes={c: slots * b for c, b in per_adapter.items()},
                    adapter_bytes=sum(per_adapter.values()), expert_adapter_bytes=per_adapter,
                    gather_peak_bytes=gather, flop_ratio=extra / base if base else 0.0)


def fill_worst_case(pool: AdapterPool, batch: int) -> list[tuple[LoraUse, ...]]:
    """Fill ``pool`` with ``slots`` adapters at its max rank on every target layer (zeros, on the
    pool's device: meta in ``xema verify``) and return per-sample uses that stack
    ``max_per_request`` of them each: the largest gathers and intermediates a batch can make."""
    cfg = pool.config
    r = cfg.max_rank
    # every factor a view of one zero: the host copies cost nothing here (the trace counts the
    # device's stacks, not the host's adapters), and the copies into the slots are what they are
    zero = torch.zeros((), device=pool.device, dtype=pool.dtype)
    for s in range(cfg.slots):
        layers = {p: LoraLayer(zero.expand(r, m.in_features), zero.expand(m.out_features, r), 1.0)
                  for p, m in pool.targets.items()}
        pool.add(LoraAdapter(name=f"worst-case-{s}", model="", layers=layers))
    k = min(cfg.max_per_request, cfg.slots)
    return [tuple(LoraUse(name=f"worst-case-{(i * k + j) % cfg.slots}") for j in range(k)) for i in range(batch)]


def pool_config_key(cfg: LoraPoolConfig | None) -> str:
    """What of a pool changes the memory a plan holds (trace and layout keys)."""
    return "" if cfg is None else f"lora{cfg.slots}x{cfg.max_rank}x{cfg.max_per_request}"
