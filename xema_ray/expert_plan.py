"""The schema of a two-expert model's expert switch in a plan (``ExecutionConfig.experts``).

Its own module beside ``xema_ray.plan`` (which re-exports it), as the planner writes it and the
worker executes it (``xema_ray.mitigation.expert_swap``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ExpertSwap(BaseModel):
    """How a worker holds a two-expert model's experts (Wan2.2-A14B), as ``planner.expert_switch``
    chose: both on the device, one at a time with the other prefetched before the switch, or K
    blocks of each streamed (``xema_ray.mitigation.expert_swap`` says what each does).

    Example:
        >>> ExpertSwap(strategy="swap_prefetched", prefetch_blocks=13, prefetch_steps=1, decode_blocks=40).describe()
        'expert_swap(prefetch 13 blocks over 1 step(s), 40 back under the decode)'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Literal["hold_both", "swap_prefetched", "split_blocks"]
    prefetch_blocks: int = Field(default=0, ge=0, description="swap: low-noise blocks copied before the switch")
    prefetch_steps: int = Field(default=0, ge=0, description="swap: the last high-noise steps the prefetch starts in")
    decode_blocks: int = Field(default=0, ge=0, description="swap: high-noise blocks that return under the VAE decode")
    host_blocks: int = Field(default=0, ge=0, description="split_blocks: blocks of each expert homed on the host")

    @model_validator(mode="after")
    def _check(self) -> ExpertSwap:
        unused = [f for f in ("prefetch_blocks", "prefetch_steps", "decode_blocks", "host_blocks") if getattr(self, f)
                  and (self.strategy == "hold_both" or (f == "host_blocks") != (self.strategy == "split_blocks"))]
        if unused or (self.strategy == "split_blocks" and self.host_blocks < 1):
            raise ValueError(f"expert_swap {self.strategy}: {unused or 'host_blocks >= 1'} (fields of another strategy)")
        return self

    def describe(self) -> str:
        if self.strategy == "swap_prefetched":
            return (f"expert_swap(prefetch {self.prefetch_blocks} blocks over {self.prefetch_steps} step(s), "
                    f"{self.decode_blocks} back under the decode)")
        return f"expert_split({self.host_blocks} blocks of each on the host)" if self.host_blocks else "experts_held"
