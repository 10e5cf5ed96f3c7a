"""CPU cost of building the GPU check's real-size models with seeded weights (issue #24): what a
GPU build still does on the host, measured here, per component.

For each component the meta tree is built, then every module's seeded values are made as a
CUDA build makes them (``SeededWeights.placed_values``) with the meta device standing in for the
GPU: tiled (real-size) tensors cost only their CPU-drawn 2^20-element pattern (the GPU fills them
at memory speed), smaller ones are generated whole on the CPU (and copied to the GPU there). The
old path (every tensor filled on the host, then copied) is the same plus the tiled bytes written
on the host: measured here as a fill rate over one 512 MiB tensor. CPU seconds are
``time.process_time`` of this process (single-threaded generation).

Example:
    python bench/bench_gpu_builds.py --out bench/results/gpu/builds.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from pydantic import BaseModel

from xema_ray.models import get_model_spec
from xema_ray.models.loading import _TILE, TILE_THRESHOLD, SeededWeights, _fill_tiled, build_on_meta

COMPONENTS = [("flux2", "transformer"), ("flux2", "vae"), ("flux2", "text_encoder"),
              ("cogvideox-5b", "transformer"), ("cogvideox-5b", "vae")]


class ComponentCost(BaseModel):
    model: str
    component: str
    parameters: int
    tiled_bytes: int
    host_generated_bytes: int
    device_build_cpu_s: float
    host_fill_gb_per_s: float
    old_path_cpu_s: float


class BuildCosts(BaseModel):
    torch: str
    threads: int
    load_average: tuple[float, float, float]
    components: list[ComponentCost]


def _tree(model: str, component: str) -> torch.nn.Module:
    spec = get_model_spec(model)
    if component == "text_encoder":
        from xema_ray.models.text_encoders import build_encoder_on_meta

        return build_encoder_on_meta(spec.text_encoder, torch.bfloat16)
    cls, cfg = ((spec.transformer_class(), spec.transformer_config) if component == "transformer"
                else (spec.vae_class(), spec.vae_config))
    return build_on_meta(cls, cfg, torch.bfloat16)


def host_fill_rate() -> float:
    """GB/s of the tiled fill into a host tensor (what the old path did for every real-size weight)."""
    t = torch.empty(2**28, dtype=torch.bfloat16)
    base = torch.empty(_TILE, dtype=torch.bfloat16).uniform_(-0.01, 0.01)
    _fill_tiled(t, base)  # first touch of the pages
    c0 = time.process_time()
    w0 = time.perf_counter()
    for _ in range(3):
        _fill_tiled(t, base)
    seconds = max(time.process_time() - c0, time.perf_counter() - w0)
    return 3 * t.numel() * 2 / seconds / 1e9


def measure(model: str, component: str, rate: float) -> ComponentCost:
    root = _tree(model, component)
    source = SeededWeights(0, component)
    meta = torch.device("meta")
    tiled = host = params = 0
    c0 = time.process_time()
    for path, sub in root.named_modules():
        own = dict(sub.named_parameters(recurse=False)) | dict(sub.named_buffers(recurse=False))
        if not any(t.is_meta for t in own.values()):
            continue
        values = source.placed_values(path, sub, torch.bfloat16, meta)
        is_tiled = any(t.numel() > TILE_THRESHOLD for t in own.values())
        for name, v in values.items():
            nbytes = v.numel() * v.element_size()
            params += v.numel() if name in sub._parameters else 0
            if is_tiled and v.is_meta:
                tiled += nbytes
            else:
                host += nbytes
    cpu = time.process_time() - c0
    return ComponentCost(model=model, component=component, parameters=params, tiled_bytes=tiled,
                         host_generated_bytes=host, device_build_cpu_s=cpu, host_fill_gb_per_s=rate,
                         old_path_cpu_s=cpu + tiled / (rate * 1e9))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu/builds.json"))
    args = p.parse_args()
    import os

    rate = host_fill_rate()
    rows = []
    for model, component in COMPONENTS:
        row = measure(model, component, rate)
        rows.append(row)
        print(f"{model:13s} {component:12s} {row.parameters / 1e9:6.2f} B params  tiled {row.tiled_bytes / 1e9:6.1f} GB  "
              f"host-generated {row.host_generated_bytes / 1e9:5.2f} GB  device build {row.device_build_cpu_s:6.1f} CPU s  "
              f"old path {row.old_path_cpu_s:6.1f} CPU s", flush=True)
    costs = BuildCosts(torch=torch.__version__, threads=torch.get_num_threads(), load_average=os.getloadavg(),
                       components=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(costs.model_dump_json(indent=1))


if __name__ == "__main__":
    main()
