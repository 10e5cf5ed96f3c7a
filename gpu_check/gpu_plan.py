"""The GPU check's plan (gpu_check/run.py): the priority/time table of the GPU tests, what each
needs of gpu_check/gpu_prep.sh, and the device time's timeline (two calls in 900 s).

Standard library only: run.py imports this before the kit (pydantic among it) is installed, so
a machine without the kit still gets a plan and a record.

Tests are discovered by their ``gpu`` marker (run.py), never by this table: a GPU test the table
does not name runs after the named ones with ``UNPLANNED`` figures, or with the figures its marker
gives (``@pytest.mark.gpu(expected_s=60, timeout_s=150, part=2, needs=("allocator",))``). The
table orders them: the armed allocator first (stream-ordered frees in its CogVideoX-5B check, out of
memory under it, Flux.2's offload plan armed), then the cheap checks (analyzer, VAE chain,
fingerprint), then the rest. Each part's tests, with the call's prep and collection, fit the part's
window (``Timeline``); part 3 holds what the 900 s leave out (a later run's ``--part 3``). Expected
seconds and device memory are estimates, not measurements (no GPU has run them yet): BENCHMARKS.md
"GPU check".
"""

from __future__ import annotations

from dataclasses import dataclass

#: the files a call brings back from $OUT (8 at most)
MAX_OUT_FILES = 8
#: the prep steps every test needs (gpu_check/gpu_prep.sh's step names); a test's ``needs`` adds to these
BASE_NEEDS: tuple[str, ...] = ("machine_packages", "kit", "project")
#: every prep step, in the order gpu_prep.sh runs them
PREP_STEPS: tuple[str, ...] = ("machine_packages", "kit", "headers", "toolchain", "allocator", "project", "shm")

# ---- the device time (one H200; the calls' limits)
#: the machine kind both calls name: the Flux.2 tests need more device memory than an 80 GB card has spare
MACHINE_KIND = "nvidia-h200"
#: device time in all, machine starts and the waits between the calls included
DEVICE_S = 900
#: one command's limit (the call's timeout_s at most)
COMMAND_LIMIT_S = 600
#: a machine's start plus the tree's transfer ("a few minutes": budgeted at three)
MACHINE_START_S = 180
#: gpu_check/gpu_prep.sh on a fresh machine (kit install, allocator build on 16 cores) / on a warm one
PREP_COLD_S = 90
PREP_WARM_S = 10
#: the check's collection in each call: ``pytest --collect-only`` of the GPU modules, then the import of
#: what their tests import inside themselves (two processes importing torch, diffusers, transformers)
COLLECT_S = 40
#: a call's return: $OUT's transfer back, the reply
RETURN_S = 20
#: between call 1's reply and call 2 (the machine stays warm 30 s after a call, and that time counts)
TURNAROUND_S = 30
#: kept back at the end: a clock that drifts between this machine and the device's
END_MARGIN_S = 30
#: the device machine's RAM (128 GiB; MemTotal there starts lower and grows, so it is not read)
DEVICE_RAM_BYTES = 128 * 2**30
#: the share of it one GPU test may pin (page-locked memory cannot be swapped out: the rest is the OS's,
#: the check's and pytest's); passed to every test as $XEMA_GPU_HOST_BUDGET_BYTES
HOST_PIN_SHARE = 0.5


@dataclass(frozen=True)
class PlannedTest:
    """One row of the table: the tests whose node id starts with ``match``."""

    match: str
    part: int
    expected_s: float  # estimated device seconds (BENCHMARKS.md, GPU check)
    timeout_s: float  # the test's process group is killed after this
    files: tuple[str, ...] = ()  # files the test leaves in --out (beside the two logs)
    needs: tuple[str, ...] = ()  # prep steps it needs beyond BASE_NEEDS
    what: str = ""
    #: device memory it needs, GB (10^9): its analyzer peak or cap with room for the GPU's own
    #: workspaces; on a device with less it is skipped with that reason, not started
    device_gb: float = 0.0


UNPLANNED = PlannedTest(match="", part=2, expected_s=120.0, timeout_s=300.0, what="a GPU test the table does not name")

