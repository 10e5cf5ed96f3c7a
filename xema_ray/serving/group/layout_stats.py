"""The static allocator's counters per template of a model group: batches run with the layout armed,
allocations it placed (hits), allocations that fell back to the dynamic path, the bytes the
allocator holds, and batches that failed out of device memory. Shown in ``/v1/stats``, ``/healthz`` (group status) and the Prometheus metrics.
Where nothing is armed (a CPU worker, a plan without a layout) the counters stay 0 and ``status``
says why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from xema_ray.runtime.engine import BatchResult


class TemplateLayoutStats(BaseModel):
    """One template's static-layout counters since the group started."""

    model_config = ConfigDict(extra="forbid")

    layout_ref: str | None = Field(default=None, description="the plan entry's layout (None: the plan has none)")
    batches: int = Field(default=0, ge=0, description="batches run for this template")
    armed_batches: int = Field(default=0, ge=0, description="batches run with the layout armed")
    hits: int = Field(default=0, ge=0, description="allocations placed at their planned offset")
    fallbacks: int = Field(default=0, ge=0, description="allocations the layout did not know, served by the dynamic path")
    reserved_bytes: int = Field(default=0, ge=0, description="bytes the static allocator held after the last batch (0: not armed)")
    not_armed: str | None = Field(default=None, description="why the last batch ran without its layout (None: it was armed, "
                                                            "or the workers' status says why none is)")
    out_of_memory: int = Field(default=0, ge=0, description="batches that failed out of device memory (each a JSON 503; "
                                                            "the worker served on)")
    last_out_of_memory: str | None = Field(default=None, description="the last such failure: the entry, bytes asked, "
                                                                     "bytes free")


class WorkerMemory(BaseModel):
    """One worker's memory in the last batch it ran (``MemoryStats``: the device allocator's counters
    on a GPU, the process's resident set on CPU; ``source`` says which), for the console's view."""

    model_config = ConfigDict(extra="forbid")

    template: str = Field(description="the template of that batch")
    peak_bytes: int = Field(ge=0, description="peak during the batch")
    current_bytes: int = Field(ge=0, description="in use at the end of the batch")
    source: str = Field(description="where the numbers come from (MemoryStats.source), e.g. rss on CPU")


class GroupLayoutStats(BaseModel):
    """A model group's static layouts: the workers' status (armed, or why not) and counters per template."""

    model_config = ConfigDict(extra="forbid")

    status: str = Field(description="what the workers said at load: layouts armed per batch, or 'not armed: why'")
    templates: dict[str, TemplateLayoutStats] = Field(default_factory=dict)
    workers: dict[int, WorkerMemory] = Field(default_factory=dict, description="per worker index: its last batch's memory")


class LayoutCounters:
    """Kept by a ``ModelGroup``; fed with each batch's lead result."""

    def __init__(self, layout_refs: dict[str, str | None]) -> None:
        self.status = ("no plan of this group has a static layout" if not any(layout_refs.values())
                       else "workers not loaded yet")
        self.templates = {t: TemplateLayoutStats(layout_ref=ref) for t, ref in sorted(layout_refs.items())}
        self.workers: dict[int, WorkerMemory] = {}

    def loaded(self, status: str | None) -> None:
        """The workers' layout status after ``load_model``."""
        if status is not None:
            self.status = status

    def observe(self, template: str, result: BatchResult, by_worker: dict[int, BatchResult] | None = None) -> None:
        """A batch of ``template`` ran: ``result`` is its lead worker's, ``by_worker`` every worker's."""
        for w, r in (by_worker or {}).items():
            self.workers[w] = WorkerMemory(template=template, peak_bytes=r.memory.peak_bytes,
                                           current_bytes=r.memory.current_bytes, source=r.memory.source)
        st = self.templates.setdefault(template, TemplateLayoutStats())
        st.batches += 1
        st.armed_batches += int(result.layout_armed)
        st.hits += result.layout_hits
        st.fallbacks += result.layout_misses
        st.reserved_bytes = result.layout_reserved_bytes
        st.not_armed = result.layout_note
        if result.layout_status is not None:
            self.status = result.layout_status

    def out_of_memory(self, template: str, message: str) -> None:
        """A batch of ``template`` failed out of device memory (``DeviceOutOfMemory``)."""
        st = self.templates.setdefault(template, TemplateLayoutStats())
        st.out_of_memory += 1
        st.last_out_of_memory = message

    def snapshot(self) -> GroupLayoutStats:
        return GroupLayoutStats(status=self.status, templates={k: v.model_copy() for k, v in self.templates.items()},
                                workers=dict(self.workers))
