"""Qwen-Image and its tiny twin: registry, shapes, the Qwen2.5-VL encoder, the trace."""

from __future__ import annotations

import pytest
import torch

from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.memory.analysis import summarize
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.templates import RequestTemplate, named_templates

GB = 10**9


def test_registered_with_real_and_tiny_configs() -> None:
    real, tiny = get_model_spec("qwen-image"), get_model_spec("tiny-qwen-image")
    assert (real.family, real.kind, tiny.kind) == ("qwen-image", "image", "image")
    assert real.text_encoder.family == tiny.text_encoder.family == "qwen2_5_vl"
    assert real.spatial_multiple == 16 and real.num_dit_blocks == 60
    assert [t.shape_key for t in named_templates("qwen-image")] == ["qwen-image/1664x928x1", "qwen-image/1328x1328x1"]
    with pytest.raises(ValueError, match="image model"):
        RequestTemplate(model="qwen-image", height=928, width=1664, frames=5)


def test_encoded_prompts_are_padded_to_one_length_per_template() -> None:
    spec = get_model_spec("tiny-qwen-image")
    pipe = spec.build_pipeline(BuildOptions(device="cpu", text_encoder="device"))
    short = spec.encode_prompts(pipe, ["a cat"], torch.device("cpu"), torch.float32)
    assert short["prompt_embeds"].shape == (1, spec.text_tokens, 32)
    assert short["prompt_embeds_mask"].shape == (1, spec.text_tokens)
    t = RequestTemplate(model="tiny-qwen-image", height=64, width=64, steps=2)
    image = pipe(**spec.call_kwargs(t), **short, output_type="pt").images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()


def test_replicated_trace_equals_a_full_trace() -> None:
    t = RequestTemplate(model="tiny-qwen-image", height=64, width=64, steps=5)
    assert trace_template(t).signature() == trace_template(t, TraceOptions(replicate=False)).signature()


def test_real_model_on_meta_with_its_text_encoder() -> None:
    t = RequestTemplate(model="qwen-image", height=928, width=1664, steps=50)
    s = summarize(trace_template(t, TraceOptions(text_encoder="device")))
    w = s.weight_bytes_by_component
    assert 40 * GB < w["transformer"] < 42 * GB  # 20.4 B parameters in bf16
    assert 16 * GB < w["text_encoder"] < 17 * GB  # Qwen2.5-VL-7B with its vision tower: 8.3 B
    assert s.peak_bytes > sum(w.values())