_A = "tests/gpu/test_allocator_gpu.py::"
_Z = "tests/gpu/test_analyzer_gpu.py::test_predicted_active_peak_within_1pct_of_cuda["
_ALLOC = ("allocator",)
#: Flux.2-dev whole on the device: 64.6 GB of weights, its analyzer peak 66.3 GB at 1024², plus the GPU's
#: workspaces (a 1.07 GB VAE convolution workspace among them) and the caching allocator's slack
FLUX2_WHOLE_GB = 80.0
PLAN: tuple[PlannedTest, ...] = (
    # part 1: the armed static allocator first (the point of the last rounds): stream-ordered frees,
    # out of memory under it, Flux.2's offload plan armed; then its two cheap checks
    PlannedTest(match=_A + "test_cogvideox_720x480_armed_layout_against_the_caching_allocator", part=1,
                expected_s=110, timeout_s=260, files=("device-allocs-cogvideox-5b_720x480x49.json",), needs=_ALLOC,
                device_gb=48,
                what="CogVideoX-5B 720x480x49, 3 steps, the VAE decoder's conv caches offloaded on a side stream "
                     "(stream-ordered frees): caching run + recording, layout, armed run (2 builds; 102 s + the copies)"),
    PlannedTest(match="tests/gpu/test_out_of_memory_cuda.py::", part=1, expected_s=25, timeout_s=150, needs=_ALLOC,
                device_gb=4, what="an over-budget request raises instead of faulting (static allocator); the next batch runs"),
    PlannedTest(match="tests/gpu/test_streams_cuda.py::", part=1, expected_s=15, timeout_s=90, needs=_ALLOC,
                device_gb=4, what="a deferred free polled while its stream is busy leaves no CUDA error for the next "
                                  "kernel launch; block offload's steady state makes no driver allocation"),
    PlannedTest(match=_A + "test_flux2_1024_offload_plan_under_48gb_with_the_layout_armed", part=1,
                expected_s=83, timeout_s=180, files=("device-allocs-flux2_1024x1024.json",), needs=(*_ALLOC, "shm"),
                device_gb=48, what="Flux.2 1024², 1 step, 48 GB offload plan (18 blocks in a 23.8 GiB shared segment): "
                                   "caching run + recording, armed run (2 builds)"),
    PlannedTest(match=_A + "test_install_refuses_after_cuda_initialized", part=1, expected_s=13, timeout_s=60,
                needs=_ALLOC, what="libxema_alloc refuses once CUDA is initialised"),
    PlannedTest(match=_A + "test_static_region_resizes_and_teardown_with_live_tensors", part=1, expected_s=13,
                timeout_s=60, needs=_ALLOC, what="the static region re-sized around a live dynamic block; teardown "
                                                 "with live tensors under the static allocator"),
    # then the cheap, high-value checks: a wrong analyzer, a lossy VAE chain or a bad fingerprint voids the rest
    PlannedTest(match=_Z + "flux2/1024x1024x1/s", part=1, expected_s=13, timeout_s=90, device_gb=FLUX2_WHOLE_GB,
                what="analyzer vs max_memory_allocated, Flux.2 1024² 2 steps"),
    PlannedTest(match="tests/gpu/test_vae_chain_gpu.py::", part=1, expected_s=21, timeout_s=90, device_gb=24,
                what="CogVideoX VAE chain lossless on CUDA (the VAE alone)"),
    PlannedTest(match="tests/parallel/test_sp_gpu.py::test_cuda_fingerprint_names_the_gpu", part=1,
                expected_s=7, timeout_s=60, what="the CUDA platform's NVML fingerprint"),
    PlannedTest(match=_Z + "cogvideox-5b/", part=1, expected_s=40, timeout_s=120, device_gb=40,
                what="analyzer vs max_memory_allocated, CogVideoX-5B 2 steps (analyzer peak 27.4 GB)"),
    # part 2 (after a warm prep): the reference-image analyzer, residency
    PlannedTest(match=_Z + "flux2/1024x1024x1/ref", part=2, expected_s=16, timeout_s=90, device_gb=FLUX2_WHOLE_GB,
                what="analyzer vs max_memory_allocated, Flux.2 1024² with one 1024² reference image, 2 steps"),
    PlannedTest(match="tests/gpu/test_residency_gpu.py::", part=2, expected_s=62, timeout_s=220, needs=("shm",),
                device_gb=FLUX2_WHOLE_GB,
                what="Flux.2 1024² under the 48 GB cap: planned / layerwise / no offload within the host-pin budget"),
    PlannedTest(match="tests/gpu/test_warm_load_gpu.py::", part=2, expected_s=7, timeout_s=60, needs=("shm",),
                device_gb=4, what="the warm load: 1 GiB host copy -> device from page-locked memory, GB/s vs pageable"),
    # part 3: what the 900 s leave out (a later run: `--part 3`)
    PlannedTest(match="tests/gpu/test_seeded_weights_gpu.py::", part=3, expected_s=13, timeout_s=60, device_gb=8,
                what="seeded weights filled on the GPU = the CPU build's bytes (one Flux.2 block); host bytes pinned"),
    PlannedTest(match="tests/parallel/test_sp_gpu.py::test_sp2_matches_sp1_over_nccl", part=3, expected_s=6,
                timeout_s=120, what="SP=2 vs SP=1 over NCCL (skips on one GPU: the check's machine has one)"),
    PlannedTest(match=_Z + "cogvideox-5b-i2v", part=3, expected_s=40, timeout_s=120, device_gb=40,
                what="analyzer vs max_memory_allocated, CogVideoX-5B-I2V 720x480x49 + first frame, 2 steps"),
    PlannedTest(match="tests/mitigation/test_offload_gpu.py::", part=3, expected_s=36, timeout_s=120,
                device_gb=FLUX2_WHOLE_GB, what="Flux.2 1024² step latency: no / selective / layerwise offload (Figure 4)"),
    PlannedTest(match=_Z + "wan2.2-i2v-a14b", part=3, expected_s=60, timeout_s=240, device_gb=75,
                what="analyzer vs max_memory_allocated, Wan2.2-I2V-A14B 832x480x49 + first frame, 2 steps (both experts, "
                     "57 GB of weights)"),
    PlannedTest(match=_Z + "wan2.2-ti2v-5b", part=3, expected_s=45, timeout_s=180, device_gb=40,
                what="analyzer vs max_memory_allocated, Wan2.2-TI2V-5B 1280x704x49 + first frame, 2 steps"),
    PlannedTest(match="tests/gpu/test_quality_psnr_gpu.py::", part=3, expected_s=60, timeout_s=240, device_gb=40,
                files=("quality_psnr.json",),
                what="quality tier fast vs lossless on CogVideoX-5B 720x480x9, 20 steps: PSNR, wall times, cached bytes"),
    PlannedTest(match="tests/gpu/test_lora_gpu.py::", part=3, expected_s=40, timeout_s=150, device_gb=16,
                files=("lora_gpu.json",),
                what="per-sample LoRA on CUDA: batch {A, B, none, A+B} vs diffusers' merge; a Flux.2 single "
                     "block with 4 rank-64 adapters vs none"),
    PlannedTest(match="tests/gpu/test_preemption_gpu.py::", part=3, expected_s=89, timeout_s=200, device_gb=48,
                what="CogVideoX-5B pause/resume bitwise, state on device and on the host"),
    PlannedTest(match="tests/gpu/test_planner_measured_gpu.py::", part=3, expected_s=113, timeout_s=240,
                device_gb=FLUX2_WHOLE_GB, what="measured planning of Flux.2 1024² and CogVideoX-5B 720x480x49"),
)

