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


def test_a_group_keeping_a_component_in_its_own_dtype_is_traced_with_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Start-up planning traces a group that keeps CogVideoX's VAE in fp32 with it (its own trace
    file beside the default one), and a precomputed table, made at the defaults, is refused."""
    from deployments.planning import group_dtypes, load_or_plan
    from xema_ray.analyzer.run import TraceOptions
    from xema_ray.serving.config import ServeConfig

    template = {"width": 64, "height": 64, "frames": 9, "steps": 2}
    cfg = ServeConfig.model_validate({"models": [{"model": "tiny-cogvideox", "templates": [template], "dtype": "bfloat16",
                                                  "component_dtypes": {"vae": "float32"}}]})
    dtypes = group_dtypes(cfg)
    base, kept = dtypes["tiny-cogvideox"]
    t = RequestTemplate(model="tiny-cogvideox", **template)
    kept_trace = TraceCache(tmp_path, dtypes=dtypes).get(t)
    _same(kept_trace, trace_template(t, TraceOptions(dtype=base, component_dtypes=kept, replay_blocks=True)))
    cast = TraceCache(tmp_path, dtypes={"tiny-cogvideox": (base, ())}).get(t)  # every component in bf16
    TraceCache(tmp_path).get(t)  # the tiny model's default (fp32): a third file, its name as before
    assert kept_trace.resident_bytes() > cast.resident_bytes() and len(list(tmp_path.glob("*.json"))) == 3
    with pytest.raises(ValueError, match=r"tiny-cogvideox: dtype / component_dtypes differ from the model's default, "
                                         r"but plan table .* was planned at the defaults"):
        load_or_plan(cfg.model_copy(update={"plan_table": tmp_path / "t.json"}), [t])
