"""A template served at another step count than it was planned for (``num_inference_steps`` per
request) needs no other plan: the serving worker's own batch, run through the request path
(``Batch.steps``) on the meta device and counted as ``xema verify`` counts it, peaks at the same
bytes at 4 and at 50 steps, and at what ``xema verify`` reports for the template."""

from __future__ import annotations

import pytest
import torch

from xema_ray.analyzer.assembly import assembled
from xema_ray.analyzer.tracer import AllocationTracer
from xema_ray.measure.verify import LOAD_END, device_peaks, verify_config
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate


def _served_peak(config: ExecutionConfig, steps: int) -> tuple[int, int]:
    """(device peak, steps the pipeline ran) of one batch of ``config`` asked for ``steps`` steps."""
    from xema_ray.parallel.groups import ParallelConfig
    from xema_ray.placement import forget_placeholders

    forget_placeholders("meta")
    tracer = AllocationTracer("meta", {})
    worker = Worker(platform="meta")
    ran: list[int] = []
    try:
        batch = Batch(config=config, steps=steps,
                      requests=tuple(GenerationRequest(request_id=f"r{i}", prompt="a photo of a cat", seed=i,
                                                       negative_prompt="blurry" if i == 0 else None)
                                     for i in range(config.batch)))
        with torch.no_grad(), tracer:
            worker.init_device(ParallelConfig(rank=0, world_size=1))
            worker.load_model(ModelLoadConfig(model=config.template.model, plans=(config,)))
            tracer.mark(LOAD_END)
            assert worker.engine is not None
            pipe = worker.engine.pipe
            # one transformer call per step (CogVideoX runs its CFG pair as one batch)
            pipe.transformer.register_forward_hook(lambda *_: ran.append(1))
            engine = worker.engine
            # as ``xema verify`` runs the worker (``measure.verify._run_worker``): the analyzer's shims
            with assembled(pipe, tracer, "meta", markers=False, replay_blocks=False,
                           beneath=lambda install: setattr(engine, "inner_env", install)):
                worker.execute(batch)
    finally:
        worker.shutdown()
    return device_peaks(tracer.raw())[0], len(ran)


@pytest.mark.parametrize("model", ["tiny-cogvideox"])
def test_verified_peak_is_the_same_at_4_and_50_steps(model: str) -> None:
    t = RequestTemplate(model=model, width=64, height=64, frames=9, steps=4)
    config = ExecutionConfig(template=t, batch=2)
    verified = verify_config(config, budget_bytes=10**12).device_peak_bytes
    at_4, ran_4 = _served_peak(config, 4)
    at_50, ran_50 = _served_peak(config, 50)
    assert (ran_4, ran_50) == (4, 50)  # the pipeline ran the request's own step count
    assert at_4 == at_50 == verified, (at_4, at_50, verified)