_MARKER_KEYS = ("part", "expected_s", "timeout_s", "needs", "files", "what", "device_gb")


def plan_for(nodeid: str, marker: dict[str, object] | None = None) -> tuple[int, PlannedTest]:
    """(priority, row) of a collected test: the first row whose ``match`` starts its id, else the
    figures its ``gpu`` marker gives (keyword arguments), else ``UNPLANNED``."""
    for i, entry in enumerate(PLAN):
        if nodeid.startswith(entry.match):
            return i, entry
    kw = {k: v for k, v in (marker or {}).items() if k in _MARKER_KEYS}
    if not kw:
        return len(PLAN), UNPLANNED
    fields = {"part": UNPLANNED.part, "expected_s": UNPLANNED.expected_s, "timeout_s": UNPLANNED.timeout_s} | kw
    return len(PLAN), PlannedTest(
        match=nodeid, part=int(fields["part"]), expected_s=float(fields["expected_s"]),  # type: ignore[arg-type]
        timeout_s=float(fields["timeout_s"]), needs=tuple(fields.get("needs", ())),  # type: ignore[arg-type]
        files=tuple(fields.get("files", ())), what=str(fields.get("what", "from its gpu marker")),  # type: ignore[arg-type]
        device_gb=float(fields.get("device_gb", 0.0)))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Timeline:
    """The two device calls laid out in the device time, machine start counted. Each call's own
    seconds are its prep, its collection and its tests (``call1_s``, ``call2_s``); its window runs
    from the command's start to its ``--until``."""

    start: float  # unix time the first call is sent
    part1_expected_s: float
    part2_expected_s: float

    @property
    def call1_from(self) -> float:
        return self.start + MACHINE_START_S

    @property
    def call1_s(self) -> float:
        """Call 1's expected seconds: a cold prep, the collection, part 1's tests."""
        return PREP_COLD_S + COLLECT_S + self.part1_expected_s

    @property
    def until1(self) -> int:
        """Part 1 starts no test that cannot finish by then: its expected seconds from the command's
        start, never past the command's limit."""
        return int(min(self.call1_from + self.call1_s, self.call1_from + COMMAND_LIMIT_S - RETURN_S))

    @property
    def call2_from(self) -> float:
        """If call 2 lands while the machine is warm (else a new start and a cold prep eat into part 2)."""
        return self.until1 + RETURN_S + TURNAROUND_S

    @property
    def call2_s(self) -> float:
        """Call 2's expected seconds: a warm prep, the collection, part 2's tests."""
        return PREP_WARM_S + COLLECT_S + self.part2_expected_s

    @property
    def until2(self) -> int:
        """Part 2 starts no test that cannot finish by then: the device time, less the
        last return and a margin for the end of the device time and clock drift."""
        return int(self.start + DEVICE_S - RETURN_S - END_MARGIN_S)

    def window_s(self, part: int) -> float:
        """Seconds from the part's command start to its ``--until``."""
        return self.until1 - self.call1_from if part == 1 else self.until2 - self.call2_from

    def expected_s(self, part: int) -> float:
        return self.call1_s if part == 1 else self.call2_s

    @property
    def part2_window_cold_s(self) -> float:
        """Part 2's tests' seconds if call 2 finds the machine gone (a new start and a cold prep)."""
        return self.until2 - (self.call2_from + MACHINE_START_S + PREP_COLD_S + COLLECT_S)

    def rows(self) -> list[tuple[str, float, float]]:
        """(what, from, to) in seconds after the first call, for --list."""
        c1, u1 = self.call1_from - self.start, self.until1 - self.start
        c2, u2 = self.call2_from - self.start, self.until2 - self.start
        return [("call 1: machine start + transfer", 0, c1),
                ("call 1: gpu_prep.sh (cold)", c1, c1 + PREP_COLD_S),
                ("call 1: collection", c1 + PREP_COLD_S, c1 + PREP_COLD_S + COLLECT_S),
                ("call 1: part 1 tests (--until)", c1 + PREP_COLD_S + COLLECT_S, u1),
                ("call 1: return", u1, u1 + RETURN_S),
                ("between the calls (warm window)", u1 + RETURN_S, c2),
                ("call 2: gpu_prep.sh (warm)", c2, c2 + PREP_WARM_S),
                ("call 2: collection", c2 + PREP_WARM_S, c2 + PREP_WARM_S + COLLECT_S),
                ("call 2: part 2 tests (--until)", c2 + PREP_WARM_S + COLLECT_S, u2),
                ("call 2: return", u2, u2 + RETURN_S),
                ("end margin (clock drift)", u2 + RETURN_S, DEVICE_S)]
