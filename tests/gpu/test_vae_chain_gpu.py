"""GPU check of VAE chains (run by `make gpu-check`; moved from tests/mitigation/test_vae_chain.py
so the check never imports a CPU test module): CogVideoX-5B's VAE at its real config (random
weights, built alone: the chain needs no DiT), two frame batches so conv caches cross batches
through the host; per-unit bands below and a chain from the last upsampler, as the Figure 11
benchmark plans 4K. fp32 with TF32 off: reduction order only; bf16: exercises batch norm with
bf16 maps and fp32 statistics on CUDA. Results go to $XEMA_GPU_OUT/vae_chain_cogvideox.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from xema_ray.mitigation import apply_mitigations
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import Mitigation

pytestmark = pytest.mark.gpu

PLAN = [
    Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=1000),
    Mitigation(kind="vae_chunking", modules=("vae.decoder.up_blocks.2", "vae.decoder[up_blocks.2.upsamplers.0:]"),
               intensity=4),
]


def test_chain_is_lossless_on_cuda_at_the_real_config() -> None:
    spec = get_model_spec("cogvideox-5b")
    holder = nn.Module()  # the mitigations address modules by their pipeline path ("vae.decoder...")
    holder.vae = spec.build_vae(BuildOptions(device="cuda", dtype=torch.bfloat16))
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    rows = {}
    try:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            holder.vae.to(dtype)
            z = torch.randn(1, 16, 5, 60, 90, generator=torch.Generator("cpu").manual_seed(0)).to("cuda", dtype)
            with torch.no_grad():
                torch.cuda.reset_peak_memory_stats()
                ref = holder.vae.decode(z).sample
                peak_ref = torch.cuda.max_memory_allocated()
                with apply_mitigations(holder, spec, PLAN):
                    torch.cuda.reset_peak_memory_stats()
                    out = holder.vae.decode(z).sample
                    peak = torch.cuda.max_memory_allocated()
            scale = ref.abs().max().item()
            rows[str(dtype)] = {"peak_bytes": peak, "peak_unchunked_bytes": peak_ref,
                                "max_abs_error_over_scale": (out - ref).abs().max().item() / scale}
            assert torch.isfinite(ref).all()
            torch.testing.assert_close(out, ref, atol=tol * scale, rtol=0)
            assert peak < peak_ref
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
        out_dir = Path(os.environ.get("XEMA_GPU_OUT", "out"))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "vae_chain_cogvideox.json").write_text(json.dumps(
            {"template": "cogvideox-5b VAE, latents 1x16x5x60x90", "plan": [m.model_dump() for m in PLAN],
             "rows": rows, "device": torch.cuda.get_device_name(0)}, indent=1))
