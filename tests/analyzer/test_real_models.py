"""The analyzer at full size on the meta device: no weights, no GPU, a 2-core CPU.

Reference figures: CogVideoX-5B 1280x720x49's active peak was measured at 53.8 GB on an H200
(issue #3, real pipeline, random bf16 weights); the paper gives Flux.2 1024² weights as 60.2 GB
(GiB: 64.6e9 bytes) and "more than 64 GB" in all.
"""

from __future__ import annotations

import pytest

from xema_ray.memory.analysis import summarize
from xema_ray.analyzer.run import trace_template
from xema_ray.memory.trace import Category
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.slow


def test_cogvideox_720p_whole_request() -> None:
    t = RequestTemplate(model="cogvideox-5b", height=720, width=1280, frames=49, steps=50)
    trace = trace_template(t)
    s = summarize(trace, budget=48 * 10**9)
    assert s.weight_bytes == pytest.approx(11.57e9, rel=0.01)  # 5.57 B transformer + 0.22 B VAE, bf16
    assert s.peak_bytes == pytest.approx(53.8e9, rel=0.01)  # H200 measurement of the same call
    assert s.peak_phase == "decode.vae"
    assert s.pressure_intervals and all(iv.phases == ["decode.vae"] for iv in s.pressure_intervals)
    assert trace.meta["traced_steps"] == "3" and "denoise.step49" in trace.phases


def test_flux2_1024_is_weight_dominated() -> None:
    t = RequestTemplate(model="flux2", height=1024, width=1024, steps=50)
    trace = trace_template(t)
    weights = int(trace.size[trace.category == Category.WEIGHT].sum())
    assert weights / 2**30 == pytest.approx(60.2, abs=0.1)  # the paper's "60.2 GB" is GiB
    assert trace.peak() > 64e9  # "more than 64 GB" (here in 10^9 bytes)


def test_ltx2_720p_completes() -> None:
    t = RequestTemplate(model="ltx2", height=704, width=1280, frames=49, steps=50)
    trace = trace_template(t)
    s = summarize(trace, budget=48 * 10**9)
    assert s.weight_bytes > 35e9  # 18.9 B transformer in bf16 alone is 37.8 GB
    assert s.peak_bytes > s.weight_bytes
