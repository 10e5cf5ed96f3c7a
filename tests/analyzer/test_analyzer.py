"""The analyzer's correctness without a GPU: the meta-device trace of the real pipeline equals a
real CPU run's trace (sizes, order, peak), and one replicated step equals tracing them all."""

from __future__ import annotations

import numpy as np
import pytest

from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.analyzer.tracer import ALLOC, FREE, RawTrace, _Record
from xema_ray.analyzer.steps import STEP_BOUNDARY, StepPatternError, expand_steps
from xema_ray.templates import RequestTemplate

TINY = [
    RequestTemplate(model="tiny-flux2", height=64, width=64, steps=5),
    RequestTemplate(model="tiny-flux2", height=32, width=48, steps=4),
    RequestTemplate(model="tiny-cogvideox", height=64, width=64, frames=9, steps=5),
    RequestTemplate(model="tiny-cogvideox", height=32, width=48, frames=5, steps=4),
    RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=5),
]
# Batched templates are checked meta-against-meta only: with batch > 1 PyTorch's CPU group_norm
# makes its input contiguous in the *suggested* memory format (an extra clone) where CUDA, and
# so meta, uses plain ``contiguous()`` (aten/src/ATen/native/group_norm.cpp). The meta trace
# follows CUDA, which is what it predicts.
BATCHED = [
    RequestTemplate(model="tiny-flux2", height=32, width=48, steps=4, batch=2),
    RequestTemplate(model="tiny-cogvideox", height=32, width=48, frames=5, steps=4, batch=3),
]


@pytest.mark.parametrize("template", TINY, ids=lambda t: t.key)
def test_meta_trace_equals_real_cpu_run(template: RequestTemplate) -> None:
    # Reference: the same pipeline really computing on CPU, every step traced. On a CPU host and
    # device are one memory, so the meta run counts host tensors too (count_host) for this test.
    cpu = trace_template(template, TraceOptions(device="cpu", replicate=False))
    meta = trace_template(template, TraceOptions(device="meta", count_host=True))
    assert meta.signature() == cpu.signature()
    assert meta.n_events == cpu.n_events
    assert meta.peak() == cpu.peak()
    np.testing.assert_array_equal(meta.end, cpu.end)


@pytest.mark.parametrize("template", TINY[::2] + BATCHED, ids=lambda t: t.key)
def test_replicated_steps_equal_tracing_every_step(template: RequestTemplate) -> None:
    t = template.with_(steps=7)
    direct = trace_template(t, TraceOptions(replicate=False))
    replicated = trace_template(t)
    assert replicated.meta["traced_steps"] == "3"
    assert replicated.signature() == direct.signature()
    np.testing.assert_array_equal(replicated.end, direct.end)
    assert replicated.peak() == direct.peak()


def test_trace_roundtrips_through_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=3)
    trace = trace_template(t)
    trace.save(tmp_path / "t.json")
    back = MemoryTrace.load(tmp_path / "t.json")
    assert back.signature() == trace.signature()
    assert back.phases == trace.phases and back.meta == trace.meta


def test_phases_cover_setup_steps_and_decode() -> None:
    t = RequestTemplate(model="tiny-cogvideox", height=64, width=64, frames=9, steps=6)
    trace = trace_template(t)
    assert trace.phases[:2] == ["text", "denoise.step0"]
    assert "denoise.step5" in trace.phases and "decode.vae" in trace.phases
    per_step = [int((trace.phase == trace.phases.index(f"denoise.step{k}")).sum()) for k in range(1, 6)]
    assert len(set(per_step)) == 1  # every steady-state step allocates the same
    assert (trace.category == Category.WEIGHT).sum() > 0


def _raw(events: list[tuple[int, int]], records: list[_Record], markers: list[tuple[int, str]]) -> RawTrace:
    return RawTrace(records=records, event_kind=[k for k, _ in events], event_alloc=[a for _, a in events],
                    markers=markers, modules=["m"], ops=["op"])


