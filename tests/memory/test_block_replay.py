"""Replayed DiT blocks are exact: a trace with block replay equals the fully run trace event for
event (sizes, event times, modules, ops, phases), on the three tiny models and at real size;
blocks carrying a mitigation's hook are run, not replayed."""

from __future__ import annotations

import pytest

from tests.memory.trace_equality import TEMPLATES, columns_equal
from xema_ray.memory.analyzer import TraceOptions, trace_template
from xema_ray.memory.trace import MemoryTrace
from xema_ray.mitigation.tracing import trace_with_mitigations
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate


def _equal(a: MemoryTrace, b: MemoryTrace) -> None:
    columns_equal(a, b)
    assert a.meta["trace_hash"] == b.meta["trace_hash"]


def _counts(trace: MemoryTrace) -> tuple[int, int]:
    replayed, recorded = (int(x.split()[0]) for x in trace.meta["block_replay"].split(" / "))
    return replayed, recorded


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.key)
def test_replayed_trace_equals_fully_run_trace(template: RequestTemplate) -> None:
    fast = trace_template(template, TraceOptions(replay_blocks=True))
    full = trace_template(template)
    _equal(fast, full)
    replayed, recorded = _counts(fast)
    assert replayed > recorded > 0  # later blocks really are replayed


@pytest.mark.slow
@pytest.mark.parametrize("template", [
    RequestTemplate(model="ltx2", width=864, height=480, frames=49, steps=4),
    RequestTemplate(model="flux2", width=256, height=256, steps=4, batch=2),
    RequestTemplate(model="cogvideox-5b", width=1280, height=720, frames=49, steps=4),
], ids=lambda t: t.key)
def test_replay_is_exact_at_real_size(template: RequestTemplate) -> None:
    fast = trace_template(template, TraceOptions(replay_blocks=True))
    _equal(fast, trace_template(template))
    replayed, _ = _counts(fast)
    assert replayed >= 3 * template.spec.transformer_config["num_layers"] // 2


@pytest.mark.parametrize(("model", "mitigations"), [
    ("tiny-flux2", [Mitigation(kind="block_offload", blocks=(0, 2), intensity=2)]),
    ("tiny-cogvideox", [Mitigation(kind="dit_chunking", blocks=(1,), intensity=2),
                        Mitigation(kind="temporary_serialization", modules=("transformer",), intensity=2)]),
    ("tiny-ltx2", [Mitigation(kind="hsdp", blocks=(0,), intensity=1)]),
])
def test_mitigated_traces_stay_exact(model: str, mitigations: list[Mitigation]) -> None:
    # blocks carrying a mitigation's hook run; the others are still replayed
    t = next(x for x in TEMPLATES if x.model == model).with_(steps=3)
    fast = trace_with_mitigations(t, mitigations, options=TraceOptions(replay_blocks=True))
    _equal(fast, trace_with_mitigations(t, mitigations))
    assert _counts(fast)[0] > 0
