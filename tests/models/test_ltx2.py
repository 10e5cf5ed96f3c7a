"""LTX2Spec: the real diffusers LTX2Pipeline, tiny on CPU end to end and real size on meta."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.models.ltx2 import CFG_ONLY, PRODUCTION_GUIDANCE, LTX2Guidance, LTX2Spec, audio_samples
from xema_ray.templates import RequestTemplate

TINY_TEMPLATES = [
    RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=2),
    RequestTemplate(model="tiny-ltx2", height=96, width=128, frames=17, steps=2),
]


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def tiny() -> LTX2Spec:
    spec = get_model_spec("tiny-ltx2")
    assert isinstance(spec, LTX2Spec)
    return spec


@pytest.fixture(scope="module")
def real() -> LTX2Spec:
    spec = get_model_spec("ltx2")
    assert isinstance(spec, LTX2Spec)
    return spec


@pytest.fixture(scope="module")
def tiny_pipe(tiny: LTX2Spec) -> Any:
    return tiny.build_pipeline(BuildOptions(device="cpu", dtype=torch.float32))


def _run(spec: LTX2Spec, pipe: Any, t: RequestTemplate, prompts: list[str], **extra: Any) -> Any:
    return pipe(
        **spec.call_kwargs(t),
        **spec.prompt_embeddings(prompts, "cpu", torch.float32),
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        **extra,
    )


# ---------------------------------------------------------------------------- building
def test_tiny_builds_the_real_ltx2_pipeline_on_cpu(tiny_pipe: Any) -> None:
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    assert type(tiny_pipe) is LTX2Pipeline
    assert isinstance(tiny_pipe.transformer, LTX2VideoTransformer3DModel)
    assert isinstance(tiny_pipe.vae, AutoencoderKLLTX2Video)
    assert isinstance(tiny_pipe.audio_vae, AutoencoderKLLTX2Audio)
    assert isinstance(tiny_pipe.connectors, LTX2TextConnectors)
    assert isinstance(tiny_pipe.vocoder, LTX2Vocoder)
    assert tiny_pipe.text_encoder is None and tiny_pipe.tokenizer is None
    for name in ("transformer", "vae", "audio_vae", "connectors", "vocoder"):
        p = next(getattr(tiny_pipe, name).parameters())
        assert (p.device.type, p.dtype) == ("cpu", torch.float32), name
    # the file's LTX-2 settings, not the class defaults
    assert tiny_pipe.transformer.config.rope_type == "split"
    assert tiny_pipe.vae.config.decoder_causal is False


def test_random_weights_are_seeded(tiny: LTX2Spec, tiny_pipe: Any) -> None:
    again = tiny.build_pipeline(BuildOptions(device="cpu", dtype=torch.float32))
    for name in ("transformer", "vae", "audio_vae", "connectors", "vocoder"):
        a, b = getattr(tiny_pipe, name).state_dict(), getattr(again, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
def test_real_builds_on_meta_in_about_a_second(real: LTX2Spec) -> None:
    from diffusers import LTX2Pipeline

    start = time.perf_counter()
    pipe = real.build_pipeline(BuildOptions(device="meta", dtype=torch.bfloat16))
    elapsed = time.perf_counter() - start
    assert type(pipe) is LTX2Pipeline
    assert elapsed < 5.0, f"building real LTX-2 on meta took {elapsed:.1f} s"
    p = next(pipe.transformer.parameters())
    assert (p.device.type, p.dtype) == ("meta", torch.bfloat16)
    assert pipe.transformer.config.rope_type == "split"
    assert pipe.connectors.config.rope_type == "split"
    assert pipe.vae.config.decoder_causal is False


@pytest.mark.slow
def test_real_parameter_counts(real: LTX2Spec) -> None:
    """docs/measured-facts.md, "Parameter counts": transformer 18.9 B, video VAE 1.22 B (encoder + decoder)."""
    pipe = real.build_pipeline(BuildOptions(device="meta", dtype=torch.bfloat16))
    assert round(_n_params(pipe.transformer) / 1e9, 1) == 18.9
    assert round(_n_params(pipe.vae) / 1e9, 2) == 1.22
    # the components besides, at the published checkpoint's configs
    assert round(_n_params(pipe.connectors) / 1e9, 2) == 1.43
    assert round(_n_params(pipe.audio_vae) / 1e6) == 53
    assert round(_n_params(pipe.vocoder) / 1e6) == 56
    blocks = real.dit_blocks(pipe.transformer)
    assert len(blocks) == 48
    assert round(sum(_n_params(b) for _, b in blocks) / 1e9, 2) == 18.53


def test_error_raised_if_weights_dir_on_meta(tiny: LTX2Spec) -> None:
    with pytest.raises(ValueError, match="weights_dir"):
        tiny.build_pipeline(BuildOptions(device="meta", weights_dir=Path("/nonexistent")))


def test_error_raised_if_component_configs_disagree() -> None:
    # real audio VAE / connectors / vocoder next to the tiny transformer
    with pytest.raises(ValueError, match=r"caption_channels .*got 3840, expected 16"):
        LTX2Spec("mixed", "real", "tiny_ltx2_transformer.json", "tiny_ltx2_vae.json")


# ---------------------------------------------------------------------------- module lists
def test_dit_blocks_and_vae_decoder_modules(tiny: LTX2Spec, tiny_pipe: Any) -> None:
    blocks = tiny.dit_blocks(tiny_pipe.transformer)
    assert [p for p, _ in blocks] == ["transformer_blocks.0", "transformer_blocks.1"]
    for path, module in blocks:
        assert tiny_pipe.transformer.get_submodule(path) is module
    up = tiny.vae_decoder_modules(tiny_pipe.vae)
    assert [p for p, _ in up] == ["decoder.up_blocks.0", "decoder.up_blocks.1", "decoder.up_blocks.2"]
    for path, module in up:
        assert tiny_pipe.vae.get_submodule(path) is module


# ---------------------------------------------------------------------------- shapes
def test_shape_constants(real: LTX2Spec, tiny: LTX2Spec) -> None:
    for spec in (real, tiny):
        assert spec.spatial_multiple == 32
        assert spec.temporal_compression == 8
        assert spec.kind == "video" and spec.family == "ltx2"


def test_real_shapes_at_720p(real: LTX2Spec) -> None:
    t = RequestTemplate(model="ltx2", height=704, width=1280, frames=49, steps=50, batch=2)
    # 7 latent frames x 22 x 40; 49 frames at 24 fps = 2.04 s x 25 audio latents/s
    assert real.latent_shape(t) == (2, 6160, 128)
    assert real.token_counts(t) == {"video": 6160, "audio": 51, "text": 1024}


@pytest.mark.parametrize("t", TINY_TEMPLATES, ids=lambda t: t.key)
def test_shapes_match_what_the_pipeline_builds(tiny: LTX2Spec, tiny_pipe: Any, t: RequestTemplate) -> None:
    seen: dict[str, tuple[int, ...]] = {}

    def pre(_m: nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.setdefault("video", tuple(kwargs["hidden_states"].shape))
        seen.setdefault("audio", tuple(kwargs["audio_hidden_states"].shape))
        seen.setdefault("text", tuple(kwargs["encoder_hidden_states"].shape))

    def on_step_end(_p: Any, _i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        seen.setdefault("latents", tuple(kw["latents"].shape))
        return kw

    handle = tiny_pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        _run(tiny, tiny_pipe, t, ["a cat"], callback_on_step_end=on_step_end)
    finally:
        handle.remove()
    counts = tiny.token_counts(t)
    assert seen["latents"] == tiny.latent_shape(t)
    assert seen["video"][1] == counts["video"]
    assert seen["audio"][1] == counts["audio"]
    assert seen["text"][1] == counts["text"]


# ---------------------------------------------------------------------------- end to end on CPU
@pytest.mark.parametrize("t", TINY_TEMPLATES, ids=lambda t: t.key)
def test_cpu_end_to_end_shapes_and_determinism(tiny: LTX2Spec, tiny_pipe: Any, t: RequestTemplate) -> None:
    prompts = ["a cat", "a dog running on a beach"]
    first = _run(tiny, tiny_pipe, t, prompts)
    second = _run(tiny, tiny_pipe, t, prompts)
    assert first.frames.shape == (2, t.frames, 3, t.height, t.width)
    assert first.audio.shape == (2, 2, audio_samples(tiny, t))
    assert torch.isfinite(first.frames).all() and torch.isfinite(first.audio).all()
    assert first.frames.min() >= 0 and first.frames.max() <= 1
    assert torch.equal(first.frames, second.frames)
    assert torch.equal(first.audio, second.audio)
    # different prompts give different videos (the stand-in embeddings carry the prompt)
    assert not torch.equal(first.frames[0], first.frames[1])


def test_production_guidance_runs_three_transformer_passes_per_step(tiny: LTX2Spec, tiny_pipe: Any) -> None:
    batches: list[int] = []
    handle = tiny_pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: batches.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        _run(tiny, tiny_pipe, TINY_TEMPLATES[0], ["a cat"])
    finally:
        handle.remove()
    # per step: CFG over [negative, positive], then STG, then modality isolation
    assert batches == [2, 1, 1] * TINY_TEMPLATES[0].steps
    assert tiny.transformer_passes_per_step() == (2, 1, 1)


def test_cfg_only_guidance_runs_one_pass_per_step(tiny_pipe: Any) -> None:
    spec = LTX2Spec("tiny-ltx2", "tiny", "tiny_ltx2_transformer.json", "tiny_ltx2_vae.json", guidance=CFG_ONLY)
    batches: list[int] = []
    handle = tiny_pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: batches.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        out = _run(spec, tiny_pipe, TINY_TEMPLATES[0], ["a cat"])
    finally:
        handle.remove()
    assert batches == [2] * TINY_TEMPLATES[0].steps
    assert spec.transformer_passes_per_step() == (2,)
    assert out.frames.shape == (1, 9, 3, 64, 64)


# ---------------------------------------------------------------------------- the real pipeline on meta
@pytest.mark.slow
def test_real_pipeline_call_goes_through_on_meta(real: LTX2Spec) -> None:
    pipe = real.build_pipeline(BuildOptions(device="meta", dtype=torch.bfloat16))
    t = RequestTemplate(model="ltx2", height=704, width=1280, frames=49, steps=2)
    batches: list[int] = []
    steps: list[int] = []

    def on_step_end(_p: Any, i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        steps.append(i)
        return kw

    handle = pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: batches.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            out = pipe(
                **real.call_kwargs(t),
                **real.prompt_embeddings(["a cat"], "meta", torch.bfloat16),
                generator=torch.Generator().manual_seed(0),
                output_type="pt",
                callback_on_step_end=on_step_end,
            )
    finally:
        handle.remove()
    assert out.frames.device.type == "meta"
    assert out.frames.shape == (1, 49, 3, 704, 1280)
    assert out.audio.shape == (1, 2, audio_samples(real, t))
    assert batches == [2, 1, 1, 2, 1, 1]
    assert steps == [0, 1]


# ---------------------------------------------------------------------------- prompt embeddings
def test_prompt_embeddings_shapes_masks_and_determinism(tiny: LTX2Spec) -> None:
    a = tiny.prompt_embeddings(["a cat", "a dog on a hill"], "cpu", torch.float32)
    b = tiny.prompt_embeddings(["a cat", "a dog on a hill"], "cpu", torch.float32)
    assert set(a) == {
        "prompt_embeds",
        "prompt_attention_mask",
        "negative_prompt_embeds",
        "negative_prompt_attention_mask",
    }
    assert a["prompt_embeds"].shape == (2, 16, 16 * 3)
    assert a["negative_prompt_embeds"].shape == a["prompt_embeds"].shape
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["prompt_embeds"][0], a["prompt_embeds"][1])
    # left padding: BOS + one token per word at the end of the sequence
    mask = a["prompt_attention_mask"]
    assert mask.dtype == torch.long
    assert mask[0].tolist() == [0] * 13 + [1] * 3
    assert mask[1].sum() == 1 + 5
    assert a["negative_prompt_attention_mask"].sum(dim=1).tolist() == [1, 1]


def test_prompt_embeddings_without_cfg_have_no_negatives() -> None:
    spec = LTX2Spec("tiny-ltx2", "tiny", "tiny_ltx2_transformer.json", "tiny_ltx2_vae.json", guidance=CFG_ONLY)
    assert "negative_prompt_embeds" in spec.prompt_embeddings(["x"], "cpu", torch.float32)
    no_cfg = LTX2Spec(
        "tiny-ltx2",
        "tiny",
        "tiny_ltx2_transformer.json",
        "tiny_ltx2_vae.json",
        guidance=LTX2Guidance(
            guidance_scale=1.0,
            audio_guidance_scale=1.0,
            stg_scale=0.0,
            audio_stg_scale=0.0,
            modality_scale=1.0,
            audio_modality_scale=1.0,
        ),
    )
    assert set(no_cfg.prompt_embeddings(["x"], "cpu", torch.float32)) == {"prompt_embeds", "prompt_attention_mask"}
    assert no_cfg.transformer_passes_per_step() == (1,)


def test_real_prompt_embeddings_on_meta_have_the_gemma_shape(real: LTX2Spec) -> None:
    out = real.prompt_embeddings(["a cat"], "meta", torch.bfloat16)
    # Gemma-3-12B: 1024 tokens x (3840 hidden x 49 hidden states)
    assert out["prompt_embeds"].shape == (1, 1024, 3840 * 49)
    assert all(v.device.type == "meta" for v in out.values())
    assert out["prompt_embeds"].dtype == torch.bfloat16


def test_error_raised_if_no_prompts(tiny: LTX2Spec) -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        tiny.prompt_embeddings([], "cpu", torch.float32)


# ---------------------------------------------------------------------------- call kwargs and guidance
def test_call_kwargs_are_the_production_ltx2_call(real: LTX2Spec) -> None:
    t = RequestTemplate(model="ltx2", height=704, width=1280, frames=49, steps=40)
    kw = real.call_kwargs(t)
    assert kw == {
        "height": 704,
        "width": 1280,
        "num_frames": 49,
        "frame_rate": 24.0,
        "num_inference_steps": 40,
        "guidance_scale": 3.0,
        "audio_guidance_scale": 7.0,
        "stg_scale": 1.0,
        "audio_stg_scale": 1.0,
        "spatio_temporal_guidance_blocks": [29],
        "modality_scale": 3.0,
        "audio_modality_scale": 3.0,
        "guidance_rescale": 0.7,
        "audio_guidance_rescale": 0.7,
        "use_cross_timestep": False,
        "max_sequence_length": 1024,
    }
    assert real.call_kwargs(t, guidance_scale=5.0)["guidance_scale"] == 5.0
    assert real.default_guidance_scale == 3.0
    assert real.transformer_passes_per_step() == (2, 1, 1)


def test_tiny_stg_block_sits_at_the_same_relative_depth(tiny: LTX2Spec) -> None:
    t = TINY_TEMPLATES[0]
    assert tiny.call_kwargs(t)["spatio_temporal_guidance_blocks"] == [1]
    assert tiny.guidance.stg_blocks == (1,)
    assert PRODUCTION_GUIDANCE.stg_blocks == (29,)


def test_error_raised_if_guidance_scale_below_one(real: LTX2Spec) -> None:
    t = RequestTemplate(model="ltx2", height=704, width=1280, frames=49)
    with pytest.raises(ValueError, match="guidance_scale must be >= 1"):
        real.call_kwargs(t, guidance_scale=0.5)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"guidance_scale": 0.0}, "guidance_scale must be >= 1"),
        ({"stg_scale": -1.0}, "stg_scale must be >= 0"),
        ({"guidance_rescale": 1.5}, r"guidance_rescale must be in \[0, 1\]"),
        ({"stg_blocks": ()}, "stg_blocks is empty"),
    ],
)
def test_error_raised_if_guidance_invalid(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LTX2Guidance(**fields)


def test_error_raised_if_stg_block_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"stg_blocks \[48\] out of range for 48"):
        LTX2Spec("ltx2", "real", "ltx2_transformer.json", "ltx2_vae.json", guidance=LTX2Guidance(stg_blocks=(48,)))


def test_error_raised_if_frame_rate_not_positive() -> None:
    with pytest.raises(ValueError, match="frame_rate must be positive, got 0"):
        LTX2Spec("ltx2", "real", "ltx2_transformer.json", "ltx2_vae.json", frame_rate=0)


# ---------------------------------------------------------------------------- template validation
def test_error_raised_if_height_not_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match=r"multiples of 32, got 1280x720 \(nearest valid: 1280x704\)"):
        RequestTemplate(model="ltx2", height=720, width=1280, frames=49)


def test_error_raised_if_frames_not_one_plus_multiple_of_8() -> None:
    with pytest.raises(ValueError, match=r"1 \+ a multiple of 8 .*got 50"):
        RequestTemplate(model="ltx2", height=704, width=1280, frames=50)


@pytest.mark.parametrize("frames", [1, 9, 49, 65, 81, 121])
def test_valid_frame_counts_accepted(frames: int) -> None:
    RequestTemplate(model="ltx2", height=480, width=864, frames=frames)
