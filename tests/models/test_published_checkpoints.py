"""Checkpoints as the three repositories publish them (issue #36): tiny directories laid out as
black-forest-labs/FLUX.2-dev, zai-org/CogVideoX-5b and Lightricks/LTX-2 are (``model_index.json``
classes, folders, per-component dtypes, sharded transformer and text encoder with their index,
tokenizers as shipped, the scheduler's config), loaded by the worker; a component stored in
another dtype is cast on load with a log line, or kept in its own where the deployment says, and
the analyzer's trace counts it so; a weights directory that cannot serve is a start-up error."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.checkpoints import TINY_MODELS
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.models.base import model_dtypes
from xema_ray.models.loading import CheckpointError
from xema_ray.models.published import PUBLISHED, WeightsDirError, check_weights_dir
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

_NAMES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}


def _stored(folder: Path) -> set[str]:
    dtypes = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            stored = {str(fh.get_slice(k).get_dtype()) for k in fh.keys()}  # noqa: SIM118
            dtypes |= {_NAMES[n] for n in stored if n in _NAMES}  # floating weights (not counters like I64)
    return dtypes


@pytest.mark.parametrize("model", TINY_MODELS)
def test_tiny_directory_is_laid_out_as_the_published_repository(published: Path, model: str) -> None:
    layout = PUBLISHED[get_model_spec(model).family]
    d = published / model
    index = json.loads((d / "model_index.json").read_text())
    assert index["_class_name"] == layout.pipeline
    assert {k: v for k, v in index.items() if not k.startswith("_")} == {
        name: [c.library, c.class_name] for name, c in layout.components.items()}
    for name, comp in layout.components.items():
        folder = d / name
        assert folder.is_dir(), name
        if comp.dtype is None:
            continue
        assert _stored(folder) == {comp.dtype}, name
        shards = sorted(folder.glob("*-of-*.safetensors"))
        if comp.sharded:  # several shards and the index that maps every tensor to one
            indexes = list(folder.glob("*.safetensors.index.json"))
            assert len(shards) >= 2 and len(indexes) == 1, name
            assert set(json.loads(indexes[0].read_text())["weight_map"].values()) == {s.name for s in shards}
        else:
            assert not shards, name
    tok = d / "tokenizer"
    shipped = {"T5Tokenizer": "spiece.model", "GemmaTokenizerFast": "tokenizer.json", "PixtralProcessor": "processor_config.json"}
    assert (tok / shipped[layout.components["tokenizer"].class_name]).is_file()
    check_weights_dir(get_model_spec(model).family, model, d)  # what start-up checks passes



def test_published_facts_name_cogvideox_fp32_vae_and_gated_repositories() -> None:
    cog = PUBLISHED["cogvideox"]
    assert cog.repo == "zai-org/CogVideoX-5b" and cog.components["vae"].dtype == "float32"
    assert cog.components["transformer"].dtype == "bfloat16" and not cog.gated
    assert PUBLISHED["flux2"].gated and PUBLISHED["flux2"].repo == "black-forest-labs/FLUX.2-dev"
    assert "transformer/*" in PUBLISHED["ltx2"].include_patterns()


def _run(w: Worker, t: RequestTemplate, prompt: str) -> bytes:
    batch = Batch(config=ExecutionConfig(template=t), requests=(GenerationRequest(request_id="r", prompt=prompt, seed=1),), steps=t.steps)
    return w.execute(batch).outputs[0].data


def test_worker_casts_bf16_components_on_load_with_a_log_line(published: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    with caplog.at_level(logging.INFO, logger="xema_ray.models.base"):
        w.load_model(ModelLoadConfig(model="tiny-flux2", weights_dir=published / "tiny-flux2"))
    for comp in ("transformer", "vae", "text_encoder"):
        assert f"tiny-flux2 {comp}: stored as bfloat16, cast to float32 on load" in caplog.text
    pipe = w.engine.pipe  # type: ignore[union-attr]
    assert {p.dtype for c in (pipe.transformer, pipe.vae, pipe.text_encoder) for p in c.parameters()} == {torch.float32}
    t = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
    assert _run(w, t, "a red fox in snow") != _run(w, t, "waves on a rocky shore")  # the shipped tokenizer reaches the pixels


def test_cogvideox_keeps_its_fp32_vae_where_the_deployment_says(published: Path) -> None:
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    loaded = w.load_model(ModelLoadConfig(model="tiny-cogvideox", weights_dir=published / "tiny-cogvideox",
                                          dtype="bfloat16", component_dtypes={"vae": "float32"}))
    pipe = w.engine.pipe  # type: ignore[union-attr]
    assert loaded.dtype == "bfloat16"
    assert {p.dtype for p in pipe.vae.parameters()} == {torch.float32}
    assert {p.dtype for p in pipe.transformer.parameters()} == {torch.bfloat16}
    # the bf16 latents reach the fp32 VAE cast (CogVideoXPipeline does not cast them itself)
    t = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2)
    assert len(_run(w, t, "waves")) > 0


def test_trace_counts_a_component_kept_in_its_own_dtype() -> None:
    t = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2)
    base, kept = model_dtypes(t.spec, "bfloat16", {"vae": "float32"})
    cast = trace_template(t, TraceOptions(dtype=base))
    own = trace_template(t, TraceOptions(dtype=base, component_dtypes=kept))
    vae = t.spec.build_vae(BuildOptions(device="meta", dtype=torch.bfloat16))
    def blocks(nbytes: int) -> int:  # the caching allocator's 512-byte rounding, as the trace counts it
        return -(-nbytes // 512) * 512

    # the fp32 VAE holds twice the bytes per parameter, resident all request; its decode runs in fp32 too
    extra = sum(blocks(4 * p.numel()) - blocks(2 * p.numel()) for p in vae.parameters())
    assert extra > 0 and own.resident_bytes() - cast.resident_bytes() == extra
    assert own.peak() > cast.peak()
    assert own.meta["component_dtypes"] == "vae=float32"


def test_scheduler_comes_from_the_repository_config(published: Path, tmp_path: Path) -> None:
    d = tmp_path / "tiny-flux2"
    shutil.copytree(published / "tiny-flux2", d)
    path = d / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text())
    spec = get_model_spec("tiny-flux2")
    opts = BuildOptions(weights_dir=d, text_encoder="none")
    path.write_text(json.dumps(config | {"shift": 2.5, "base_shift": 0.25}))
    assert spec.scheduler(type(spec.build_pipeline(BuildOptions()).scheduler), {}, opts).config.base_shift == 0.25
    path.write_text(json.dumps(config | {"_class_name": "DDIMScheduler"}))
    with pytest.raises(CheckpointError, match=r"_class_name is 'DDIMScheduler'; tiny-flux2 runs FlowMatchEulerDiscreteScheduler"):
        spec.build_pipeline(opts)


def test_error_raised_if_component_dtypes_name_the_transformer_or_an_unknown_component() -> None:
    from xema_ray.deployment import GroupShape

    spec = get_model_spec("cogvideox-5b")
    with pytest.raises(ValueError, match=r"no component 'transformer'.*runs in the group's dtype"):
        model_dtypes(spec, None, {"transformer": "float32"})
    with pytest.raises(ValueError, match=r"no component 'audio_vae'"):
        GroupShape(model="cogvideox-5b", templates=[{"width": 720, "height": 480, "frames": 49}],
                   component_dtypes={"audio_vae": "float32"})
    assert model_dtypes(get_model_spec("ltx2"), None, {"audio_vae": "float32"})[1] == (("audio_vae", torch.float32),)
    with pytest.raises(ValueError, match=r"dtype\n  Input should be 'float32', 'bfloat16' or 'float16'"):
        GroupShape(model="cogvideox-5b", templates=[{"width": 720, "height": 480, "frames": 49}], dtype="fp8")


def test_error_raised_if_weights_dir_cannot_serve(published: Path, tmp_path: Path) -> None:
    with pytest.raises(WeightsDirError, match=r"weights_dir .*/nowhere does not exist; download it with: "
                                              r"hf download zai-org/CogVideoX-5b"):
        check_weights_dir("cogvideox", "cogvideox-5b", tmp_path / "nowhere")
    d = tmp_path / "tiny-ltx2"
    shutil.copytree(published / "tiny-ltx2", d)
    shutil.rmtree(d / "vocoder")
    with pytest.raises(WeightsDirError, match=r"has no vocoder folder\(s\) \(incomplete download\?\)"):
        check_weights_dir("ltx2", "tiny-ltx2", d)
    d2 = tmp_path / "tiny-cogvideox"
    shutil.copytree(published / "tiny-cogvideox", d2)
    next((d2 / "transformer").glob("*-00002-of-*.safetensors")).unlink()  # an interrupted download
    with pytest.raises(WeightsDirError, match=r"transformer lacks 1 of the \d+ shards its index names, "
                                              r"e.g. diffusion_pytorch_model-00002-of-\d+.safetensors"):
        check_weights_dir("cogvideox", "tiny-cogvideox", d2)
    (d2 / "vae" / "config.json").unlink()
    shutil.rmtree(d2 / "transformer")
    shutil.copytree(published / "tiny-cogvideox" / "transformer", d2 / "transformer")
    with pytest.raises(WeightsDirError, match=r"vae/config.json is missing"):
        check_weights_dir("cogvideox", "tiny-cogvideox", d2)
    with pytest.raises(WeightsDirError, match=r"is a 'CogVideoXPipeline' directory, tiny-flux2 needs a Flux2Pipeline one"):
        check_weights_dir("flux2", "tiny-flux2", published / "tiny-cogvideox")
    (d / "model_index.json").unlink()
    with pytest.raises(WeightsDirError, match=r"model_index.json is missing"):
        check_weights_dir("ltx2", "tiny-ltx2", d)


@pytest.mark.parametrize("base,kept", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["bf16+fp32-vae", "fp32+bf16-vae"])
def test_trace_of_mixed_dtypes_equals_a_real_cpu_run(base: torch.dtype, kept: torch.dtype) -> None:
    """The meta trace of a pipeline whose VAE is in another dtype allocates what the same pipeline
    computing on the CPU allocates, event for event (the cast of the latents included)."""
    import numpy as np

    t = RequestTemplate(model="tiny-cogvideox", width=32, height=32, frames=5, steps=2)
    opts = {"dtype": base, "component_dtypes": (("vae", kept),)}
    cpu = trace_template(t, TraceOptions(device="cpu", replicate=False, **opts))  # type: ignore[arg-type]
    meta = trace_template(t, TraceOptions(device="meta", count_host=True, **opts))  # type: ignore[arg-type]
    assert meta.signature() == cpu.signature() and meta.peak() == cpu.peak()
    np.testing.assert_array_equal(meta.end, cpu.end)


@pytest.mark.parametrize("model", ["tiny-wan2.2", "tiny-qwen-image", "tiny-flux2"])
def test_a_written_checkpoint_passes_the_start_up_check_of_its_model_only(model: str, tmp_path: Path) -> None:
    """Start-up's check knows every family with a weights directory (Wan2.2's two experts and
    Qwen-Image included), and a checkpoint ``write_checkpoint`` wrote names the diffusers pipeline
    class (Flux.2's per-request-references subclass saves as ``Flux2Pipeline``)."""
    from xema_ray.checkpoints import write_checkpoint

    d = write_checkpoint(model, tmp_path)
    spec = get_model_spec(model)
    assert json.loads((d / "model_index.json").read_text())["_class_name"] == PUBLISHED[spec.published_layout].pipeline
    check_weights_dir(spec.published_layout, model, d)
    other = "tiny-qwen-image" if model != "tiny-qwen-image" else "tiny-wan2.2"
    with pytest.raises(WeightsDirError, match=f"{PUBLISHED[spec.published_layout].pipeline}' directory"):
        check_weights_dir(get_model_spec(other).published_layout, other, d)


def test_a_wan_a14b_directory_without_its_low_noise_expert_is_refused(tmp_path: Path) -> None:
    import shutil

    from xema_ray.checkpoints import write_checkpoint

    d = write_checkpoint("tiny-wan2.2", tmp_path)
    shutil.rmtree(d / "transformer_2")
    with pytest.raises(WeightsDirError, match="no transformer_2 folder"):
        check_weights_dir("wan-a14b", "tiny-wan2.2", d)
    assert get_model_spec("wan2.2-ti2v-5b").published_layout == "wan-ti2v-5b"
