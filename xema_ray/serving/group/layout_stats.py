"""A model group's static-allocator counters per template, fed with each batch's result: batches run
with the layout armed, allocations it placed (hits), allocations that fell back to the dynamic path,
the bytes the allocator holds, and batches that failed out of device memory. The group reports them
as a ``GroupLayoutStats`` (``xema_ray.serving.messages``: it crosses to the Router for ``/v1/stats``,
``/healthz`` and the console). Where nothing is armed (a CPU worker, a plan without a layout) the
counters stay 0 and ``status`` says why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xema_ray.serving.messages import GroupLayoutStats, TemplateLayoutStats, WorkerMemory

if TYPE_CHECKING:
    from xema_ray.runtime.engine import BatchResult


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
