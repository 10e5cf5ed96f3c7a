"""A model group's bookkeeping of step-level preemption: which batches the dispatcher paused,
whether their workers have parked them yet, the resume signal, and the counts ``/v1/stats`` and
the metrics report (the decisions themselves are the shared ``Dispatcher``'s)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field


class TemplatePreemption(BaseModel):
    preemptions: int = Field(default=0, description="batches of this template paused for another")
    paused_now: int = Field(default=0, description="batches paused at this moment")
    paused_bytes: int = Field(default=0, description="between-step state the paused batches hold now")
    offloaded: int = Field(default=0, description="pauses whose state moved to host memory")
    paused_s: float = Field(default=0.0, description="seconds spent paused, summed over batches")


class DecisionRecord(BaseModel):
    kind: str = Field(description="preempt or resume")
    template: str = Field(description="the paused (or resumed) batch's template")
    requests: list[str]
    by: list[str] = Field(default_factory=list, description="the preempting batch's requests")
    offload: bool = False


#: decisions ``/v1/stats`` lists (the latest ones)
RECENT_DECISIONS = 50


class PreemptionReport(BaseModel):
    enabled: bool
    per_template: dict[str, TemplatePreemption]
    decisions: int = Field(description="preemptions the dispatcher decided (each is resumed in turn)")
    recent: list[DecisionRecord] = Field(default_factory=list, description="the latest decisions, oldest first")


@dataclass
class PreemptionState:
    """Per batch id: pause wanted (and how), parked, resumed. Runs on the group's event loop."""

    _want: dict[int, bool] = field(default_factory=dict)  # batch -> offload
    _parked: dict[int, asyncio.Event] = field(default_factory=dict)
    _resume: dict[int, asyncio.Event] = field(default_factory=dict)
    _holding: dict[int, tuple[str, int]] = field(default_factory=dict)  # paused batch -> (template, bytes)
    #: batch id -> the run id of its sub-batch on the workers now
    current_run: dict[int, str] = field(default_factory=dict)
    stats: dict[str, TemplatePreemption] = field(default_factory=dict)

    def _event(self, table: dict[int, asyncio.Event], bid: int) -> asyncio.Event:
        return table.setdefault(bid, asyncio.Event())

    def want(self, bid: int, offload: bool) -> None:
        self._want[bid] = offload
        self._event(self._parked, bid).clear()
        self._event(self._resume, bid).clear()

    def wanted(self, bid: int) -> bool:
        return bid in self._want

    def parked(self, bid: int, template: str, state_bytes: int, offloaded: bool) -> None:
        st = self.stats.setdefault(template, TemplatePreemption())
        st.preemptions += 1
        st.offloaded += int(offloaded)
        self._holding[bid] = (template, state_bytes)
        self._event(self._parked, bid).set()

    async def wait_parked(self, bid: int) -> None:
        """Until ``bid`` parked (or ended: then no pause is pending for it any more)."""
        if bid not in self._want:
            return
        await self._event(self._parked, bid).wait()

    def resume(self, bid: int) -> None:
        self._want.pop(bid, None)
        self._event(self._resume, bid).set()

    async def wait_resume(self, bid: int) -> None:
        await self._event(self._resume, bid).wait()

    def resumed(self, bid: int, template: str, paused_s: float) -> None:
        self._holding.pop(bid, None)
        self.stats.setdefault(template, TemplatePreemption()).paused_s += paused_s

    def finished(self, bid: int) -> None:
        """The batch ended (done, failed, or finished before it could park): nobody waits on it."""
        self._event(self._parked, bid).set()
        for table in (self._want, self._parked, self._resume, self._holding):
            table.pop(bid, None)  # type: ignore[attr-defined]

    def report(self, enabled: bool, decisions: Any, total: int) -> dict[str, Any]:
        per = {k: v.model_copy() for k, v in self.stats.items()}
        for template, nbytes in self._holding.values():
            st = per.setdefault(template, TemplatePreemption())
            st.paused_now += 1
            st.paused_bytes += nbytes
        recent = [DecisionRecord(kind=d.kind, template=d.template, requests=list(d.requests), by=list(d.by), offload=d.offload)
                  for d in list(decisions)[-RECENT_DECISIONS:]]
        return PreemptionReport(enabled=enabled, per_template=per, decisions=total, recent=recent).model_dump()

    def held_bytes(self, template: str) -> int:
        return sum(n for t, n in self._holding.values() if t == template)
