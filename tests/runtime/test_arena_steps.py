"""A request's own step count on a template with a static layout: the worker arms the layout's
step window repeated to that count (same reserved bytes) where it repeats to it (at least the
solved steps, the same parity), and runs the batch on the dynamic region, saying why, where it
does not. A CPU worker with the host allocator, as ``test_arena.py``'s."""

from __future__ import annotations

from pathlib import Path

import pytest

from xema_ray.allocator.margins import MIN_DYNAMIC_BYTES
from xema_ray.allocator.runtime import StaticAllocator


def test_a_layout_serves_the_step_counts_its_window_repeats_to(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from xema_ray import hash_seed
    from xema_ray.allocator.artifact import save_artifact
    from xema_ray.measure.layout_solve import solve_entry_layout
    from xema_ray.parallel.groups import ParallelConfig
    from xema_ray.plan import ExecutionConfig
    from xema_ray.runtime.engine import Batch, GenerationRequest
    from xema_ray.runtime.worker import ModelLoadConfig, Worker
    from xema_ray.templates import RequestTemplate

    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=10)  # 10 steps: solved as 6, repeated
    art = solve_entry_layout(ExecutionConfig(template=t), gpu="any")
    assert art.step_repeat is not None and art.step_repeat.solved_steps == 6
    assert art.plan_for_steps(50) is not None and art.plan_for_steps(4) is None and art.plan_for_steps(9) is None
    folder = tmp_path / "t.layouts"
    save_artifact(art, folder)
    config = ExecutionConfig(template=t, layout_ref=art.layout_id)

    monkeypatch.setattr(hash_seed, "seeded", lambda: True)  # no CUDA stream to match on a CPU
    alloc = StaticAllocator("host")
    w = Worker(platform="cpu")
    w.allocator, w.arm_layout = alloc, w._arm
    w.init_device(ParallelConfig(rank=0, world_size=1))
    try:
        w.load_model(ModelLoadConfig(model=t.model, plans=(config,), layouts_dir=folder,
                                     budget_bytes=art.loaded_bytes + art.reserved_bytes + MIN_DYNAMIC_BYTES))
        armed = {}
        for steps in (t.steps, 12, 4, 9):
            out = w.execute(Batch(config=config, steps=steps,
                                  requests=(GenerationRequest(request_id="r", prompt="a fox", seed=1),)))
            armed[steps] = (out.layout_armed, out.layout_note)
            assert alloc.stats().static_region_bytes == (art.reserved_bytes if out.layout_armed else 0)
        assert armed[t.steps] == (True, None) and armed[12] == (True, None)
        for steps in (4, 9):
            assert armed[steps][0] is False and f"does not repeat to {steps}" in (armed[steps][1] or "")
    finally:
        alloc.disarm()
        alloc.release()
