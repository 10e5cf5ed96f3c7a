"""The emulated asynchronous device's figures for the stream tests' armed scenarios: per scenario
the layout's hits and misses, the frees the arena deferred and the peak bytes they held, and the
hazards (none once fixed). Tiny models, so the bytes are those of the tiny configs.

Usage: PYTHONHASHSEED=0 .venv/bin/python bench/streams_emulated.py [--out bench/results/streams-emulated.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from xema_ray.allocator.artifact import save_artifact
from xema_ray.allocator.emulated import recorded_layout
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.platforms.async_host import make_async_host_platform
from xema_ray.runtime import Batch, GenerationRequest
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

COG = RequestTemplate(model="tiny-cogvideox", height=48, width=64, frames=9, steps=3)
FLUX = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=3)
SCENARIOS = {
    "activation_offload (transformer inputs + VAE conv caches)": ExecutionConfig(template=COG, mitigations=(
        Mitigation(kind="activation_offload", modules=("transformer",), intensity=4),
        Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=64))),
    "block_offload (blocks 0, 1)": ExecutionConfig(template=FLUX, mitigations=(
        Mitigation(kind="block_offload", blocks=(0, 1), intensity=2),)),
}


def _worker(config: ExecutionConfig, folder: Path | None) -> tuple[Worker, object]:
    platform = make_async_host_platform()
    w = Worker(platform=platform, static_allocator=True)
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model=config.template.model, plans=(config,), layouts_dir=folder))
    return w, platform


def _batch(config: ExecutionConfig) -> Batch:
    return Batch(config=config, requests=(GenerationRequest(request_id="r", prompt="a lighthouse", seed=1),),
                 steps=config.template.steps)


def run(config: ExecutionConfig, folder: Path) -> dict[str, object]:
    """Its layout recorded on the emulated device (one disarmed batch), then one armed batch."""
    w, platform = _worker(config, None)
    art = recorded_layout(w.allocator, w.alloc_device, lambda: w.execute(_batch(config)), config)
    platform.uninstall()  # type: ignore[attr-defined]
    save_artifact(art, folder)
    config = config.model_copy(update={"layout_ref": art.layout_id})
    w, platform = _worker(config, folder)
    r = w.execute(_batch(config))
    s = w.allocator.stats(device=w.alloc_device)
    out = {"layout_armed": r.layout_armed, "layout_hits": r.layout_hits, "layout_misses": r.layout_misses,
           "static_region_bytes": s.static_region_bytes, "marked_uses": s.marked_uses,
           "deferred_frees": s.deferred_frees, "peak_pending_free_bytes": s.peak_pending_free_bytes,
           "peak_active_bytes": s.peak_active_bytes, "hazards": platform.device_emulation.hazards}  # type: ignore[attr-defined]
    platform.uninstall()  # type: ignore[attr-defined]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/streams-emulated.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(cfg, Path(tmp)) for name, cfg in SCENARIOS.items()}
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
