"""The planner's trace cache: one meta pipeline per model, reused for every batch size and for
confirmation traces with mitigations, gives exactly the traces a fresh pipeline gives."""

from __future__ import annotations

import numpy as np
import pytest

from planner.trace_model import block_paths
from planner.traces import TraceCache
from xema_ray.analyzer.run import trace_template
from xema_ray.memory.trace import MemoryTrace
from xema_ray.analyzer.mitigated import trace_with_mitigations
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate


def _same(a: MemoryTrace, b: MemoryTrace) -> None:
    assert a.signature() == b.signature()
    np.testing.assert_array_equal(a.end, b.end)
    assert a.modules == b.modules and a.phases == b.phases and a.ops == b.ops


@pytest.mark.parametrize("model,frames", [("tiny-flux2", 1), ("tiny-cogvideox", 9), ("tiny-ltx2", 9)])
def test_reused_pipeline_traces_like_a_fresh_one(model: str, frames: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = RequestTemplate(model=model, height=64, width=64, frames=frames, steps=4)
    cache = TraceCache(tmp_path)
    cache.get(t)
    n = len(block_paths(t))
    mitigations = [Mitigation(kind="block_offload", blocks=(0,), intensity=1),
                   Mitigation(kind="dit_chunking", blocks=tuple(range(n)), intensity=2)]
    # a confirmation trace installs and removes hooks on the shared pipeline in between
    _same(trace_with_mitigations(t.with_(batch=2), mitigations, pipeline=cache.pipeline(t)),
          trace_with_mitigations(t.with_(batch=2), mitigations))
    _same(cache.get(t.with_(batch=2)), trace_template(t.with_(batch=2)))
    assert cache.traced == 2
    # and a second cache over the same directory reads the traces back instead of tracing
    again = TraceCache(tmp_path)
    _same(again.get(t.with_(batch=2)), cache.get(t.with_(batch=2)))
    assert again.traced == 0
