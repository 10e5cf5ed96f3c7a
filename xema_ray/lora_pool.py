"""A model group's LoRA adapter pool as configured and planned (``adapters:`` of a group in the
serve YAML, ``PlanTable.adapter_pools``) and what a request asks of it (``LoraUse``), where an adapter comes from
(``AdapterSource``), why one is refused (``AdapterRejected``, ``AdapterPathRefused``) and what the
pool reports (``AdapterInfo``, ``PoolStats``): the schemas only, light to import (job store, API,
the Router's and Stats' processes, which run no model); the pool itself is ``xema_ray.lora``."""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: what an adapter may be called (a file stem, a URL path segment)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class LoraUse(BaseModel):
    """One adapter a request asks for, with its scale (``lora: [{"name", "scale"}]``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="a loaded adapter of the request's model (GET /v1/adapters)")
    scale: float = Field(default=1.0, ge=-8.0, le=8.0, description="multiplies the adapter's delta (1 = as trained)")

    @field_validator("scale")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"scale must be finite, got {v}")
        return v


class LoraPoolConfig(BaseModel):
    """A model group's LoRA adapters (``adapters:`` of its YAML): the folder loaded at start-up and
    the device pool's size, which the planner counts in the group's memory (``xema_ray.lora``; the plan
    table states it per group: ``PlanTable.adapter_pools``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dir: Path | None = Field(default=None, description="folder of .safetensors adapters loaded at start-up (each "
                                                      "named by its file's stem); more arrive through POST /v1/adapters")
    roots: tuple[Path, ...] | None = Field(
        default=None, description="folders POST /v1/adapters may read adapter files from (a path outside them, or a "
                                  "symlink resolving outside, is a 403); default: `dir` alone, and without `dir` none")
    slots: int = Field(default=4, ge=1, le=256, description="adapters resident on the device at once")
    max_rank: int = Field(default=64, ge=1, le=1024, description="the stacks' padded rank; a larger adapter is refused")
    max_per_request: int = Field(default=4, ge=1, le=16, description="adapters one request may stack")
    max_unknown_keys: int = Field(default=0, ge=0, description="keys naming no adapted layer an adapter file may "
                                                               "carry (skipped); one more refuses the file")

    @model_validator(mode="before")
    @classmethod
    def _default_stack(cls, data: object) -> object:
        """``max_per_request`` not given: 4, or the pool's slots where it has fewer."""
        if isinstance(data, dict) and "max_per_request" not in data and isinstance(data.get("slots"), int):
            return {**data, "max_per_request": max(1, min(4, data["slots"]))}
        return data

    def allowed_roots(self) -> tuple[Path, ...]:
        """The folders an adapter file may come from, resolved (``roots``, or ``dir``)."""
        roots = self.roots if self.roots is not None else ((self.dir,) if self.dir is not None else ())
        return tuple(Path(r).expanduser().resolve() for r in roots)

    def permits(self, path: Path | str) -> bool:
        """Whether ``path`` (symlinks resolved, existing or not) lies under one of ``allowed_roots``.

        Example:
            >>> LoraPoolConfig(roots=("/srv/adapters",)).permits("/srv/adapters/../../etc/passwd")
            False
        """
        try:
            real = Path(path).expanduser().resolve()
        except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte: nothing to permit
            return False
        return any(real == root or real.is_relative_to(root) for root in self.allowed_roots())

    @model_validator(mode="after")
    def _stack_fits_the_pool(self) -> LoraPoolConfig:
        if self.max_per_request > self.slots:  # a request's adapters are resident together for its batch
            raise ValueError(f"max_per_request ({self.max_per_request}) must be at most slots ({self.slots}): "
                             "one request's adapters are on the device together")
        return self


class AdapterSource(BaseModel):
    """Where an adapter comes from (``POST /v1/adapters``, or a file of the YAML's ``adapters:`` folder)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="what requests call it")
    model: str = Field(min_length=1, description="the served model it is for, e.g. 'tiny-flux2'")
    path: Path = Field(description="a .safetensors file (or a folder holding exactly one), readable by the workers")


class AdapterRejected(ValueError):
    """A file that cannot serve as ``adapter`` for the model (HTTP 422 naming the adapter and the key)."""

    def __init__(self, message: str, adapter: str, key: str | None = None) -> None:
        super().__init__(message, adapter, key)  # in args: crosses the worker -> group -> router boundary by pickle
        self.adapter = adapter
        self.key = key

    def __str__(self) -> str:
        return str(self.args[0])


class AdapterPathRefused(PermissionError):
    """An adapter path outside the group's ``adapters.roots`` (HTTP 403). The message is the same
    whether or not the file exists: the answer tells nothing about the server's files."""

    def __init__(self, adapter: str) -> None:
        super().__init__(adapter)  # args: (adapter,): it crosses the group -> router boundary by pickle
        self.adapter = adapter

    def __str__(self) -> str:
        return (f"adapter {self.adapter!r}: path is not under this deployment's adapter roots (adapters.roots, "
                "default adapters.dir); copy the file there")


class AdapterInfo(BaseModel):
    """One loaded adapter (``GET /v1/adapters``)."""

    model_config = ConfigDict(frozen=True)

    name: str
    model: str
    path: str = ""
    rank: int
    layers: int = Field(description="linear layers it adapts")
    bytes: int = Field(description="its factors' bytes (host copy; a device slot holds them rank-padded)")
    resident: bool = Field(description="in a device slot now")
    skipped_keys: int = Field(default=0, description="keys the stated tolerance let through unapplied")


class PoolStats(BaseModel):
    """The pool's counters (``/v1/stats``)."""

    model_config = ConfigDict(frozen=True)

    slots: int
    max_rank: int
    device_bytes: int = Field(description="the stacks' bytes on the device (fixed at load)")
    adapters: int = Field(description="adapters known (on the host)")
    resident: int
    copies: int = Field(description="adapters copied into a slot since load")
    evictions: int = Field(description="resident adapters moved out for another (least recently used)")
    bytes_copied: int
    wait_s: float = Field(description="seconds batches waited for adapter copies")
