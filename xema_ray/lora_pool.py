"""A model group's LoRA adapter pool as configured and planned (``adapters:`` of a group in the
serve YAML, ``PlanTable.adapter_pools``) and what a request asks of it (``LoraUse``), where an adapter comes from
(``AdapterSource``), why one is refused (``AdapterRejected``, ``AdapterPathRefused``) and what the
pool reports (``AdapterInfo``, ``PoolStats``): the schemas only, light to import (job store, API,
the Router's and Stats' processes, which run no model); the pool itself is ``xema_ray.lora``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

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


#: an ``experts`` key -> the pipeline component (expert) its file adapts, whatever the file's key prefix
#: (diffusers: a plain load adapts ``transformer``, ``load_into_transformer_2=True`` adapts ``transformer_2``)
EXPERT_COMPONENTS = {"high_noise": "transformer", "low_noise": "transformer_2"}


def _optional_not_null(schema: dict[str, Any], required: list[str] | None = None, min_properties: int = 0) -> None:
    """The JSON schema of a model whose optional fields are left out, never null (``_not_null``):
    each ``anyOf [X, null]`` property becomes ``X``; ``required``: one of these fields must be
    given; ``min_properties``: at least that many fields must be."""
    for prop in schema.get("properties", {}).values():
        branches = prop.get("anyOf")
        if branches is not None and {"type": "null"} in branches:
            kept = [b for b in branches if b != {"type": "null"}]
            if len(kept) == 1:
                prop.pop("anyOf")
                prop.update(kept[0])
            prop.pop("default", None)
    if required:
        schema["oneOf"] = [{"required": [f]} for f in required]
    if min_properties:
        schema["minProperties"] = min_properties


def _not_null(v: object, info: ValidationInfo) -> object:
    """An optional file field given as null is refused (leave it out instead): the document says so."""
    if v is None:
        raise ValueError(f"{info.field_name} may be left out, not null")
    return v


class ExpertFiles(BaseModel):
    """A two-expert model's LoRA pair (Wan2.2 A14B): one file per expert, either may be omitted."""

    model_config = ConfigDict(frozen=True, extra="forbid",
                              json_schema_extra=lambda s, _: _optional_not_null(s, min_properties=1))

    high_noise: Path | None = Field(
        default=None, description="the high-noise expert's file (transformer; the file of a pair diffusers loads "
                                  "plainly)")
    low_noise: Path | None = Field(
        default=None, description="the low-noise expert's file (transformer_2; the file diffusers loads with "
                                  "load_into_transformer_2=True)")

    _no_null = field_validator("high_noise", "low_noise", mode="before")(_not_null)

    def files(self) -> dict[str, Path]:
        """``experts`` key -> file, for the keys given."""
        return {k: p for k in EXPERT_COMPONENTS if (p := getattr(self, k)) is not None}


class AdapterSource(BaseModel):
    """Where an adapter comes from (``POST /v1/adapters``, or a file of the YAML's ``adapters:`` folder):
    one file (``path``), or a two-expert model's pair (``experts``)."""

    model_config = ConfigDict(frozen=True, extra="forbid",
                              json_schema_extra=lambda s, _: _optional_not_null(s, ["path", "experts"]))

    name: str = Field(pattern=NAME_PATTERN, description="what requests call it")
    model: str = Field(min_length=1, description="the served model it is for, e.g. 'tiny-flux2'")
    path: Path | None = Field(
        default=None, description="a .safetensors file (or a folder holding exactly one), readable by the workers; on "
                                  "a two-expert model it adapts the high-noise expert, or both when it holds "
                                  "transformer. and transformer_2. keys (one of path and experts)")
    experts: ExpertFiles | None = Field(
        default=None, description="a two-expert model's LoRA pair (Wan2.2 A14B), one file per expert (one of path and "
                                  "experts): the slot decides the expert whatever the file's key prefix")

    _no_null = field_validator("path", "experts", mode="before")(_not_null)

    @field_validator("experts")
    @classmethod
    def _not_with_path(cls, v: ExpertFiles | None, info: ValidationInfo) -> ExpertFiles | None:
        if v is not None and info.data.get("path") is not None:
            raise ValueError("give path (one file) or experts (one file per expert), not both")
        if v is not None and not v.files():
            raise ValueError("name a file for high_noise, low_noise or both")
        return v

    @model_validator(mode="after")
    def _a_file(self) -> AdapterSource:
        if self.path is None and self.experts is None:
            raise ValueError("path (one file) or experts (one file per expert) is required")
        return self

    def files(self) -> list[tuple[str | None, Path]]:
        """The files to read: ``(None, path)``, or ``(experts key, file)`` per expert given."""
        if self.experts is not None:
            return list(self.experts.files().items())
        assert self.path is not None  # one of the two (validated)
        return [(None, self.path)]

    def paths(self) -> dict[str, Path]:
        """Every file it names, by its field (``path``, ``experts.<key>``): each must lie under the
        group's adapter roots."""
        return {"path" if k is None else f"experts.{k}": p for k, p in self.files()}


class AdapterRejected(ValueError):
    """A file that cannot serve as ``adapter`` for the model (HTTP 422 naming the adapter and the key,
    or the request's field ``param`` where one is at fault, e.g. ``experts``)."""

    def __init__(self, message: str, adapter: str, key: str | None = None, param: str | None = None) -> None:
        # in args: it crosses the worker -> group -> router boundary by pickle
        super().__init__(message, adapter, key, param)
        self.adapter = adapter
        self.key = key
        self.param = param

    def __str__(self) -> str:
        return str(self.args[0])


class AdapterPathRefused(PermissionError):
    """An adapter path outside the group's ``adapters.roots`` (HTTP 403). The message is the same
    whether or not the file exists: the answer tells nothing about the server's files."""

    def __init__(self, adapter: str, param: str = "path") -> None:
        super().__init__(adapter, param)  # args: it crosses the group -> router boundary by pickle
        self.adapter = adapter
        self.param = param  # the field naming the file: path, or experts.<key>

    def __str__(self) -> str:
        return (f"adapter {self.adapter!r}: {self.param} is not under this deployment's adapter roots (adapters.roots, "
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
    experts: dict[str, str] = Field(default_factory=dict, description="a LoRA pair's files per expert (high_noise, "
                                                                      "low_noise), registered through `experts`")
    expert_layers: dict[str, int] = Field(default_factory=dict, description="layers it adapts per adapted component "
                                                                            "(transformer, transformer_2)")


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
