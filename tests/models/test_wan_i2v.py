"""Wan2.2's image inputs: Wan2.2-I2V-A14B (image-to-video only, two experts over 36 input
channels) and TI2V-5B's optional first frame, real configs and tiny twins; the analyzer traces the
conditioning path (the first frame's VAE encode; for I2V-A14B a whole video's), the start-up
weights check knows the I2V repository's layout.

Each request's first frame staying its own in a batch, and same image + seed giving the same
bytes: ``tests/runtime/test_references.py`` (both tiny models are in its set)."""

from __future__ import annotations

from pathlib import Path

import pytest

from xema_ray.analyzer.run import trace_template
from xema_ray.memory.analysis import summarize
from xema_ray.models import get_model_spec
from xema_ray.templates import RequestTemplate, named_templates


def test_registered_with_their_published_configs() -> None:
    i2v, tiny = get_model_spec("wan2.2-i2v-a14b"), get_model_spec("tiny-wan2.2-i2v")
    t2v = get_model_spec("wan2.2-t2v-a14b")
    # the T2V architecture over 16 noise + 4 mask + 16 image-latent channels, no CLIP image encoder
    assert i2v.transformer_config["in_channels"] == 36 and i2v.transformer_config["out_channels"] == 16
    assert tiny.transformer_config["in_channels"] == 3 * tiny.vae_config["z_dim"] == 12
    assert i2v.transformer_config["image_dim"] is None and i2v.vae_config == t2v.vae_config  # the Wan2.1 VAE
    # the Wan team's wan_i2v_A14B.py: boundary 0.900, shift 5, CFG 3.5 for both experts, 16 fps
    s = i2v.sampling
    assert (s.boundary_ratio, s.flow_shift, s.guidance_scale, s.guidance_scale_2) == (0.9, 5.0, 3.5, 3.5)
    assert i2v.frame_rate == 16.0 and i2v.pipeline_class().__name__ == "WanI2VPipeline"
    refs = i2v.reference_inputs()
    assert (refs.max_references, refs.required_references, i2v.published_layout) == (1, 1, "wan-i2v-a14b")
    assert [t.shape_key for t in named_templates("wan2.2-i2v-a14b")] == [
        "wan2.2-i2v-a14b/832x480x81/ref1@832x480", "wan2.2-i2v-a14b/1280x720x81/ref1@1280x720"]
    # TI2V-5B: text-to-video or a first frame, one name; its tiny twin the same
    for name in ("wan2.2-ti2v-5b", "tiny-wan2.2-ti2v"):
        ti2v = get_model_spec(name)
        refs = ti2v.reference_inputs()
        assert (refs.max_references, refs.required_references, ti2v.published_layout) == (1, 0, "wan-ti2v-5b")
        assert ti2v.sampling.expand_timesteps and ti2v.vae_scale_factor == 16
    assert (t2v.reference_inputs().max_references, get_model_spec("tiny-wan2.2").reference_inputs().max_references) == (0, 0)


def test_error_raised_if_an_i2v_template_has_no_first_frame_or_another_size() -> None:
    with pytest.raises(ValueError, match="image-to-video: its templates take references=1"):
        RequestTemplate(model="tiny-wan2.2-i2v", width=64, height=64, frames=9)
    with pytest.raises(ValueError, match="encodes its reference at the output size 64x64"):
        RequestTemplate(model="tiny-wan2.2-ti2v", width=64, height=64, frames=9, references=1,
                        reference_width=128, reference_height=128)
    with pytest.raises(ValueError, match="takes no reference images"):
        RequestTemplate(model="tiny-wan2.2", width=64, height=64, frames=9, references=1)


def test_i2v_expert_stages_follow_its_own_boundary_and_shift() -> None:
    t = RequestTemplate(model="wan2.2-i2v-a14b", height=720, width=1280, frames=81, steps=40, references=1)
    high, low = t.spec.expert_stages(t)
    # UniPC on flow sigmas at shift 5: timestep >= 900 for the first 15 of 40 steps
    assert (high.first_step, high.last_step, low.first_step, low.last_step) == (0, 14, 15, 39)
    tiny = RequestTemplate(model="tiny-wan2.2-i2v", height=64, width=64, frames=9, steps=4, references=1)
    assert [(s.component, s.steps) for s in tiny.spec.expert_stages(tiny)] == [("transformer", 2), ("transformer_2", 2)]


def test_the_trace_sees_the_first_frame_encode() -> None:
    """The set-up phase holds the first frame's VAE encode: I2V-A14B encodes the image followed by
    black frames (a whole video), TI2V-5B the image alone; TI2V's text-to-video template has none."""
    tiny = RequestTemplate(model="tiny-wan2.2-ti2v", height=64, width=64, frames=9, steps=2)
    plain, first = summarize(trace_template(tiny)), summarize(trace_template(tiny.with_(references=1)))
    assert first.text_peak_bytes > plain.text_peak_bytes
    assert first.weight_bytes == plain.weight_bytes  # one model, two pipelines over its modules
    # the real I2V-A14B at 480p: both experts, the switch at its own step, the encode before step 0
    t = RequestTemplate(model="wan2.2-i2v-a14b", height=480, width=832, frames=81, steps=40, references=1)
    s = summarize(trace_template(t))
    assert [(e.component, e.first_step) for e in s.experts] == [("transformer", 0), ("transformer_2", 15)]
    # a 3 GB encode on top of the 68.77 GB of weights (both experts and the encoder on the device)
    assert s.text_peak_bytes - s.weight_bytes > 3 * 10**9


@pytest.mark.parametrize("model", ["tiny-wan2.2-i2v", "tiny-wan2.2-ti2v"])
def test_a_written_checkpoint_passes_the_start_up_check_and_serves_a_first_frame(model: str, tmp_path: Path) -> None:
    import json

    import numpy as np
    from PIL import Image

    from xema_ray.checkpoints import write_checkpoint
    from xema_ray.models.published import PUBLISHED, WeightsDirError, check_weights_dir
    from xema_ray.parallel.groups import ParallelConfig
    from xema_ray.plan import ExecutionConfig
    from xema_ray.runtime import Batch, GenerationRequest
    from xema_ray.runtime.references import encode_reference
    from xema_ray.runtime.worker import ModelLoadConfig, Worker

    d = write_checkpoint(model, tmp_path)
    spec = get_model_spec(model)
    layout = PUBLISHED[spec.published_layout]
    assert json.loads((d / "model_index.json").read_text())["_class_name"] == layout.pipeline
    check_weights_dir(spec.published_layout, model, d)
    other = "tiny-wan2.2-ti2v" if model == "tiny-wan2.2-i2v" else "tiny-wan2.2-i2v"
    with pytest.raises(WeightsDirError, match=f"{layout.pipeline}' directory"):
        check_weights_dir(get_model_spec(other).published_layout, other, d)
    # the worker loads the directory and runs a first frame through it
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model=model, weights_dir=d))
    t = RequestTemplate(model=model, height=64, width=64, frames=9, steps=2, references=1)
    image = encode_reference(Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    out = w.execute(Batch(config=ExecutionConfig(template=t), requests=(
        GenerationRequest(request_id="a", prompt="waves", seed=1, references=(image,)),), steps=t.steps)).outputs[0]
    w.shutdown()
    assert out.media_type == "video/mp4" and out.frames == 9
