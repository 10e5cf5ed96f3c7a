"""GPU check of step-level preemption (run by `make gpu-check`): CogVideoX-5B 720×480×49 (real
config, random bf16 weights, 6 steps) on one worker; the batch is paused at step 2 with its state
kept on the device and, again, moved to pinned host memory, while a short batch of another
template (720×480×9) runs on the same pipeline. Checks outputs bitwise equal to an
uninterrupted run, device memory freed by the host move (≥ the state bytes the worker reports),
the pause's own cost, and the paused state vs the planner's figure (``planner.pause_state``).
Results go to $XEMA_GPU_OUT/preemption_cogvideox_480p.json."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.runtime.pause import PausedRun
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.gpu

LONG = RequestTemplate(model="cogvideox-5b", width=720, height=480, frames=49, steps=6)
SHORT = RequestTemplate(model="cogvideox-5b", width=720, height=480, frames=9, steps=2)


class _PauseAt:
    def __init__(self, w: Worker, run_id: str, step: int, offload: bool, seen: dict) -> None:
        self.w, self.run_id, self.step, self.offload, self.seen = w, run_id, step, offload, seen

    def on_step(self, step: int, total: int) -> bool:
        if step == self.step:
            torch.cuda.synchronize()
            self.seen["before"] = torch.cuda.memory_allocated()
            self.w.pause(self.run_id, self.offload)
        return False

    def on_decoded(self) -> None:
        pass


def _batch(t: RequestTemplate, seed: int) -> Batch:
    return Batch(config=ExecutionConfig(template=t), requests=(GenerationRequest(request_id=f"g{seed}", prompt="waves", seed=seed),), steps=t.steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pause_resume_on_the_gpu_is_bitwise_and_frees_the_state_when_offloaded() -> None:
    from planner.pause_state import with_pause_bytes
    from planner.traces import TraceCache
    from bench.scenarios.factories import plan_entry

    torch.cuda.set_per_process_memory_fraction(min(1.0, 48e9 / torch.cuda.get_device_properties(0).total_memory))
    try:
        w = Worker(platform="cuda")
        w.init_device(ParallelConfig(rank=0, world_size=1))
        w.load_model(ModelLoadConfig(model="cogvideox-5b", text_encoder="none"))
        ref_long, ref_short = w.execute(_batch(LONG, 1)), w.execute(_batch(SHORT, 2))
        t0 = time.perf_counter()
        w.execute(_batch(LONG, 1))
        plain_s = time.perf_counter() - t0
        results: dict = {"template": LONG.key, "uninterrupted_s": plain_s}
        for offload in (False, True):
            seen: dict = {}
            run_id = f"long-{offload}"
            t0 = time.perf_counter()
            paused = w.execute(_batch(LONG, 1), _PauseAt(w, run_id, 2, offload, seen), run_id=run_id)
            assert isinstance(paused, PausedRun)
            torch.cuda.synchronize()
            after = torch.cuda.memory_allocated()
            between = w.execute(_batch(SHORT, 2))
            done = w.resume(run_id)
            total_s = time.perf_counter() - t0
            assert not isinstance(done, PausedRun)
            assert done.outputs[0].data == ref_long.outputs[0].data
            assert between.outputs[0].data == ref_short.outputs[0].data
            freed = seen["before"] - after
            if offload:
                assert freed >= 0.9 * paused.state_bytes
            results["offload" if offload else "on_device"] = {
                "state_bytes": paused.state_bytes, "device_bytes_freed_by_pause": freed, "pause_s": paused.pause_s,
                "total_with_short_batch_s": total_s, "short_batch_s": between.timings.total_s}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    entry = plan_entry(LONG, peak_bytes=0, latency_s=1, goodput_rps=0, slo_s=10, latency_source="estimated")
    results["planned_pause_bytes"] = with_pause_bytes(entry, TraceCache()).prediction.pause_bytes
    out = Path(os.environ.get("XEMA_GPU_OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "preemption_cogvideox_480p.json").write_text(json.dumps(results, indent=1))
    assert results["on_device"]["state_bytes"] <= results["planned_pause_bytes"]
