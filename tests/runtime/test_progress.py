"""The engine's step hook on the tiny models (CPU): every finished step is reported in order, the
decode after the last one, and an observer's stop ends the batch at that step boundary."""

from __future__ import annotations

import pytest

from xema_ray.plan import ExecutionConfig
from xema_ray.runtime import Batch, ExecutionEngine, GenerationRequest
from xema_ray.runtime.progress import BatchCancelled, step_callback
from xema_ray.templates import RequestTemplate

T = RequestTemplate(model="tiny-cogvideox", height=48, width=64, frames=9, steps=4)


class Recorder:
    def __init__(self, stop_at: int | None = None) -> None:
        self.events: list[object] = []
        self.stop_at = stop_at

    def on_step(self, step: int, total: int) -> bool:
        self.events.append((step, total))
        return step == self.stop_at

    def on_decoded(self) -> None:
        self.events.append("decoded")


#: the model of the module's engine (tests/runtime/conftest.py)
ENGINE_MODELS = [T.model]


def _batch(seed: int) -> Batch:
    return Batch(config=ExecutionConfig(template=T),
                 requests=(GenerationRequest(request_id="a", prompt="waves", seed=seed),), steps=T.steps)


def test_every_step_then_the_decode_is_reported(engine: ExecutionEngine) -> None:
    rec = Recorder()
    plain = engine.execute(_batch(1))
    observed = engine.execute(_batch(1), rec)
    assert rec.events == [(1, 4), (2, 4), (3, 4), (4, 4), "decoded"]
    assert observed.outputs[0].data == plain.outputs[0].data  # observing changes nothing


def test_stop_ends_the_batch_at_the_step_boundary(engine: ExecutionEngine) -> None:
    rec = Recorder(stop_at=2)
    with pytest.raises(BatchCancelled) as info:
        engine.execute(_batch(2), rec)
    assert info.value.step == 2 and rec.events == [(1, 4), (2, 4)]
    again = Recorder()
    assert engine.execute(_batch(2), again).outputs and again.events[-1] == "decoded"  # the pipeline is reusable


def test_no_observer_adds_no_pipeline_kwargs() -> None:
    assert step_callback(object(), None, 4) == {}
