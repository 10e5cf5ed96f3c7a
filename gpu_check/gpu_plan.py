"""The GPU check's plan (gpu_check/run.py): every GPU test in priority order, its part, its
expected device seconds and its own timeout, and the result records a check writes.

Expected seconds are estimates, not measurements (no GPU was lent when they were written):
BENCHMARKS.md "GPU check" derives each from CPU-measured build costs and a stated speed-up.
A collected GPU test that matches no entry runs after the planned ones, in part 2, with
``UNPLANNED`` figures. JSON on disk is these pydantic models (docs/gpu-check.md, "Fields").
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

#: the GPU test modules: only these are ever imported by the check (never a CPU test module)
GPU_MODULES_GLOB = "tests/**/test_*_gpu.py"
#: files a check may leave in --out: what the device tool brings back (8 at most)
MAX_OUT_FILES = 8
#: seconds of tests per part: two parts (+ gpu_check/gpu_prep.sh, <= 90 s each) and a machine start fit the
#: session's 15 minutes of device time, each call well inside its 10-minute command limit
PART_BUDGET_S = 330.0


class PlannedTest(BaseModel):
    """One entry of the plan: the tests whose node id starts with ``match``."""

    model_config = ConfigDict(frozen=True)

    match: str
    part: Literal[1, 2]
    expected_s: float = Field(description="estimated device seconds (BENCHMARKS.md, GPU check)")
    timeout_s: float = Field(description="the test process is killed (its whole process group) after this")
    files: tuple[str, ...] = Field(default=(), description="files the test leaves in --out (beside the two logs)")
    what: str = ""


UNPLANNED = PlannedTest(match="", part=2, expected_s=120.0, timeout_s=300.0, what="a GPU test the plan does not name")

_A = "tests/gpu/test_allocator_gpu.py::"
PLAN: tuple[PlannedTest, ...] = (
    PlannedTest(match="tests/gpu/test_seeded_weights_gpu.py::", part=1, expected_s=13, timeout_s=60,
                what="seeded weights filled on the GPU = the CPU build's bytes (one Flux.2 block)"),
    PlannedTest(match=_A + "test_install_refuses_after_cuda_initialized", part=1, expected_s=13, timeout_s=60,
                what="libxema_alloc refuses once CUDA is initialised"),
    PlannedTest(match=_A + "test_static_region_resizes_and_teardown_with_live_tensors", part=1, expected_s=13,
                timeout_s=60, what="the static region re-sized around a live dynamic block (its seconds); teardown "
                                   "with live tensors under the static allocator"),
    PlannedTest(match=_A + "test_cogvideox_720x480_armed_layout_against_the_caching_allocator", part=1,
                expected_s=102, timeout_s=200, files=("device-allocs-cogvideox-5b_720x480x49.json",),
                what="CogVideoX-5B 720x480x49, 3 steps: caching run + recording, layout, armed run (2 builds)"),
    PlannedTest(match=_A + "test_flux2_1024_offload_plan_under_48gb_with_the_layout_armed", part=1,
                expected_s=83, timeout_s=180, files=("device-allocs-flux2_1024x1024.json",),
                what="Flux.2 1024², 1 step, 48 GB offload plan: caching run + recording, armed run (2 builds)"),
    PlannedTest(match="tests/gpu/test_residency_gpu.py::", part=1, expected_s=105, timeout_s=220,
                what="Flux.2 1024² under the 48 GB cap: planned / layerwise / no offload, Mistral-3 streamed"),
    PlannedTest(match="tests/gpu/test_analyzer_gpu.py::test_predicted_active_peak_within_1pct_of_cuda[cogvideox",
                part=2, expected_s=40, timeout_s=120, what="analyzer vs max_memory_allocated, CogVideoX-5B 2 steps"),
    PlannedTest(match="tests/gpu/test_analyzer_gpu.py::test_predicted_active_peak_within_1pct_of_cuda[flux2",
                part=2, expected_s=13, timeout_s=90, what="analyzer vs max_memory_allocated, Flux.2 1024² 2 steps"),
    PlannedTest(match="tests/gpu/test_vae_chain_gpu.py::", part=2, expected_s=21, timeout_s=90,
                what="CogVideoX VAE chain lossless on CUDA (the VAE alone)"),
    PlannedTest(match="tests/gpu/test_preemption_gpu.py::", part=2, expected_s=89, timeout_s=200,
                what="CogVideoX-5B pause/resume bitwise, state on device and on the host"),
    PlannedTest(match="tests/mitigation/test_offload_gpu.py::", part=2, expected_s=36, timeout_s=120,
                what="Flux.2 1024² step latency: no / selective / layerwise offload (Figure 4)"),
    PlannedTest(match="tests/gpu/test_planner_measured_gpu.py::", part=2, expected_s=113, timeout_s=240,
                what="measured planning of Flux.2 1024² and CogVideoX-5B 720x480x49"),
    PlannedTest(match="tests/parallel/test_sp_gpu.py::test_cuda_fingerprint_names_the_gpu", part=2,
                expected_s=7, timeout_s=60, what="the CUDA platform's NVML fingerprint"),
    PlannedTest(match="tests/parallel/test_sp_gpu.py::test_sp2_matches_sp1_over_nccl", part=2, expected_s=6,
                timeout_s=120, what="SP=2 vs SP=1 over NCCL (skips on one GPU)"),
)

Status = Literal["planned", "running", "passed", "failed", "skipped", "error", "timeout", "crashed", "not_run"]


class ReportPhase(BaseModel):
    """One pytest report of the test (setup, call, teardown) as its process wrote it."""

    when: str
    outcome: str
    duration: float
    message: str | None = None


class CollectionError(BaseModel):
    nodeid: str
    message: str


class TestRecord(BaseModel):
    """One GPU test: what was planned and, once it ran, what happened."""

    nodeid: str
    order: int
    part: int
    expected_s: float
    timeout_s: float
    planned: bool = True
    status: Status = "planned"
    seconds: float | None = None
    returncode: int | None = None
    signal: str | None = None
    message: str | None = None
    stderr_tail: str | None = None
    phases: list[ReportPhase] = Field(default_factory=list)
    results: dict[str, JsonValue] = Field(default_factory=dict)
    files: list[str] = Field(default_factory=list)


class GpuCheckRecord(BaseModel):
    """`gpu-check.json`: rewritten after every test (docs/gpu-check.md, "Fields")."""

    mode: Literal["run", "dry-run", "no-gpu"]
    started: str
    finished: str | None = None
    part: Literal["1", "2", "all"] = "all"
    budget_s: float | None = None
    python: str
    torch: str | None = None
    cuda: bool = False
    device: str | None = None
    skipped: str | None = None
    prep: dict[str, JsonValue] | None = None
    collected: list[str] = Field(default_factory=list)
    collection_errors: list[CollectionError] = Field(default_factory=list)
    planned_files: list[str] = Field(default_factory=list)
    expected_s: float = 0.0
    tests: list[TestRecord] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)
    allocator: dict[str, JsonValue] = Field(default_factory=dict)
    seconds: float | None = None
    returncode: int | None = None


def plan_for(nodeid: str) -> tuple[int, PlannedTest]:
    """(priority, entry) of a collected test: the first entry whose ``match`` starts its id."""
    for i, entry in enumerate(PLAN):
        if nodeid.startswith(entry.match):
            return i, entry
    return len(PLAN), UNPLANNED
