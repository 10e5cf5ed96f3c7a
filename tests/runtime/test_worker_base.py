"""The worker interface both workers implement, and the preemptible runs' bookkeeping they share:
a pause that overtakes its batch parks it at the first boundary, a pause after the batch ended
is answered False, only a parked run resumes."""

from __future__ import annotations

from typing import Any

import pytest

from xema_ray.runtime.emulated import EmulatedWorker
from xema_ray.runtime.engine import Batch, BatchResult, GenerationRequest, PhaseTimings
from xema_ray.runtime.pause import PausedRun
from xema_ray.runtime.worker import Worker
from xema_ray.runtime.worker_base import WorkerBase
from xema_ray.platforms import MemoryStats
from xema_ray.plan import ExecutionConfig
from xema_ray.templates import RequestTemplate

T = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=3)
BATCH = Batch(config=ExecutionConfig(template=T), requests=(GenerationRequest(request_id="r", prompt="a fox", seed=0),), steps=T.steps)


class _Steps(WorkerBase):
    """A worker whose batch is ``steps`` boundaries and nothing else."""

    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.steps = steps

    def device_topology(self, local_index: int = 0) -> tuple[str, list[str]]:
        return "steps", []

    def init_device(self, parallel: Any, local_index: int = 0) -> None:
        pass

    def load_model(self, load: Any) -> Any:
        return None

    def _loaded(self) -> bool:
        return True

    def _run_batch(self, batch: Batch, observer: Any, control: Any) -> BatchResult:
        for step in range(1, self.steps + 1):
            if control is not None and control.wants_pause() and step < self.steps:
                control.hold(step, self.steps, 0, control.offload_requested(), 0.0)
        return BatchResult(template=batch.config.template.key, config_hash=batch.config.config_hash(), sp_rank=0,
                           outputs=[], timings=PhaseTimings(text_s=0, denoise_s=0, decode_s=0, encode_s=0, total_s=0),
                           memory=MemoryStats(source="none", peak_bytes=0, current_bytes=0), mitigations=0,
                           layout_armed=False)

    def layout_reserved_bytes(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass


def test_both_workers_implement_the_interface() -> None:
    assert issubclass(Worker, WorkerBase) and issubclass(EmulatedWorker, WorkerBase)
    with pytest.raises(TypeError, match="abstract"):
        WorkerBase()  # type: ignore[abstract]


def test_the_shared_bookkeeping_of_preemptible_runs() -> None:
    w = _Steps()
    assert w.pause("early", offload=False) is True  # the pause overtook its batch
    paused = w.execute(BATCH, run_id="early")
    assert isinstance(paused, PausedRun) and paused.step == 1 and w.paused_runs() == [paused]
    done = w.resume("early")
    assert isinstance(done, BatchResult) and done.pauses == 1 and w.paused_runs() == []
    assert w.pause("early") is False  # ended: a late pause finds nothing to park
    with pytest.raises(ValueError, match="not paused"):
        w.resume("early")
    assert isinstance(w.execute(BATCH), BatchResult)  # no run id: not preemptible
