"""Lossless, proven (``docs/quality.md``): per model family, the serving worker with a plan's
mitigations and its static layout armed (CPU: the C++ host arena, ``Worker(platform="cpu",
static_allocator=True)``) produces the bytes the reference diffusers pipeline produces on the same
seeded tiny weights, seed and options, at batch 1, with no ``quality`` and with ``lossless``.

The reference is the pipeline's own ``__call__`` on a freshly built pipeline, with nothing
installed, given the prompt inputs the model's encoder makes (the same encoder code the engine
runs) and the same generator. At a larger batch what holds is the same with the reference run on
the same requests together (``test_a_batch_is_the_reference_pipelines_batch``); a row need not be
the bytes of its request run alone: kernels are chosen per shape (oneDNN on the CPU, GEMMs on a
GPU), and on the CPU here they differ in the last bits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from xema_ray import hash_seed
from xema_ray.allocator.artifact import save_artifact
from xema_ray.measure.layout_solve import solve_entry_layout
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.runtime.encode import encode_mp4, encode_png
from xema_ray.runtime.engine import DEFAULT_VIDEO_FPS, Batch, GenerationRequest
from xema_ray.runtime.request_errors import encode_attributed
from xema_ray.runtime.text import PromptEncoder
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

#: one tiny model per family, with a template small enough for CI
FAMILIES = {
    "flux2": RequestTemplate(model="tiny-flux2", height=64, width=64, steps=3),
    "qwen-image": RequestTemplate(model="tiny-qwen-image", height=64, width=64, steps=3),
    "cogvideox": RequestTemplate(model="tiny-cogvideox", height=64, width=64, frames=9, steps=2),
    "wan2.2": RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=5, steps=2),
    "ltx2": RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=2),
}
PROMPT, SEED = "a red fox in the snow", 11


def _plan(t: RequestTemplate, folder: Path, batch: int = 1) -> ExecutionConfig:
    """A plan's lossless mitigations (the first DiT block's weights offloaded, the decoder's
    activations offloaded) and its solved static layout."""
    mitigations = (Mitigation(kind="block_offload", blocks=(0,), intensity=1),)
    config = ExecutionConfig(template=t, mitigations=mitigations, batch=batch)
    art = solve_entry_layout(config, gpu="any")
    save_artifact(art, folder)
    return config.model_copy(update={"layout_ref": art.layout_id})


def _reference(t: RequestTemplate, seeds: tuple[int, ...] = (SEED,)) -> list[bytes]:
    """The reference diffusers pipeline's bytes: nothing installed, its own ``__call__`` on the
    requests of ``seeds`` together."""
    spec = get_model_spec(t.model)
    pipe = spec.build_pipeline(BuildOptions())
    prompts = [PROMPT] * len(seeds)
    encoder = PromptEncoder(pipe, spec, torch.device("cpu"), torch.float32)
    inputs = encode_attributed(encoder, prompts, [f"ref{s}" for s in seeds]).inputs
    with torch.no_grad():
        out = spec.pipeline_for(pipe, t)(**spec.call_kwargs(t), **inputs, output_type="np",
                                         generator=[torch.Generator(device="cpu").manual_seed(s) for s in seeds])
    if spec.kind == "image":
        return [encode_png(img) for img in np.asarray(out.images)]
    fps = float(getattr(spec, "frame_rate", DEFAULT_VIDEO_FPS))
    return [encode_mp4(frames, fps) for frames in np.asarray(out.frames)]


def _served(monkeypatch: pytest.MonkeyPatch, t: RequestTemplate, folder: Path,
            seeds: tuple[int, ...] = (SEED,)) -> tuple[list[bytes], Any]:
    config = _plan(t, folder, batch=len(seeds))
    monkeypatch.setattr(hash_seed, "seeded", lambda: True)  # the arena is reserved whatever the process's seed
    w = Worker(platform="cpu", static_allocator=True)
    try:
        w.init_device(ParallelConfig(rank=0, world_size=1))
        w.load_model(ModelLoadConfig(model=t.model, plans=(config,), layouts_dir=folder))
        requests = tuple(GenerationRequest(request_id=f"g{s}", prompt=PROMPT, seed=s) for s in seeds)
        result = w.execute(Batch(config=config, requests=requests, steps=t.steps))
    finally:
        w.shutdown()
    return [o.data for o in result.outputs], result


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_served_lossless_is_the_reference_pipelines_bytes(family: str, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    t = FAMILIES[family]
    data, result = _served(monkeypatch, t, tmp_path / "t.layouts")
    assert result.layout_armed and result.layout_note is None and result.mitigations == 1
    assert result.steps_computed == t.steps  # lossless: every step ran the transformer
    assert data == _reference(t)


def test_a_batch_is_the_reference_pipelines_batch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """At batch 2 the served bytes are the reference pipeline's on the same two requests together."""
    t = FAMILIES["flux2"]
    seeds = (SEED, SEED + 1)
    data, result = _served(monkeypatch, t, tmp_path / "t.layouts", seeds=seeds)
    assert result.layout_armed
    assert data == _reference(t, seeds)
