"""A model group's LoRA adapter pool as configured and planned (``adapters:`` of a group in the
serve YAML, ``PlanTable.adapter_pools``): the schema only; the pool itself is ``xema_ray.lora``."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class LoraPoolConfig(BaseModel):
    """A model group's LoRA adapters (``adapters:`` of its YAML): the folder loaded at start-up and
    the device pool's size, which the planner counts in the group's memory (``xema_ray.lora``; the plan
    table states it per group: ``PlanTable.adapter_pools``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dir: Path | None = Field(default=None, description="folder of .safetensors adapters loaded at start-up (each "
                                                      "named by its file's stem); more arrive through POST /v1/adapters")
    slots: int = Field(default=4, ge=1, le=256, description="adapters resident on the device at once")
    max_rank: int = Field(default=64, ge=1, le=1024, description="the stacks' padded rank; a larger adapter is refused")
    max_per_request: int = Field(default=4, ge=1, le=16, description="adapters one request may stack")
    max_unknown_keys: int = Field(default=0, ge=0, description="keys naming no adapted layer an adapter file may "
                                                               "carry (skipped); one more refuses the file")
