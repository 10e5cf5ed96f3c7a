"""Recording a real run's allocations through libxema_alloc (``StaticAllocator.record``): the
events as the allocator saw them, and the trace they make (what a layout can be solved from, or
compared with the meta trace: ``xema_ray.allocator.device_allocs``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xema_ray.memory.trace import Category, MemoryTrace

REGIONS = ("static", "dynamic", "driver")


@dataclass(frozen=True)
class RecordedEvent:
    """One allocator event seen while recording."""

    ptr: int
    size: int
    requested: int
    stream: int
    kind: int  # 0 alloc, 1 free
    region: int  # index into ("static", "dynamic", "driver")

    @property
    def region_name(self) -> str:
        return REGIONS[self.region]


@dataclass
class Recording:
    """Events captured by ``StaticAllocator.record``; ``trace()`` turns them into a MemoryTrace."""

    events: list[RecordedEvent] | None = None

    def trace(self, *, stream: int | None = None, meta: dict[str, str] | None = None) -> MemoryTrace:
        """The recorded allocations as a trace, renumbered so every kept event is one time step.

        Args:
            stream: keep only allocations made on this stream (the one a plan will be armed for);
                all when ``None``.
            meta: provenance to store in the trace.

        Frees of blocks allocated before recording started are not part of the request and dropped.
        """
        if self.events is None:
            raise ValueError("the recording is still running; call trace() after the with-block")
        rows: list[list[int]] = []  # size, requested, begin, end
        live: dict[int, int] = {}
        t = 0
        for ev in self.events:
            if ev.kind == 0:
                if stream is not None and ev.stream != stream:
                    continue
                live[ev.ptr] = len(rows)
                rows.append([ev.size, ev.requested, t, -1])
                t += 1
            else:
                row = live.pop(ev.ptr, None)
                if row is None:
                    continue
                rows[row][3] = t
                t += 1
        arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
        n = len(arr)
        return MemoryTrace(
            size=arr[:, 0].copy(),
            nbytes=arr[:, 1].copy(),
            begin=arr[:, 2].copy(),
            end=np.where(arr[:, 3] < 0, t, arr[:, 3]),
            category=np.full(n, int(Category.ACTIVATION), np.int8),
            module=np.full(n, -1, np.int32),
            phase=np.zeros(n, np.int32),
            op=np.full(n, -1, np.int32),
            free_module=np.full(n, -1, np.int32),
            n_events=t,
            phases=["request"],
            meta={"source": "xema_alloc recording", **(meta or {})},
        )


