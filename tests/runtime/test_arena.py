"""The static allocator's arena follows the template a worker runs (xema_ray.runtime.arena): the
static region shrinks before a residency switch brings weights in and grows after weights left,
one dynamic region serves the group. Driven through the C++ allocator's host backend (the same
functions a CUDA worker calls) with a fake residency holding the reference table's weights."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from tests.host_arena import alloc, device  # noqa: F401 - fixtures
from xema_ray.allocator.margins import (
    ALLOCATION_BLOCK,
    DYNAMIC_FRACTION,
    MIN_DYNAMIC_BYTES,
    dynamic_region_bytes,
    fits_with_layout,
    group_dynamic_bytes,
)
from xema_ray.allocator.runtime import StaticAllocator
from xema_ray.allocator.solver import solve_arrays
from xema_ray.runtime.arena import ArenaEntry, TemplateArena

GB = 10**9
BUDGET = 48 * GB

#: bench/results/verify-a6000x8.json (plans/a6000x8.json, one 48 GB RTX A6000 per worker): per entry
#: (load_peak_bytes = the weights its load places on the device, static_reserved_bytes)
GROUPS: dict[str, dict[str, tuple[int, int]]] = {
    "cogvideox-5b": {
        "1280x720x49": (11_571_816_960, 26_102_970_368),
        "1280x720x65": (11_571_816_448, 26_137_991_168),
        "1280x720x81": (11_571_816_448, 26_218_631_168),
        "1600x896x49": (11_571_816_448, 27_304_583_168),
        "1600x896x65": (11_571_816_448, 27_482_349_568),
        "1600x896x81": (11_571_816_448, 27_496_275_968),
        "1920x1088x49": (3_375_515_648, 39_744_462_848),
        "1920x1088x65": (3_375_515_648, 39_865_376_768),
        "1920x1088x81": (3_375_515_648, 39_923_867_648),
    },
    "flux2": {
        "1024x1024x1": (21_430_102_528, 26_029_169_664),
        "1280x1280x1": (21_430_102_016, 26_316_205_056),
        "2048x2048x1": (15_541_293_056, 31_027_927_552),
        "256x256x1": (21_430_102_016, 25_874_048_512),
        "512x512x1": (21_430_102_016, 25_883_555_328),
        "768x768x1": (21_430_102_016, 26_140_890_624),
    },
    "ltx2": {
        "1280x704x49": (41_733_677_056, 5_780_321_280),
        "1280x704x65": (40_189_378_048, 6_639_476_736),
        "1280x704x81": (39_417_228_800, 7_863_388_672),
        "1920x1088x49": (36_328_633_856, 10_470_062_592),
        "1920x1088x65": (33_240_036_864, 13_303_930_368),
        "1920x1088x81": (30_151_439_872, 16_137_792_000),
        "864x480x49": (41_733_676_544, 5_780_321_280),
        "864x480x65": (41_733_676_544, 5_780_321_280),
        "864x480x81": (41_733_676_544, 5_780_321_280),
    },
}


def round_down(n: int) -> int:
    return n // ALLOCATION_BLOCK * ALLOCATION_BLOCK


class Device:
    """The budget check at every moment: weights (the fake residency's, outside the allocator) plus
    everything the allocator holds (arena and driver blocks). During a resize the weights stand
    still and the allocator's peak is read; during a residency move the arena stands still."""

    def __init__(self, alloc: StaticAllocator, device: int, weights: int) -> None:
        self.alloc, self.device, self.weights = alloc, device, weights
        self.peak = 0

    def check(self, reserved: int) -> None:
        self.peak = max(self.peak, self.weights + reserved)
        assert self.weights + reserved <= BUDGET, (
            f"{self.weights / GB:.2f} GB weights + {reserved / GB:.2f} GB allocator > {BUDGET / GB:.0f} GB")

    # the allocator as TemplateArena sees it, with the check around each resize
    def reserve(self, static_bytes: int, dynamic_bytes: int | None = None, *, device: int = 0) -> None:
        self.alloc.reserve(static_bytes, dynamic_bytes, device=device)
        self.check(self.alloc.stats(device=device).reserved_bytes)

    def resize_static(self, static_bytes: int, *, device: int = 0) -> None:
        self.alloc.reset_peaks(device=device)
        self.alloc.resize_static(static_bytes, device=device)
        self.check(self.alloc.stats(device=device).peak_reserved_bytes)

    def stats(self, *, device: int = 0):  # type: ignore[no-untyped-def]
        return self.alloc.stats(device=device)

    def move_weights(self, target: int, chunk: int = GB // 2) -> int:
        """The residency switch: blocks leave the device before others come (ResidencyManager.switch)."""
        reserved = self.alloc.stats(device=self.device).reserved_bytes
        moved = 0
        for goal in (min(self.weights, target), target):
            while self.weights != goal:
                step = min(chunk, abs(goal - self.weights))
                self.weights += step if goal > self.weights else -step
                moved += step
                self.check(reserved)
        return moved


def group_arena(alloc: StaticAllocator, device: int, model: str) -> tuple[TemplateArena, Device]:
    entries = {k: ArenaEntry(loaded, static) for k, (loaded, static) in GROUPS[model].items()}
    first = sorted(entries)[0]
    dev = Device(alloc, device, weights=entries[first].loaded_bytes)  # the load placed the first plan's weights
    arena = TemplateArena(dev, entries, BUDGET, device=device)
    arena.reserve()
    return arena, dev


@pytest.mark.parametrize("model", sorted(GROUPS))
def test_one_arena_for_the_largest_static_region_would_exceed_the_budget(model: str) -> None:
    # the defect this module fixes: worst weights + the group's one arena (largest static + 5 %)
    entries = GROUPS[model].values()
    worst = max(loaded for loaded, _ in entries)
    largest = max(static for _, static in entries)
    assert worst + largest + dynamic_region_bytes(largest) > BUDGET
    assert all(loaded + static <= BUDGET for loaded, static in entries)  # while each entry alone fits


@pytest.mark.parametrize("model", sorted(GROUPS))
def test_template_switches_never_exceed_the_budget(alloc: StaticAllocator, device: int, model: str) -> None:
    arena, dev = group_arena(alloc, device, model)
    assert not arena.unfit, arena.describe()  # every entry of the reference table fits with the group's region
    keys = sorted(GROUPS[model])
    rng = np.random.default_rng(0)
    # every ordered pair of templates at least once, then random switches
    sequence = [k for a, b in itertools.permutations(keys, 2) for k in (a, b)]
    sequence += [keys[i] for i in rng.integers(len(keys), size=60)]
    for key in sequence:
        loaded, static = GROUPS[model][key]
        out = arena.switch(key, lambda loaded=loaded: dev.move_weights(loaded))  # type: ignore[misc]
        assert out.not_armed is None, out.not_armed
        assert out.static_bytes >= static  # the batch's plan fits the region it arms
        dev.check(alloc.stats(device=device).reserved_bytes)
    stats = alloc.stats(device=device)
    assert stats.dynamic_region_bytes == arena.dynamic_bytes  # reserved once, never re-sized
    assert dev.peak <= BUDGET and arena.resizes > 0


def test_batches_without_a_layout_get_no_static_region(alloc: StaticAllocator, device: int) -> None:
    arena, dev = group_arena(alloc, device, "cogvideox-5b")
    loaded, _ = GROUPS["cogvideox-5b"]["1920x1088x81"]
    arena.switch("1920x1088x81", lambda: dev.move_weights(loaded))
    out = arena.switch(None, lambda: dev.move_weights(GROUPS["cogvideox-5b"]["1280x720x49"][0]))  # e.g. a resumed batch
    assert (out.not_armed, out.static_bytes) == (None, 0)


def test_dynamic_region_blocks_survive_the_switches(alloc: StaticAllocator, device: int) -> None:
    arena, dev = group_arena(alloc, device, "ltx2")
    workspace = alloc.malloc(32 << 20, device=device)  # what warm_up leaves there (cuBLAS)
    for key in ("1920x1088x81", "864x480x49", "1920x1088x49"):
        arena.switch(key, lambda key=key: dev.move_weights(GROUPS["ltx2"][key][0]))  # type: ignore[misc]
        assert alloc.stats(device=device).dynamic_active_bytes == 32 << 20
    alloc.free(workspace, device=device)


def test_batch_not_armed_while_a_static_block_is_live(alloc: StaticAllocator, device: int) -> None:
    arena, dev = group_arena(alloc, device, "flux2")
    loaded, static = GROUPS["flux2"]["2048x2048x1"]
    arena.switch("2048x2048x1", lambda: dev.move_weights(loaded))
    plan = solve_arrays(np.array([4096]), np.array([0]), np.array([1])).replay_plan()
    with alloc.armed(plan, device=device):
        kept = alloc.malloc(4096, device=device)  # a tensor of that batch still alive (not moved to the host)
    target, target_static = GROUPS["flux2"]["1280x1280x1"]
    out = arena.switch("1280x1280x1", lambda: "moved")  # the weights would come in next to 31 GB: not moved here
    assert out.moved == "moved" and out.not_armed is not None
    assert "static blocks are still live" in out.not_armed
    assert "could not be re-sized" in out.not_armed and "live bytes in 1 block" in out.not_armed
    assert "over the 48.00 GB budget" in out.not_armed  # said where it cannot be prevented
    assert out.static_bytes == static  # refused: the block's memory stays valid
    alloc.free(kept, device=device)
    out = arena.switch("1280x1280x1", lambda: dev.move_weights(target))  # the next batch: the region follows again
    assert out.not_armed is None and out.static_bytes == target_static


def test_entry_that_cannot_fit_is_named_and_never_armed(alloc: StaticAllocator, device: int) -> None:
    entries = {"small": ArenaEntry(40 * GB, 6 * GB), "full": ArenaEntry(44 * GB, 3_950_000_000)}
    arena = TemplateArena(alloc, entries, BUDGET, device=device)
    # "full" leaves 50 MB, under the floor: it does not shrink the others' region, and it runs disarmed
    assert arena.dynamic_bytes == round_down(min(dynamic_region_bytes(6 * GB), 2 * GB))
    assert set(arena.unfit) == {"full"} and "> the 48.00 GB budget" in arena.unfit["full"]
    assert "1 of 2 layout(s) armed per batch" in arena.describe() and "full: 44.00 GB weights" in arena.describe()
    arena.reserve()
    out = arena.switch("full", lambda: None)
    assert out.not_armed is not None and "does not fit" in out.not_armed and out.static_bytes == 0


def test_group_dynamic_bytes_for_the_reference_groups() -> None:
    sized = {m: group_dynamic_bytes(g.values(), BUDGET) for m, g in GROUPS.items()}
    # CogVideoX: 5 % of 39.9 GB; Flux.2 and LTX-2: what the budget leaves next to their largest entry
    assert sized["cogvideox-5b"] == round_down(dynamic_region_bytes(39_923_867_648))
    assert sized["flux2"] == round_down(BUDGET - (21_430_102_016 + 26_316_205_056))
    assert sized["ltx2"] == round_down(BUDGET - (41_733_677_056 + 5_780_321_280))
    for m, g in GROUPS.items():
        assert all(fits_with_layout(loaded, static, sized[m], BUDGET) for loaded, static in g.values())


def test_group_dynamic_bytes_floor_and_unknown_budget() -> None:
    assert group_dynamic_bytes([(0, 10 * GB)]) == round_down(int(10 * GB * DYNAMIC_FRACTION))
    assert group_dynamic_bytes([(0, 1 << 20)]) == MIN_DYNAMIC_BYTES  # never under the floor
    assert group_dynamic_bytes([(47 * GB, 2 * GB)], BUDGET) == MIN_DYNAMIC_BYTES  # nothing fits: the floor
    # a small budget (the tiny models' tables): the floor is 1/64 of it, not 128 MiB
    assert group_dynamic_bytes([(10 * 2**20, 20 * 2**20)], 96 * 10**6) == 96 * 10**6 // 64 // ALLOCATION_BLOCK * ALLOCATION_BLOCK
    with pytest.raises(ValueError, match="at least one"):
        group_dynamic_bytes([], BUDGET)


# ---------------------------------------------------------------- a real worker (CPU) with the host allocator


def test_worker_arena_follows_the_templates_it_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A CPU worker's tensors never reach the pluggable allocator (it is CUDA's), so nothing is
    # placed in the host arena; what runs is the worker's own sequence: the group's dynamic region
    # at load, then per batch the static region re-sized around the real residency switch and the
    # batch's plan armed on it (arming fails if the region is smaller than the plan).
    from xema_ray import hash_seed
    from xema_ray.parallel.groups import ParallelConfig
    from xema_ray.plan import ExecutionConfig, Mitigation
    from xema_ray.runtime.engine import Batch, GenerationRequest
    from xema_ray.allocator.artifact import save_artifact
    from xema_ray.measure.layout_solve import solve_entry_layout
    from xema_ray.runtime.pause import PausedRun
    from xema_ray.runtime.worker import ModelLoadConfig, Worker
    from xema_ray.templates import RequestTemplate

    def offload(blocks: tuple[int, ...]) -> tuple[Mitigation, ...]:
        return (Mitigation(kind="block_offload", blocks=blocks, intensity=len(blocks)),)

    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2)
    small = ExecutionConfig(template=t, mitigations=offload((0, 1)))
    large = ExecutionConfig(template=t.with_(width=128, height=128), mitigations=offload((1, 2)))
    plain = ExecutionConfig(template=t.with_(width=96, height=96))  # no layout
    folder = tmp_path / "t.layouts"
    arts = {}
    for c in (small, large):
        art = solve_entry_layout(c, gpu="any")
        save_artifact(art, folder)
        arts[c.template.key] = art
    small, large = (c.model_copy(update={"layout_ref": arts[c.template.key].layout_id}) for c in (small, large))
    budget = max(a.loaded_bytes + a.reserved_bytes for a in arts.values()) + MIN_DYNAMIC_BYTES

    monkeypatch.setattr(hash_seed, "seeded", lambda: True)  # no CUDA stream to match on a CPU
    alloc = StaticAllocator("host")
    w = Worker(platform="cpu")
    w.allocator, w.arm_layout = alloc, w._arm
    w.init_device(ParallelConfig(rank=0, world_size=1))
    try:
        loaded = w.load_model(ModelLoadConfig(model=t.model, plans=(small, large, plain), layouts_dir=folder,
                                              budget_bytes=budget))
        assert loaded.layout_status is not None and loaded.layout_status.startswith("2 of 2 layout(s) armed per batch")
        # a budget of ~140 MB: the floor is 1/64 of it, the region 5 % of the larger static region at least
        dyn = group_dynamic_bytes([(a.loaded_bytes, a.reserved_bytes) for a in arts.values()], budget)
        assert budget // 64 - ALLOCATION_BLOCK <= dyn < MIN_DYNAMIC_BYTES
        assert alloc.stats().static_region_bytes == 0 and alloc.stats().dynamic_region_bytes == dyn
        seen = []
        for c in (small, large, small, plain, large):
            out = w.execute(Batch(config=c, requests=(GenerationRequest(request_id="r", prompt="a fox", seed=1),), steps=c.template.steps))
            assert out.layout_note is None
            assert out.layout_armed == (c.layout_ref is not None)
            seen.append(alloc.stats().static_region_bytes)
        s, g = arts[small.template.key].reserved_bytes, arts[large.template.key].reserved_bytes
        # grown for each larger plan, kept where it still fits next to the weights, none without a layout
        assert seen == [s, g, g, 0, g]
        assert alloc.stats().dynamic_region_bytes == dyn
        # preemption: an armed batch parks with its state on the host (none left in the static
        # region), another template runs, the paused one resumes disarmed with no static region
        w.pause("p")
        paused = w.execute(Batch(config=large, requests=(GenerationRequest(request_id="p", prompt="a fox", seed=2),), steps=large.template.steps),
                           run_id="p")
        assert isinstance(paused, PausedRun) and paused.offloaded
        assert alloc.stats().static_active_bytes == 0
        out = w.execute(Batch(config=small, requests=(GenerationRequest(request_id="q", prompt="a fox", seed=3),), steps=small.template.steps))
        assert out.layout_armed and out.layout_note is None
        resumed = w.resume("p")
        assert not isinstance(resumed, PausedRun) and resumed.pauses == 1
        assert alloc.stats().static_region_bytes == 0
    finally:
        alloc.disarm()
        alloc.release()
