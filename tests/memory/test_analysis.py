from __future__ import annotations

import numpy as np
import pytest

from xema_ray.memory.analysis import (
    event_cdf,
    parse_bytes,
    pressure_intervals,
    segments,
    summarize,
    unit_of,
)
from xema_ray.memory.trace import Category, MemoryTrace


def make_trace(rows: list[tuple[int, int, int, int, int]], phases: list[str], modules: list[str]) -> MemoryTrace:
    """rows: (size, begin, end, module, phase); n_events = 2 * rows."""
    a = np.asarray(rows, dtype=np.int64)
    n = len(rows)
    return MemoryTrace(
        size=a[:, 0], nbytes=a[:, 0], begin=a[:, 1], end=a[:, 2],
        category=np.where(a[:, 4] == 0, Category.WEIGHT, Category.ACTIVATION).astype(np.int8),
        module=a[:, 3].astype(np.int32), phase=a[:, 4].astype(np.int32), op=np.zeros(n, dtype=np.int32),
        free_module=a[:, 3].astype(np.int32), n_events=2 * n - 1, modules=modules, phases=phases, ops=["mm"],
    )


@pytest.fixture
def toy() -> MemoryTrace:
    # weight of 100 (never freed) ; DiT block 0: 50 then 50 ; VAE: one 300 spike
    rows = [
        (100, 0, 7, 0, 0),
        (50, 1, 3, 1, 1),
        (50, 2, 4, 2, 1),
        (300, 5, 6, 3, 2),
    ]
    modules = ["w", "transformer.transformer_blocks.0.attn", "transformer.transformer_blocks.1.ff", "vae.decoder.up_blocks.3.conv"]
    t = make_trace(rows, ["text", "denoise.step0", "decode.vae"], modules)
    t.n_events = 7
    return t


def test_active_curve_and_peak(toy: MemoryTrace) -> None:
    assert toy.active_curve().tolist() == [100, 150, 200, 150, 100, 400, 100]
    assert toy.peak() == 400


def test_pressure_intervals_known_answer(toy: MemoryTrace) -> None:
    ivs = pressure_intervals(toy, budget=160)
    assert [(i.start, i.stop, i.peak_bytes, i.excess_bytes) for i in ivs] == [(2, 3, 200, 40), (5, 6, 400, 240)]
    assert ivs[0].units == ["transformer.transformer_blocks.1"]
    assert ivs[1].phases == ["decode.vae"] and ivs[1].units == ["vae.decoder.up_blocks.3"]
    assert pressure_intervals(toy, budget=400) == []
    with pytest.raises(ValueError, match="budget"):
        pressure_intervals(toy, budget=-1)


def test_segments_split_by_unit_and_phase(toy: MemoryTrace) -> None:
    segs = segments(toy)
    assert [s.unit for s in segs][:3] == ["w", "transformer.transformer_blocks.0", "transformer.transformer_blocks.1"]
    assert sum(s.stop - s.start for s in segs) == toy.n_events


def test_cdf_is_relative_to_phase_peak(toy: MemoryTrace) -> None:
    cdf = event_cdf(toy, "denoise", thresholds=(50, 90))
    # DiT events at 50, 100, 50, 0 above the weights; peak 100
    assert cdf == {"<50%": 0.25, "<90%": 0.75}


def test_summary(toy: MemoryTrace) -> None:
    s = summarize(toy, budget=160)
    assert s.peak_bytes == 400 and s.peak_phase == "decode.vae"
    assert s.weight_bytes == 100 and s.activation_bytes_at_peak == 300
    assert len(s.pressure_intervals) == 2


def test_unit_of() -> None:
    assert unit_of("transformer.transformer_blocks.3.attn1.to_q") == "transformer.transformer_blocks.3"
    assert unit_of("vae.decoder.conv_out") == "vae.decoder"


def test_parse_bytes() -> None:
    assert parse_bytes("48GB") == 48 * 10**9
    assert parse_bytes("48GiB") == 48 * 2**30
    assert parse_bytes("512") == 512
    with pytest.raises(ValueError, match="48GB"):
        parse_bytes("lots")


@pytest.mark.parametrize("model", ["tiny-cogvideox", "tiny-flux2", "tiny-ltx2"])
def test_lazy_intervals_read_as_described_ones(model: str) -> None:
    # the planner's views describe an interval (units, phases, ops) only when it is read: a lazy
    # interval reads, dumps, compares and prints exactly like one described up front
    from xema_ray.memory.analysis import IntervalIndex, LazyPressureInterval
    from xema_ray.analyzer.run import trace_template
    from xema_ray.templates import RequestTemplate

    t = trace_template(RequestTemplate(model=model, height=64, width=64, frames=1 if model == "tiny-flux2" else 9, steps=3))
    curve = t.active_curve()
    for fraction in (0.5, 0.8):
        budget = int(curve.max() * fraction)
        eager = IntervalIndex(t).intervals(budget, curve)
        lazy = IntervalIndex(t).intervals(budget, curve, lazy=True)
        assert eager and all(isinstance(iv, LazyPressureInterval) for iv in lazy)
        assert [(iv.start, iv.stop, iv.peak_bytes) for iv in lazy] == [(iv.start, iv.stop, iv.peak_bytes) for iv in eager]
        assert "units" not in lazy[-1].__dict__  # nothing described yet
        assert lazy[0].units == eager[0].units and lazy[0].ops == eager[0].ops
        assert [iv.model_dump_json() for iv in lazy] == [iv.model_dump_json() for iv in eager]
        assert lazy == eager
        assert repr(lazy).replace("LazyPressureInterval", "PressureInterval") == repr(eager)
