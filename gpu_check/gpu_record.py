"""`gpu-check.json`: the GPU check's record (docs/gpu-check.md, "Fields").

Standard-library dataclasses, written with ``json``: the check writes its first record before
anything beyond the standard library is imported (on a machine where the kit, pydantic among
it, is not installed yet, or failed to install, the record still says so). Readers validate it
with pydantic against these same classes (``pydantic.TypeAdapter(GpuCheckRecord)``: types and
Literals are checked; tests/test_gpu_check.py does), so there is one schema, not two.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["planned", "running", "passed", "failed", "skipped", "error", "timeout", "crashed", "not_run"]
StepStatus = Literal["ok", "failed", "skipped"]


@dataclass
class ReportPhase:
    """One pytest report of the test (setup, call, teardown) as its process wrote it."""

    when: str
    outcome: str
    duration: float
    message: str | None = None


@dataclass
class CollectionError:
    nodeid: str
    message: str


@dataclass
class PrepStep:
    """One step of gpu_check/gpu_prep.sh: ``skipped`` when a step it depends on failed."""

    name: str
    status: StepStatus
    reason: str | None = None
    seconds: float = 0.0


@dataclass
class TestRecord:
    """One GPU test: what was planned and, once it ran (or was held back), what happened."""

    nodeid: str
    order: int
    part: int
    expected_s: float
    timeout_s: float
    planned: bool = True
    needs: list[str] = field(default_factory=list)
    status: Status = "planned"
    seconds: float | None = None
    returncode: int | None = None
    signal: str | None = None
    message: str | None = None
    stderr_tail: str | None = None
    phases: list[ReportPhase] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    device_gb: float = 0.0
    shm_left: list[str] = field(default_factory=list)


@dataclass
class GpuCheckRecord:
    """The whole run: rewritten after every test."""

    mode: Literal["run", "dry-run", "no-gpu"]
    started: str
    python: str
    finished: str | None = None
    part: Literal["1", "2", "3", "all"] = "all"
    budget_s: float | None = None
    until: float | None = None
    clock_at_start: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)
    torch: str | None = None
    cuda: bool = False
    device: str | None = None
    device_memory_bytes: int | None = None
    skipped: str | None = None
    prep: dict[str, Any] | None = None
    prep_steps: list[PrepStep] = field(default_factory=list)
    collected: list[str] = field(default_factory=list)
    collection_errors: list[CollectionError] = field(default_factory=list)
    planned_files: list[str] = field(default_factory=list)
    expected_s: float = 0.0
    host_budget_bytes: int | None = None
    tests: list[TestRecord] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    allocator: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    returncode: int | None = None


def write_record(record: GpuCheckRecord, out: Path) -> None:
    """``out/gpu-check.json``, replaced atomically (a kill mid-write leaves the previous one)."""
    record.counts = {}
    for t in record.tests:
        record.counts[t.status] = record.counts.get(t.status, 0) + 1
    tmp = out / ".gpu-check.json.tmp"
    tmp.write_text(json.dumps(asdict(record), indent=1, default=str))
    tmp.replace(out / "gpu-check.json")


def prep_steps(prep: dict[str, Any] | None) -> list[PrepStep]:
    """The steps of a gpu_prep.sh record (``steps``: a list of {name, status, reason, seconds})."""
    out = []
    for s in (prep or {}).get("steps") or []:
        if isinstance(s, dict) and isinstance(s.get("name"), str) and s.get("status") in ("ok", "failed", "skipped"):
            out.append(PrepStep(name=s["name"], status=s["status"], reason=s.get("reason"),
                                seconds=float(s.get("seconds") or 0)))
    return out