def test_error_raised_if_steps_differ() -> None:
    # steps 1 and 2 allocate different sizes: one step cannot stand for the rest
    recs = [_Record(nbytes=n, category=2, module=0, op=0, begin=i) for i, n in enumerate([512, 1024])]
    events = [(ALLOC, 0), (FREE, 0), (ALLOC, 1), (FREE, 1)]
    for r, b in zip(recs, (0, 2)):
        r.begin = b
    markers = [(0, STEP_BOUNDARY), (2, STEP_BOUNDARY), (4, STEP_BOUNDARY)]
    with pytest.raises(StepPatternError, match="differ"):
        expand_steps(_raw(events, recs, markers), steps=10)


def test_error_raised_if_steps_differ_names_the_first_differing_event() -> None:
    # step 2 makes one more allocation (600 B, rounded to 1024) after the same first one
    recs = [_Record(nbytes=n, category=2, module=0, op=0, begin=b) for n, b in [(100, 0), (100, 2), (600, 4)]]
    events = [(ALLOC, 0), (FREE, 0), (ALLOC, 1), (FREE, 1), (ALLOC, 2), (FREE, 2)]
    markers = [(0, STEP_BOUNDARY), (2, STEP_BOUNDARY), (6, STEP_BOUNDARY)]
    with pytest.raises(StepPatternError, match=r"\(2 vs 4 events; first difference at event 2 of the step: "
                                               r"None vs \(0, 1024, 0, 0, 2\)\)"):
        expand_steps(_raw(events, recs, markers), steps=10)
    # same length, a different size at event 1: a free of a 512 B vs a 1024 B allocation
    recs[1].nbytes = 1000
    events = [(ALLOC, 0), (FREE, 0), (ALLOC, 1), (FREE, 1)]
    markers = [(0, STEP_BOUNDARY), (2, STEP_BOUNDARY), (4, STEP_BOUNDARY)]
    with pytest.raises(StepPatternError, match=r"first difference at event 0 of the step: "
                                               r"\(0, 512, 0, 0, 0\) vs \(0, 1024, 0, 0, 0\)"):
        expand_steps(_raw(events, recs[:2], markers), steps=10)


def test_a_batch_on_another_thread_leaves_the_trace_unchanged() -> None:
    """The tracer's module hooks and its attention swap are process-wide, its dispatch mode is not:
    modules and attention another thread runs during a trace (a worker's batch beside the tracing
    in one process) are neither recorded nor attributed, never pause the trace, and that thread
    gets real attention values."""
    import threading

    import torch
    import torch.nn.functional as F
    from torch import nn

    class Busy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(64, 64)
            self.norm = nn.LayerNorm(64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.proj(x).unflatten(-1, (4, 16)).transpose(1, 2)
            return self.norm(F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2))

    template = TINY[0]
    alone = trace_template(template, TraceOptions(device="cpu", replicate=False))
    busy, x = Busy().eval(), torch.randn(1, 32, 64)
    with torch.no_grad():
        want = busy(x)
    stop, runs, wrong = threading.Event(), [0], []

    def batches() -> None:
        with torch.no_grad():
            while not stop.is_set():
                got = busy(x)
                if not torch.allclose(got, want, atol=1e-5):
                    wrong.append(float((got - want).abs().max()))
                runs[0] += 1

    thread = threading.Thread(target=batches, daemon=True)
    thread.start()
    try:
        while runs[0] == 0:  # the other thread is running batches before the trace starts
            stop.wait(0.01)
        before = runs[0]
        beside = trace_template(template, TraceOptions(device="cpu", replicate=False))
        during = runs[0] - before
    finally:
        stop.set()
        thread.join(30)
    assert during > 0, "no batch ran during the trace: the test checked nothing"
    assert not wrong, wrong
    assert beside.signature() == alone.signature()
    assert beside.n_events == alone.n_events and beside.peak() == alone.peak()
