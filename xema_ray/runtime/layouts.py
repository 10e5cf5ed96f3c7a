"""Static layouts per plan entry (paper §6): solved from the serving worker's own allocation
stream, stored next to the plan table, validated and armed by the worker.

``solve_entry_layout(config)`` runs the worker's load + execute on the meta device (as ``xema
verify`` does), with the analyzer's step markers, expands the traced steps to the template's
(the analyzer checks each step repeats the same allocations), keeps the request's allocations
(everything after the weights are placed) and solves their layout (Algorithm 1, C++). The file
is ``<plan table>.layouts/<layout_id>.json``: versioned (``LAYOUT_FILE_VERSION``), hashed
(``layout_id`` is the solved layout's content hash, checked again on load) and tagged with the
GPU model it is for (flash attention's scratch and cuBLAS workspaces differ per GPU).

``replay(layout, trace)`` feeds a request's allocation stream through the C++ runtime
allocator's host arena with the layout armed and reports hits, misses and reserved bytes:
``xema verify`` uses it to prove, on a CPU, that the worker's stream is the one the layout was
solved for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.layout.solver import StaticLayout, StaticLayoutFile, solve_layout
from xema_ray.memory.trace import MemoryTrace
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.allocator import DEFAULT_DYNAMIC_FRACTION as DYNAMIC_FRACTION

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

    @property
    def reserved_bytes(self) -> int:
        return self.layout.reserved_bytes

    def solved(self) -> StaticLayout:
        return StaticLayout.from_file(self.layout)


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


def solve_entry_layout(config: ExecutionConfig, gpu: str) -> LayoutArtifact:
    """Solve ``config``'s layout from the serving worker's allocation stream for one batch (steps
    expanded; the load excluded: weights are placed before any request, the layout covers what a
    request allocates)."""
    from xema_ray.runtime.verify import worker_trace

    trace = worker_trace(config)
    layout = solve_layout(trace)
    layout.verify()
    return LayoutArtifact(layout_id=content_id(layout), gpu=gpu, template=config.template.shape_key,
                          config_hash=config.config_hash(), steps=config.template.steps,
                          loaded_bytes=int(trace.meta["loaded_bytes"]), layout=layout.to_file())


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
        raise LayoutMismatch(f"layout {layout_id}: {path} is missing (plan the table again with --layouts)")
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


class ReplayReport(BaseModel):
    """One request's allocation stream through the host arena with a layout armed."""

    model_config = ConfigDict(frozen=True)

    allocations: int
    hits: int
    misses: int
    static_reserved_bytes: int
    lower_bound_bytes: int
    peak_reserved_bytes: int


def replay(layout: StaticLayout, trace: MemoryTrace) -> ReplayReport:
    """Run ``trace``'s allocations and frees, in event order, through the C++ allocator's host
    arena with ``layout`` armed; an allocation whose size differs from the layout's at its index
    (or that the layout does not have) falls back and counts as a miss."""
    from xema_ray.runtime.allocator import StaticAllocator

    alloc = StaticAllocator("host")
    device = 0
    dynamic = max(int(layout.reserved_bytes * DYNAMIC_FRACTION), 1 << 20)
    alloc.reserve(layout.reserved_bytes, dynamic, device=device)
    n = len(trace)
    sizes = trace.nbytes.astype(np.int64)
    order = np.argsort(np.concatenate([trace.begin, trace.end]), kind="stable")
    ptrs = np.zeros(n, dtype=np.uint64)
    live = np.zeros(n, dtype=bool)
    try:
        with alloc.armed(layout.replay_plan(), device=device) as report:
            for k in order:
                i = int(k % n)
                if k < n:
                    ptrs[i] = alloc.malloc(max(1, int(sizes[i])), device=device)
                    live[i] = True
                elif live[i] and trace.end[i] < trace.n_events:
                    alloc.free(int(ptrs[i]), device=device)
                    live[i] = False
        stats = alloc.stats(device=device)
        for i in np.flatnonzero(live):
            alloc.free(int(ptrs[i]), device=device)
    finally:
        alloc.release(device=device)
    return ReplayReport(allocations=n, hits=report.hits, misses=report.misses,
                        static_reserved_bytes=layout.reserved_bytes, lower_bound_bytes=layout.lower_bound_bytes,
                        peak_reserved_bytes=stats.peak_reserved_bytes)
