"""GPU check of weight residency (run by `make gpu-check`): Flux.2 1024² (real config, random bf16
weights) served by one worker on a card capped at the reference A6000's 48 GB.

One worker loads the planned residency (plans/flux2-1024-1gpu.json: the minimal selective
offload the planner found for 48 GB), then switches residency in place to full layerwise
offload and to no offload (cap lifted), so one load serves all three: per-step latency of each
(the paper's Figure 4: 3.1 s vs 8.4 s per step on an A6000), `max_memory_reserved` under the cap,
outputs equal. The plan places the real-size Mistral-3 encoder (random weights) as planned
(streamed through the device during set-up); its encode time is recorded.
Results go to $XEMA_GPU_OUT/residency_flux2_1024.json."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig, Mitigation, PlanTable
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.runtime.residency import Residency
from xema_ray.runtime.worker import ModelLoadConfig, Worker

pytestmark = pytest.mark.gpu

CAP_BYTES = 48 * 10**9
TABLE = Path(__file__).resolve().parents[2] / "plans" / "flux2-1024-1gpu.json"
STEPS = 4


def _run(w: Worker, config: ExecutionConfig) -> tuple[bytes, float, int, float]:
    config = config.model_copy(update={"template": config.template.with_(steps=STEPS), "batch": 1,
                                       "mitigations": tuple(m for m in config.mitigations if m.kind != "temporary_serialization")})
    batch = Batch(config=config, requests=(GenerationRequest(request_id="g", prompt="a red fox", seed=1),))
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = w.execute(batch)
    del t0
    return result.outputs[0].data, result.timings.denoise_s / STEPS, torch.cuda.max_memory_reserved(), result.timings.text_s


def test_flux2_1024_under_48gb_with_planned_residency() -> None:
    table = PlanTable.load(str(TABLE))
    planned = table.entries["flux2/1024x1024x1"].config
    total = torch.cuda.get_device_properties(0).total_memory
    math_sdp = torch.backends.cuda.math_sdp_enabled()
    torch.backends.cuda.enable_math_sdp(False)
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total)
    try:
        w = Worker(platform="cuda")
        w.init_device(ParallelConfig(rank=0, world_size=1))
        t0 = time.perf_counter()
        loaded = w.load_model(ModelLoadConfig(model="flux2", plans=(planned,)))
        load_s = time.perf_counter() - t0
        assert torch.cuda.max_memory_reserved() <= CAP_BYTES
        _run(w, planned)  # warm-up: cuBLAS workspaces, kernels
        out_sel, step_sel, reserved_sel, text_s = _run(w, planned)
        n = planned.template.spec.num_dit_blocks
        full = planned.model_copy(update={"mitigations": (Mitigation(kind="block_offload", blocks=tuple(range(n)), intensity=n),)})
        out_full, step_full, reserved_full, _ = _run(w, full)
        torch.cuda.set_per_process_memory_fraction(1.0)  # the unmitigated run cannot fit 48 GB
        plain = planned.model_copy(update={"mitigations": ()})
        out_plain, step_plain, reserved_plain, _ = _run(w, plain)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.backends.cuda.enable_math_sdp(math_sdp)
    assert w.residency is not None
    result = {
        "template": "flux2/1024x1024x1", "plan": planned.describe(), "cap_bytes": CAP_BYTES,
        "load_s": load_s, "loaded_device_bytes": loaded.device_bytes, "loaded_host_bytes": loaded.host_bytes,
        "selective": {"step_s": step_sel, "max_reserved_bytes": reserved_sel},
        "layerwise": {"step_s": step_full, "max_reserved_bytes": reserved_full},
        "no_limit": {"step_s": step_plain, "max_reserved_bytes": reserved_plain},
        "text_encoder": loaded.text_encoder, "text_encode_s": text_s,
        "residency_switches": w.residency.switches, "residency_bytes_moved": w.residency.bytes_moved,
        "outputs_equal": out_sel == out_full == out_plain, "device": torch.cuda.get_device_name(0),
    }
    out = Path(os.environ.get("XEMA_GPU_OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "residency_flux2_1024.json").write_text(json.dumps(result, indent=1))
    assert reserved_sel <= CAP_BYTES and reserved_full <= CAP_BYTES
    assert out_sel == out_full == out_plain
    assert Residency.of_config(planned).host_blocks == loaded.host_blocks
