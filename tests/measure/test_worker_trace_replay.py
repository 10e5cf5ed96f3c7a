"""The layout's stream is traced with the analyzer's block replay beneath the batch's hooks (LTX-2
layouts solve ~4x faster): the replayed stream must be the fully run one, allocation for allocation."""

from __future__ import annotations

import numpy as np
import pytest

from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.measure.verify import worker_trace
from xema_ray.templates import RequestTemplate

CASES = [
    ("tiny-ltx2", 64, 64, 9, (), 1),
    ("tiny-flux2", 64, 64, 1, (Mitigation(kind="block_offload", blocks=(0, 1), intensity=2),), 1),
    ("tiny-cogvideox", 64, 64, 9, (Mitigation(kind="dit_chunking", blocks=(0,), intensity=2),), 1),
    # SP ranks (rank 0 of a fake process group): the blocks' all-to-alls are replayed too
    ("tiny-ltx2", 64, 64, 9, (), 2),
    ("tiny-flux2", 64, 64, 1, (Mitigation(kind="hsdp", blocks=(0, 1), intensity=2),), 2),
]


@pytest.mark.parametrize("model,h,w,f,mitigations,ulysses", CASES, ids=[f"{c[0]}-sp{c[5]}" for c in CASES])
def test_replayed_worker_stream_equals_the_full_run(model: str, h: int, w: int, f: int,
                                                     mitigations: tuple[Mitigation, ...], ulysses: int) -> None:
    t = RequestTemplate(model=model, height=h, width=w, frames=f, steps=4)
    config = ExecutionConfig(template=t, mitigations=mitigations, ulysses=ulysses)
    first = worker_trace(config, replay_blocks=False)  # a first load in a process: its weights are counted alike
    full, replayed = worker_trace(config, replay_blocks=False), worker_trace(config, replay_blocks=True)
    assert replayed.n_events == full.n_events and replayed.loaded_bytes == full.loaded_bytes
    for column in ("size", "begin", "end"):
        assert np.array_equal(getattr(replayed, column), getattr(full, column)), column
    assert replayed.step_bounds == full.step_bounds
    # ... which does not move the request's stream (the layout id is the same in every process)
    for column in ("size", "begin", "end"):
        assert np.array_equal(getattr(first, column), getattr(full, column)), column
