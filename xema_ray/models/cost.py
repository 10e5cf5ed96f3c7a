"""What a spec answers the cost model with: one DiT block's work (``ModelSpec.block_work``).

Kept free of torch so that the cost model, which reads it, stays cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass

#: bytes per element of the weights and activations the cost model prices (bf16)
BYTES = 2


@dataclass(frozen=True)
class BlockCost:
    """One DiT block's work for one transformer pass of the whole batch."""

    name: str
    linear_flops: float
    attention_flops: float
    weight_bytes: float
    #: tokens whose activations cross the SP group per attention (q/k/v/out all-to-alls)
    attention_tokens: list[tuple[float, int]]  # (tokens of the attended sequence, hidden size)
