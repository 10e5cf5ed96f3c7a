"""Static layouts per plan entry (paper §6): solved from the serving worker's own allocation
stream, stored next to the plan table, validated and armed by the worker.

``solve_entry_layout(config)`` runs the worker's load + execute on the meta device (as ``xema
verify`` does), with the analyzer's step markers, expands the traced steps to the template's
(the analyzer checks each step repeats the same allocations), keeps the request's allocations
(everything after the weights are placed) and solves their layout (Algorithm 1, C++). The file
is ``<plan table>.layouts/<layout_id>.json``: versioned (``LAYOUT_FILE_VERSION``), hashed
(``layout_id`` is the solved layout's content hash, checked again on load) and tagged with the
GPU model it is for (flash attention's scratch and cuBLAS workspaces differ per GPU). Where the
layouts folder holds a record of that GPU model's GPU-only allocations taken against the same
stream (``device-allocs/<gpu>.json``, ``xema_ray.allocator.device_allocs``), they are included
before solving; the artifact carries the entry it included (or why none) and the rows the runtime
plan leaves out (allocations the GPU makes on another stream).

``xema_ray.allocator.replay.replay(layout, trace)`` feeds a request's allocation stream through the
C++ runtime allocator's host arena with the layout armed: ``xema verify`` uses it to prove, on a
CPU, that the worker's stream is the one the layout was solved for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.allocator.margins import DYNAMIC_FRACTION
from xema_ray.allocator.device_allocs import EntryRecord, include, lookup
from xema_ray.allocator.solver import ReplayPlan, StaticLayout, StaticLayoutFile, solve_layout
from xema_ray.plan import ExecutionConfig

LAYOUT_FILE_VERSION = 1


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
    layout: StaticLayoutFile
    device_allocs: EntryRecord | None = Field(
        default=None, description="the GPU-only allocations included before solving (recorded on this GPU model)")
    device_allocs_note: str = Field(default="", description="included from which record, or why none was")
    unplanned_rows: list[int] = Field(
        default_factory=list, description="layout rows the runtime plan leaves out (made on another stream)")

    @property
    def reserved_bytes(self) -> int:
        return self.layout.reserved_bytes

    def solved(self) -> StaticLayout:
        return StaticLayout.from_file(self.layout)

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


def solve_entry_layout(config: ExecutionConfig, gpu: str, layouts_dir: Path | None = None) -> LayoutArtifact:
    """Solve ``config``'s layout from the serving worker's allocation stream for one batch (steps
    expanded; the load excluded: weights are placed before any request, the layout covers what a
    request allocates).

    Args:
        config: the plan entry's configuration.
        gpu: the GPU model the layout is for ('any' on CPU tables).
        layouts_dir: the table's layouts folder; where it holds a record of GPU-only allocations
            for ``gpu`` taken against this very stream (``xema_ray.allocator.device_allocs``), they
            are put into the stream before solving, and the artifact says so (or why not).
    """
    from xema_ray.runtime.verify import worker_trace

    trace = worker_trace(config)
    entry, note, _ = lookup(layouts_dir, gpu, trace) if gpu != "any" else (None, "CPU table: no GPU model", None)
    planned = np.ones(len(trace), dtype=bool)
    if entry is not None:
        trace, planned = include(trace, entry)
    layout = solve_layout(trace)
    layout.verify()
    return LayoutArtifact(layout_id=content_id(layout), gpu=gpu, template=config.template.shape_key,
                          config_hash=config.config_hash(), steps=config.template.steps,
                          loaded_bytes=trace.loaded_bytes, layout=layout.to_file(),
                          device_allocs=entry, device_allocs_note=note,
                          unplanned_rows=[int(i) for i in np.flatnonzero(~planned)])


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
    solved = art.solved()
    actual = content_id(solved)
    if actual != layout_id or art.layout_id != layout_id:
        raise LayoutMismatch(f"{path}: content hashes to {actual}, the plan names {layout_id} (file edited or corrupt)")
    try:
        solved.verify()  # aligned, inside the region, no two live blocks overlapping
    except ValueError as e:
        raise LayoutMismatch(f"{path}: {e}") from None
    if gpu is not None and art.gpu not in ("any", gpu):
        raise LayoutMismatch(f"{path}: layout solved for {art.gpu!r}, this worker runs on {gpu!r}; "
                             "a layout is per GPU model (attention and cuBLAS scratch differ): re-plan for this GPU")
    return art
