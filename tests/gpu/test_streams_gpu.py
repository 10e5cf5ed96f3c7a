"""GPU check of stream-ordered frees (issue #35, run by `make gpu-check`): CogVideoX-5B 720×480×49
with activation offload of the VAE decoder's conv caches (as every CogVideoX entry of
plans/a6000x8.json arms a layout over it), first under PyTorch's caching allocator, then in the
serving worker with libxema_alloc installed and the entry's layout armed. The caches leave on a side
stream; torch never forwards ``record_stream`` to the pluggable allocator, so the worker's
``mark_used`` must keep each cache's block until its copy has read it: the outputs are bitwise
equal to the caching allocator's, and the allocator deferred frees. The CPU model of the same
semantics is tests/runtime/test_streams.py (``-m streams``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpu.test_allocator_gpu import OUT, STEPS, _armed_check

pytestmark = [pytest.mark.gpu, pytest.mark.streams,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by `make gpu-check`)")]


def test_cogvideox_720x480_activation_offload_armed_equals_the_caching_allocator(tmp_path: Path) -> None:
    from xema_ray.plan import ExecutionConfig, Mitigation
    from xema_ray.templates import RequestTemplate

    config = ExecutionConfig(
        template=RequestTemplate(model="cogvideox-5b", width=720, height=480, frames=49, steps=STEPS),
        mitigations=(Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=4096),))
    r = _armed_check("cogvideox-5b_720x480x49_activation_offload", config, tmp_path, timeout=300)
    stats = r["static"].get("stats") or json.loads((tmp_path / "static.json").read_text())["stats"]
    summary = {"outputs_equal": r["outputs_equal"], "layout_armed": r["static"]["layout_armed"],
               "layout_hits": r["static"]["layout_hits"], "layout_misses": r["static"]["layout_misses"],
               "deferred_frees": stats["deferred_frees"], "peak_pending_free_bytes": stats["peak_pending_free_bytes"],
               "marked_uses": stats["marked_uses"], "step_ratio": r["step_ratio"]}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "streams_gpu_cogvideox-5b_720x480x49.json").write_text(json.dumps(summary, indent=1))
    assert r["static"]["layout_armed"], r["static"]["layout_status"]
    assert stats["marked_uses"] > 0 and stats["deferred_frees"] > 0, summary
    assert r["outputs_equal"], summary
    assert r["static"]["peak_reserved_bytes"] <= 48 * 10**9
