"""The static layout file of one plan entry (paper §6): its schema, its content id, save and load.

The file is ``<plan table>.layouts/<layout_id>.json``: versioned (``LAYOUT_FILE_VERSION``),
hashed (``layout_id`` is the solved layout's content hash, checked again on load) and tagged with
the GPU model it is for (flash attention's scratch and cuBLAS workspaces differ per GPU). Where the
layouts folder holds a record of that GPU model's GPU-only allocations taken against the same
stream (``device-allocs/<gpu>.json``, ``xema_ray.allocator.device_allocs``), they were included
before solving; the artifact carries the entry it included (or why none) and the rows the runtime
plan leaves out (allocations the GPU makes on another stream).

The artifact lives beside the allocator that arms it; solving one from the serving worker's own
allocation stream is offline work (``xema_ray.measure.layout_solve``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.allocator.margins import DYNAMIC_FRACTION
from xema_ray.allocator import step_repeat
from xema_ray.allocator.device_allocs import EntryRecord
from xema_ray.allocator.solver import ReplayPlan, StaticLayout, StaticLayoutFile
from xema_ray.allocator.step_repeat import StepRepeat

#: 2: ``step_repeat`` (a layout solved for 6 or 7 steps stands for all of them); 1 files are solved again
LAYOUT_FILE_VERSION = 2


class LayoutMismatch(ValueError):
    """A layout file is for another GPU, another version, or its content does not hash to its id."""


class LayoutArtifact(BaseModel):
    """One plan entry's static layout on disk."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = LAYOUT_FILE_VERSION
    layout_id: str = Field(description="content hash of the solved layout (``content_id``: its inputs and offsets)")
    gpu: str = Field(description="GPU model the layout is for, e.g. 'NVIDIA RTX A6000' ('any' on CPU tables)")
    template: str
    config_hash: str = Field(description="ExecutionConfig.config_hash of the entry it was solved for")
    steps: int
    loaded_bytes: int = Field(default=0, ge=0, description="device bytes the worker's load placed (weights), outside the layout")
    dynamic_fraction: float = DYNAMIC_FRACTION
    layout: StaticLayoutFile = Field(description="the solved layout: of the full stream, or (step_repeat) of its "
                                                 "first 6 or 7 steps and tail, repeated for the rest")
    step_repeat: StepRepeat | None = Field(
        default=None, description="how the 6- or 7-step layout stands for every step (xema_ray.allocator.step_repeat); "
                                  "None: the layout is the full stream's")
    repeat_note: str = Field(default="", description="why the full stream was solved instead (empty: repeated, or too few steps)")
    device_allocs: EntryRecord | None = Field(
        default=None, description="the GPU-only allocations included before solving (recorded on this GPU model)")
    device_allocs_note: str = Field(default="", description="included from which record, or why none was")
    unplanned_rows: list[int] = Field(
        default_factory=list, description="layout rows the runtime plan leaves out (made on another stream)")

    @property
    def reserved_bytes(self) -> int:
        return self.layout.reserved_bytes

    @property
    def lower_bound_bytes(self) -> int:
        """Max live bytes of the full stream (no layout reserves less)."""
        return self.step_repeat.lower_bound_bytes if self.step_repeat is not None else self.layout.lower_bound_bytes

    def solved(self) -> StaticLayout:
        """The layout of the full stream (a repeated one expanded), rows in allocation order."""
        short = StaticLayout.from_file(self.layout)
        return short if self.step_repeat is None else step_repeat.expand(short, self.step_repeat, self.step_repeat.steps)

    def verify(self) -> None:
        """Raise ``ValueError`` unless the full layout is aligned, inside its region and free of
        overlaps (a repeated one: checked on its expansion with two middle windows, which is equivalent)."""
        short = StaticLayout.from_file(self.layout)
        if self.step_repeat is None:
            short.verify()
        else:
            step_repeat.verify(short, self.step_repeat)

    def plan_for_steps(self, steps: int) -> ReplayPlan | None:
        """The replay plan for a batch of ``steps`` denoising steps (a request's own count): the
        solved one at the template's count; a repeated layout's window repeated to ``steps`` when
        it can be (at least the solved steps, the same parity; its validity is the repeated
        layout's, ``step_repeat.verify``), in the same reserved bytes; None otherwise (the batch
        runs on the dynamic region)."""
        if steps == self.steps:
            return self.replay_plan()
        rep = self.step_repeat
        if (rep is None or self.unplanned_rows or steps < rep.solved_steps
                or (steps - rep.solved_steps) % step_repeat.PERIOD):
            return None
        return self.replay_plan(step_repeat.expand(StaticLayout.from_file(self.layout), rep, steps))

    def replay_plan(self, layout: StaticLayout | None = None) -> ReplayPlan:
        """The plan the worker arms per batch: every row made on the armed stream."""
        layout = layout or self.solved()
        rows = np.ones(len(layout), dtype=bool)
        rows[np.asarray(self.unplanned_rows, dtype=np.int64)] = False
        return layout.replay_plan(rows)


def content_id(layout: StaticLayout) -> str:
    """Hash of a solved layout: what it was solved for (``StaticLayout.key``) and its offsets."""
    import hashlib

    h = hashlib.sha256(layout.key().encode())
    h.update(np.ascontiguousarray(layout.offset, dtype=np.int64).tobytes())
    h.update(str(layout.reserved_bytes).encode())
    return h.hexdigest()[:16]


def layouts_dir(table_path: str | Path) -> Path:
    """Where a plan table's layouts live: ``plans/x.json`` -> ``plans/x.layouts/``."""
    p = Path(table_path)
    return p.with_name(p.stem + ".layouts")


def save_artifact(artifact: LayoutArtifact, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{artifact.layout_id}.json"
    path.write_text(artifact.model_dump_json())
    return path


def load_artifact(directory: Path, layout_id: str, gpu: str | None = None) -> LayoutArtifact:
    """Read and check a layout: its version, that its content hashes to ``layout_id``, and (when
    ``gpu`` is given) that it was solved for that GPU model.

    Raises:
        LayoutMismatch: naming the file and what differs.
    """
    path = directory / f"{layout_id}.json"
    if not path.is_file():
        raise LayoutMismatch(f"layout {layout_id}: {path} is missing (xema layouts --plan-table "
                             f"{directory.with_name(directory.name.removesuffix('.layouts') + '.json')} writes it)")
    art = LayoutArtifact.model_validate_json(path.read_text())
    if art.version != LAYOUT_FILE_VERSION:
        raise LayoutMismatch(f"{path}: layout file version {art.version}, this build reads {LAYOUT_FILE_VERSION}")
    try:
        solved = art.solved()
    except ValueError as e:
        raise LayoutMismatch(f"{path}: {e}") from None
    actual = content_id(solved)
    if actual != layout_id or art.layout_id != layout_id:
        raise LayoutMismatch(f"{path}: content hashes to {actual}, the plan names {layout_id} (file edited or corrupt)")
    try:
        art.verify()  # aligned, inside the region, no two live blocks overlapping
    except ValueError as e:
        raise LayoutMismatch(f"{path}: {e}") from None
    if gpu is not None and art.gpu not in ("any", gpu):
        raise LayoutMismatch(f"{path}: layout solved for {art.gpu!r}, this worker runs on {gpu!r}; "
                             "a layout is per GPU model (attention and cuBLAS scratch differ): re-plan for this GPU")
    return art
