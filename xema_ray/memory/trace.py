"""The memory trace: every device allocation of one request, in event order.

A trace is columnar (numpy arrays, one row per allocation) because a 50-step CogVideoX request
has ~10^5 allocations and every consumer (analysis, layout solver, planner) works on whole
columns. Time is the *event index*: each allocation and each free is one event, numbered from 0
in the order the allocator sees them. Allocation ``i`` is live over ``[begin[i], end[i])``;
``end[i] == n_events`` means it is never freed inside the request (weights, outputs).

On disk a trace is JSON (``MemoryTraceFile``, schema-versioned), never pickle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.vocabulary import read_stored_phase

TRACE_SCHEMA_VERSION = 1


class Category(IntEnum):
    """What an allocation holds. Stored as int8 in the trace."""

    WEIGHT = 0  # parameters and buffers, resident for the whole request
    INPUT = 1  # request inputs created before the pipeline runs (prompt embeddings)
    ACTIVATION = 2  # everything the pipeline allocates while running


@dataclass
class MemoryTrace:
    """Allocations of one request template (or one traced region) in event order.

    Attributes:
        size: bytes reserved per allocation, rounded up to 512 as the CUDA caching allocator
            rounds requests (int64).
        nbytes: bytes the tensor asked for before rounding (int64).
        begin: event index of the allocation (int64).
        end: event index of the free, or ``n_events`` if never freed (int64).
        category: ``Category`` per allocation (int8).
        module: index into ``modules`` of the innermost module that made it (int32, -1 = none).
        phase: index into ``phases`` (int32).
        op: index into ``ops`` of the aten op that produced it (int32, -1 = none).
        free_module: index into ``modules`` of the module running when it was freed (int32, -1 =
            none or never freed); with ``module`` this places every event in a module.
        n_events: total number of events (allocations + frees).
        modules, phases, ops: string tables.
        step_bounds: event index of each denoising step's scheduler entry (the step boundaries).
        loaded_bytes: device bytes the serving worker placed before the request (its weights),
            for a worker's request stream (``xema_ray.measure.verify.worker_trace``); else 0.
        mitigations: the mitigations the trace was taken under, each an ``xema_ray.plan.Mitigation``
            as JSON (this layer does not know that type).
        meta: provenance for display only (template, device, tracer version, replay counts):
            nothing reads a figure back from it.
    """

    size: np.ndarray
    nbytes: np.ndarray
    begin: np.ndarray
    end: np.ndarray
    category: np.ndarray
    module: np.ndarray
    phase: np.ndarray
    op: np.ndarray
    free_module: np.ndarray
    n_events: int
    modules: list[str] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    step_bounds: list[int] = field(default_factory=list)
    loaded_bytes: int = 0
    mitigations: list[str] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.size)
        for name in ("nbytes", "begin", "end", "category", "module", "phase", "op", "free_module"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trace column {name!r} has {len(getattr(self, name))} rows, size has {n}")

    def __len__(self) -> int:
        return len(self.size)

    # ------------------------------------------------------------------ derived views
    def event_deltas(self) -> np.ndarray:
        """Signed byte change per event index (length ``n_events``)."""
        delta = np.zeros(self.n_events + 1, dtype=np.int64)
        np.add.at(delta, self.begin, self.size)
        np.add.at(delta, self.end, -self.size)
        return delta[: self.n_events]

    def active_curve(self) -> np.ndarray:
        """Live bytes after each event (length ``n_events``): the active-memory trace."""
        return np.cumsum(self.event_deltas())

    def peak(self) -> int:
        """Maximum live bytes at any event: the lower bound for any allocator."""
        if self.n_events == 0:
            return 0
        return int(self.active_curve().max())

    def resident_bytes(self) -> int:
        """Bytes of weights (category WEIGHT)."""
        return int(self.size[self.category == Category.WEIGHT].sum())

    def subset(self, mask: np.ndarray) -> MemoryTrace:
        """Rows where ``mask`` holds, with event times kept (not renumbered)."""
        return MemoryTrace(
            size=self.size[mask],
            nbytes=self.nbytes[mask],
            begin=self.begin[mask],
            end=self.end[mask],
            category=self.category[mask],
            module=self.module[mask],
            phase=self.phase[mask],
            op=self.op[mask],
            free_module=self.free_module[mask],
            n_events=self.n_events,
            modules=self.modules,
            phases=self.phases,
            ops=self.ops,
            step_bounds=list(self.step_bounds),
            loaded_bytes=self.loaded_bytes,
            mitigations=list(self.mitigations),
            meta=dict(self.meta),
        )

    def signature(self) -> list[tuple[int, int, str, str]]:
        """(begin, size, module, op) per allocation in event order; for equality tests."""
        order = np.argsort(self.begin, kind="stable")
        return [
            (
                int(self.begin[i]),
                int(self.size[i]),
                self.modules[self.module[i]] if self.module[i] >= 0 else "",
                self.ops[self.op[i]] if self.op[i] >= 0 else "",
            )
            for i in order
        ]

    # ------------------------------------------------------------------ JSON
    def to_file(self) -> MemoryTraceFile:
        return MemoryTraceFile(
            schema_version=TRACE_SCHEMA_VERSION,
            n_events=self.n_events,
            size=self.size.tolist(),
            nbytes=self.nbytes.tolist(),
            begin=self.begin.tolist(),
            end=self.end.tolist(),
            category=self.category.tolist(),
            module=self.module.tolist(),
            phase=self.phase.tolist(),
            op=self.op.tolist(),
            free_module=self.free_module.tolist(),
            modules=self.modules,
            phases=self.phases,
            ops=self.ops,
            step_bounds=self.step_bounds,
            loaded_bytes=self.loaded_bytes,
            mitigations=self.mitigations,
            meta=self.meta,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_file().model_dump_json())

    @classmethod
    def load(cls, path: str | Path) -> MemoryTrace:
        return cls.from_file(MemoryTraceFile.model_validate(json.loads(Path(path).read_text())))

    @classmethod
    def from_file(cls, f: MemoryTraceFile) -> MemoryTrace:
        if f.schema_version != TRACE_SCHEMA_VERSION:
            raise ValueError(
                f"trace schema version {f.schema_version} is not supported (this build reads {TRACE_SCHEMA_VERSION})"
            )
        return cls(
            size=np.asarray(f.size, dtype=np.int64),
            nbytes=np.asarray(f.nbytes, dtype=np.int64),
            begin=np.asarray(f.begin, dtype=np.int64),
            end=np.asarray(f.end, dtype=np.int64),
            category=np.asarray(f.category, dtype=np.int8),
            module=np.asarray(f.module, dtype=np.int32),
            phase=np.asarray(f.phase, dtype=np.int32),
            op=np.asarray(f.op, dtype=np.int32),
            free_module=np.asarray(f.free_module, dtype=np.int32),
            n_events=f.n_events,
            modules=list(f.modules),
            phases=[read_stored_phase(p) for p in f.phases],  # a cached trace of an earlier version says "setup"
            ops=list(f.ops),
            step_bounds=list(f.step_bounds),
            loaded_bytes=f.loaded_bytes,
            mitigations=list(f.mitigations),
            meta=dict(f.meta),
        )


class MemoryTraceFile(BaseModel):
    """JSON form of a ``MemoryTrace`` (columns as lists)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = Field(description="TRACE_SCHEMA_VERSION of the writer")
    n_events: int = Field(ge=0)
    size: list[int]
    nbytes: list[int]
    begin: list[int]
    end: list[int]
    category: list[int]
    module: list[int]
    phase: list[int]
    op: list[int]
    free_module: list[int]
    modules: list[str]
    phases: list[str]
    ops: list[str]
    step_bounds: list[int] = Field(default_factory=list, description="event index of each step boundary")
    loaded_bytes: int = Field(default=0, ge=0, description="device bytes placed before the request (a worker's stream)")
    mitigations: list[str] = Field(default_factory=list, description="each an xema_ray.plan.Mitigation as JSON")
    meta: dict[str, str] = Field(default_factory=dict, description="provenance, for display only")
