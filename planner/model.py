"""What the planner needs to know about a candidate, as one small interface.

The four stages (``planner.stages``) are written against ``PlannerModel`` only, so they are
tested on synthetic models with known answers, and run on real ones (``planner.trace_model``:
analyzer traces + static layout + mitigation effects + profiler / cost model) unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from xema_ray.memory.analysis import PressureInterval
from xema_ray.plan import ExecutionConfig, Mitigation


@dataclass(frozen=True)
class MemoryView:
    """Predicted per-GPU reserved memory of one configuration against a budget."""

    peak_bytes: int
    intervals: tuple[PressureInterval, ...] = ()

    @property
    def fits(self) -> bool:
        return not self.intervals


@dataclass(frozen=True)
class MitigationOption:
    """One way to relieve a pressure interval: a set of mitigation actions, applied together.

    ``zero_overhead`` marks choices known not to add latency (offload whose transfer hides
    behind compute, chunking that keeps operator throughput): stage 3 tries those first.

    ``family`` groups options that differ only in intensity (default: their kinds and
    locations). Within a family, listed mildest first, memory must not rise and latency must not
    fall with intensity: stage 3 then profiles only a family's mildest option that clears.
    """

    actions: tuple[Mitigation, ...]
    zero_overhead: bool = False
    label: str = ""
    family: str = ""

    @property
    def family_key(self) -> str:
        return self.family or "+".join(f"{a.kind}@{','.join(a.modules or ())}@{a.blocks if a.kind == 'dit_chunking' else ''}"
                                       for a in self.actions)


@dataclass(frozen=True)
class Rejection:
    """Why a traced confirmation rejected a configuration (``PlannerModel.confirm``).

    ``overshoot_bytes`` > 0: the configuration runs but peaks that far above the budget, so the
    same base configuration with stronger mitigation may still fit; 0: it cannot run at all."""

    reason: str
    overshoot_bytes: int = 0


@dataclass
class CostCounter:
    """How much work planning did: distinct configurations whose latency was profiled/estimated
    and whose memory was analysed."""

    profiled: set[str] = field(default_factory=set)
    analysed: set[str] = field(default_factory=set)


class PlannerModel(Protocol):
    """Memory and latency of candidates for one template on one hardware configuration."""

    def memory(self, config: ExecutionConfig, budget: int) -> MemoryView:
        """Per-GPU reserved memory of ``config`` and its pressure intervals above ``budget``."""
        ...

    def latency(self, config: ExecutionConfig) -> float:
        """End-to-end latency (s) of one batch under ``config`` (profiled or estimated)."""
        ...

    def options(self, config: ExecutionConfig, interval: PressureInterval) -> list[MitigationOption]:
        """Mitigation choices applicable to the operators inside ``interval``, at every intensity
        worth trying, mildest first."""
        ...

    def full_mitigation(self, config: ExecutionConfig) -> tuple[Mitigation, ...]:
        """Every applicable mitigation at full intensity (stage 1's memory rule)."""
        ...


class RefiningModel(PlannerModel, Protocol):
    """A model whose option ladders are coarser than its primitives (optional)."""

    def milder(self, config: ExecutionConfig, action: Mitigation) -> list[Mitigation]:
        """Variants of ``action`` (same family) at the intensities between the option ladder's
        rung below it and its own, strongest first: stage 3 takes the mildest that still clears
        the interval ("only as much as needed")."""
        ...
