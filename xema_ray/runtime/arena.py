"""The static allocator's arena on a worker whose templates keep different weights on the device.

With per-template residency each template's batch runs with its own amount of weights on the
device (``LayoutArtifact.loaded_bytes``, placed outside the arena). One arena sized for the
group's largest static layout would sit next to the largest weights as soon as the worker
switches templates (CogVideoX-5B on a 48 GB A6000: 11.6 GB of weights + 41.9 GB of arena), so
the arena follows the template instead (``TemplateArena.switch``):

* the **dynamic region** is reserved once, at load, for the whole group
  (``margins.group_dynamic_bytes``): ``warm_up`` leaves cuBLAS workspaces and other long-lived
  blocks in it, so it is never released while the model is loaded;
* the **static region** is re-sized at each switch (``StaticAllocator.resize_static``): shrunk
  *before* the residency switch brings weights in, grown *after* weights left. Each entry fits
  alone (its weights + its static region + the group's dynamic region <= the budget), and the
  residency switch moves blocks out before others come in, so the device never holds more than
  the larger of the two entries' totals at any moment. A larger region is kept where it still
  fits next to the target's weights (no churn between templates of the same residency).

A batch runs without its layout (its allocations go to the dynamic region, then the driver, as
with no layout) and the switch says why when: its entry does not fit the budget even with the
smallest dynamic region, the static region cannot be re-sized because a static block is still
live (a paused armed batch moves its state to the host, so none should be) or a plan is armed,
or the backend refused the memory. A batch without a layout (or resumed after a pause: it runs
disarmed) gets no static region at all, so its allocations have the room.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from xema_ray.allocator.margins import MIN_DYNAMIC_BYTES, entry_peak_bytes, fits_with_layout, group_dynamic_bytes

T = TypeVar("T")

GB = 1e9


class ArenaAllocator(Protocol):
    """What ``TemplateArena`` needs of ``xema_ray.allocator.runtime.StaticAllocator``."""

    def reserve(self, static_bytes: int, dynamic_bytes: int | None = None, *, device: int = 0) -> None: ...
    def resize_static(self, static_bytes: int, *, device: int = 0) -> None: ...
    def stats(self, *, device: int = 0) -> Any: ...


@dataclass(frozen=True)
class ArenaEntry:
    """One layout of the group: the weights its load places on the device and its static region."""

    loaded_bytes: int
    static_bytes: int


@dataclass(frozen=True)
class SwitchOutcome:
    """What ``TemplateArena.switch`` did: the residency switch's own result, and why the batch
    cannot arm its layout (None: it can)."""

    moved: Any
    not_armed: str | None
    static_bytes: int


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


class TemplateArena:
    """Sizes one worker's arena for the group's layouts and makes it follow the template run.

    Args:
        allocator: the static allocator (its control calls; the host backend in CPU tests).
        entries: layout_ref -> its entry (weights on the device, static region).
        budget_bytes: device memory per worker (the plan table's budget); None: not known, the
            dynamic region is ``DYNAMIC_FRACTION`` of the largest static region and nothing is
            refused for the budget.
        device: the allocator's device index.
        floor: the smallest dynamic region (``MIN_DYNAMIC_BYTES``).
    """

    def __init__(self, allocator: ArenaAllocator, entries: dict[str, ArenaEntry], budget_bytes: int | None,
                 device: int = 0, floor: int = MIN_DYNAMIC_BYTES) -> None:
        if not entries:
            raise ValueError("TemplateArena needs at least one layout")
        self.allocator = allocator
        self.entries = dict(entries)
        self.budget_bytes = budget_bytes
        self.device = device
        self.dynamic_bytes = group_dynamic_bytes([(e.loaded_bytes, e.static_bytes) for e in entries.values()],
                                                 budget_bytes, floor=floor)
        #: layout_ref -> why its batches never arm (the entry does not fit next to the dynamic region)
        self.unfit: dict[str, str] = {}
        for ref, e in sorted(self.entries.items()):
            if not fits_with_layout(e.loaded_bytes, e.static_bytes, self.dynamic_bytes, budget_bytes):
                peak = entry_peak_bytes(e.loaded_bytes, e.static_bytes, self.dynamic_bytes)
                self.unfit[ref] = (f"{_gb(e.loaded_bytes)} weights + {_gb(e.static_bytes)} static region + "
                                   f"{_gb(self.dynamic_bytes)} dynamic region = {_gb(peak)} > the "
                                   f"{_gb(budget_bytes or 0)} budget")
        self._lock = threading.Lock()
        self.resizes = 0

    def reserve(self) -> None:
        """Reserve the arena at load: the group's dynamic region, no static region yet (the first
        batch's switch makes it)."""
        self.allocator.reserve(0, self.dynamic_bytes, device=self.device)

    @property
    def static_bytes(self) -> int:
        return int(self.allocator.stats(device=self.device).static_region_bytes)

    def describe(self) -> str:
        """One line for the worker's layout status."""
        n = len(self.entries)
        armed = n - len(self.unfit)
        budget = f", {_gb(self.budget_bytes)} budget" if self.budget_bytes is not None else ", no budget given"
        line = (f"{armed} of {n} layout(s) armed per batch; the static region follows the template, "
                f"next to one {_gb(self.dynamic_bytes)} dynamic region{budget}")
        if self.unfit:
            line += "; not armed: " + "; ".join(f"{ref}: {why}" for ref, why in sorted(self.unfit.items()))
        return line

    def _needed(self, layout_ref: str | None) -> tuple[int, str | None]:
        if layout_ref is None:
            return 0, None
        entry = self.entries.get(layout_ref)
        if entry is None:
            return 0, f"layout {layout_ref} was not loaded by this worker"
        if layout_ref in self.unfit:
            return 0, f"its entry does not fit: {self.unfit[layout_ref]}"
        return entry.static_bytes, None

    def _keeps(self, layout_ref: str | None, current: int) -> bool:
        """Whether a static region of ``current`` bytes may stay while ``layout_ref``'s weights are
        on the device (only for an armed entry whose total with it is within the budget)."""
        entry = self.entries.get(layout_ref) if layout_ref is not None else None
        if entry is None or layout_ref in self.unfit or self.budget_bytes is None:
            return False
        return entry.loaded_bytes + current + self.dynamic_bytes <= self.budget_bytes

    def _resize(self, nbytes: int, when: str) -> str | None:
        from xema_ray.allocator.runtime import AllocatorError

        try:
            self.allocator.resize_static(nbytes, device=self.device)
        except AllocatorError as e:
            return f"the static region could not be re-sized to {_gb(nbytes)} {when}: {e}"
        self.resizes += 1
        return None

    def switch(self, layout_ref: str | None, move: Callable[[], T]) -> SwitchOutcome:
        """Run the residency switch ``move`` for a batch of ``layout_ref`` (None: the batch runs
        without a layout), the static region shrunk before it and grown after it.

        Returns:
            ``move``'s result, why the batch must run without its layout (None: it can arm it)
            and the static region's bytes after the switch.
        """
        with self._lock:
            need, why = self._needed(layout_ref)
            stats = self.allocator.stats(device=self.device)
            current = int(stats.static_region_bytes)
            if stats.static_active_bytes and why is None and layout_ref is not None:
                # its planned offsets would collide with them (each such allocation a miss)
                why = (f"{_gb(int(stats.static_active_bytes))} of static blocks are still live (a batch's state "
                       "left in the static region), so the static region cannot follow the template")
            if current > need and not self._keeps(layout_ref, current):
                failed = self._resize(need, "before the weights came in")
                if failed is not None:
                    entry = self.entries.get(layout_ref) if layout_ref is not None else None
                    if entry is not None and self.budget_bytes is not None:
                        peak = entry.loaded_bytes + current + self.dynamic_bytes
                        if peak > self.budget_bytes:  # the weights still come: the batch needs them
                            failed += f" (its weights next to it: {_gb(peak)}, over the {_gb(self.budget_bytes)} budget)"
                    why = failed if why is None else f"{why}; {failed}"
            moved = move()
            current = self.static_bytes
            if need > current and why is None:
                why = self._resize(need, "after the weights left")
            return SwitchOutcome(moved=moved, not_armed=why, static_bytes=self.static_bytes)
