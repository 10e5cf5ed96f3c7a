"""Adapter files as users have them, for Flux.2, LTX-2, CogVideoX and Wan2.2: diffusers/PEFT names
and the community layouts diffusers converts (its own ``lora_state_dict``), read against the
model's layers (meta-built: shapes only); bad files refused naming the adapter and the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from xema_ray.lora import AdapterRejected, AdapterSource, read_adapter
from xema_ray.lora.pool import adapted_components
from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec

_PIPES: dict[str, Any] = {}


def _pipe(model: str) -> Any:
    if model not in _PIPES:
        _PIPES[model] = get_model_spec(model).build_pipeline(BuildOptions(device="meta"))
    return _PIPES[model]


def _lin(pipe: Any, path: str) -> torch.nn.Linear:
    comp, _, module = path.partition(".")
    m = dict(getattr(pipe, comp).named_modules())[module]
    assert isinstance(m, torch.nn.Linear)
    return m


def _pair(key: str, m: torch.nn.Linear, r: int = 4) -> dict[str, torch.Tensor]:
    return {f"{key}.lora_A.weight": torch.randn(r, m.in_features) * 0.1,
            f"{key}.lora_B.weight": torch.randn(m.out_features, r) * 0.1}


#: (model, layout, {file key prefix: the diffusers layer it must land on})
CASES = [
    ("tiny-flux2", "ai-toolkit", {"diffusion_model.double_blocks.0.img_attn.proj": "transformer.transformer_blocks.0.attn.to_out.0",
                                  "diffusion_model.single_blocks.1.linear2": "transformer.single_transformer_blocks.1.attn.to_out"}),
    ("tiny-flux2", "kohya", {"lora_unet_single_blocks_0_linear2": "transformer.single_transformer_blocks.0.attn.to_out"}),
    ("tiny-ltx2", "original", {"diffusion_model.transformer_blocks.0.attn1.to_q": "transformer.transformer_blocks.0.attn1.to_q",
                               "diffusion_model.patchify_proj": "transformer.proj_in"}),
    ("tiny-ltx2", "diffusers", {"transformer.transformer_blocks.1.ff.net.2": "transformer.transformer_blocks.1.ff.net.2"}),
    ("tiny-cogvideox", "diffusers", {"transformer.transformer_blocks.0.attn1.to_q": "transformer.transformer_blocks.0.attn1.to_q"}),
    ("tiny-wan2.2", "original", {"diffusion_model.blocks.0.self_attn.q": "transformer.blocks.0.attn1.to_q",
                                 "diffusion_model.blocks.1.ffn.2": "transformer.blocks.1.ffn.net.2"}),
    ("tiny-wan2.2", "diffusers", {"transformer_2.blocks.0.attn2.to_k": "transformer_2.blocks.0.attn2.to_k"}),
]


@pytest.mark.parametrize(("model", "layout", "keys"), CASES, ids=[f"{m}-{lay}" for m, lay, _ in CASES])
def test_a_published_layout_lands_on_the_models_layers(model: str, layout: str, keys: dict[str, str],
                                                       tmp_path: Path) -> None:
    pipe = _pipe(model)
    tensors: dict[str, torch.Tensor] = {}
    for key, target in keys.items():
        m = _lin(pipe, target)
        if layout == "kohya":  # kohya: lora_down / lora_up with an alpha (folded into the factors by diffusers)
            tensors[f"{key}.lora_down.weight"] = torch.randn(4, m.in_features) * 0.1
            tensors[f"{key}.lora_up.weight"] = torch.randn(m.out_features, 4) * 0.1
            tensors[f"{key}.alpha"] = torch.tensor(8.0)
        else:
            tensors |= _pair(key, m)
    path = tmp_path / "a.safetensors"
    save_file(tensors, str(path))
    adapter = read_adapter(AdapterSource(name="a", model=model, path=path), type(pipe), adapted_components(pipe),
                           max_rank=8)
    assert set(adapter.layers) == set(keys.values())
    for key, target in keys.items():
        lay = adapter.layers[target]
        if layout != "kohya":
            assert torch.equal(lay.a, tensors[f"{key}.lora_A.weight"])
            assert torch.equal(lay.b * lay.scale, tensors[f"{key}.lora_B.weight"])


def test_diffusers_metadata_alpha_sets_the_scale(tmp_path: Path) -> None:
    pipe = _pipe("tiny-flux2")
    path = write_adapter(tmp_path / "a.safetensors", pipe.transformer, rank=4, alpha=2.0)
    adapter = read_adapter(AdapterSource(name="a", model="tiny-flux2", path=path), type(pipe), adapted_components(pipe), 8)
    assert {lay.scale for lay in adapter.layers.values()} == {0.5}


@pytest.mark.parametrize(("what", "match"), [
    ("rank", "rank 16, above the pool's max_rank 8"), ("partner", "no lora_B partner"),
    ("text_encoder", "text_encoder.q_proj"), ("norm", "only linear layers are adapted")])
def test_error_raised_if_a_file_breaks_a_rule(what: str, match: str, tmp_path: Path) -> None:
    pipe = _pipe("tiny-ltx2")
    m = _lin(pipe, "transformer.transformer_blocks.0.attn1.to_q")
    key = "transformer.transformer_blocks.0.attn1.to_q"
    tensors = _pair(key, m, r=16 if what == "rank" else 4)
    if what == "partner":
        del tensors[f"{key}.lora_B.weight"]
    elif what == "text_encoder":
        tensors |= {"text_encoder.q_proj.lora_A.weight": torch.zeros(4, 8), "text_encoder.q_proj.lora_B.weight": torch.zeros(8, 4)}
    elif what == "norm":  # a LoRA on a norm layer (not a linear one)
        norm = "transformer.transformer_blocks.0.attn1.norm_q"
        tensors = {f"{norm}.lora_A.weight": torch.zeros(4, 4), f"{norm}.lora_B.weight": torch.zeros(4, 4)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(AdapterRejected, match=match) as e:
        read_adapter(AdapterSource(name="style-x", model="tiny-ltx2", path=path), type(pipe), adapted_components(pipe), 8)
    assert "style-x" in str(e.value) and e.value.key is not None


def test_a_stated_tolerance_lets_unknown_keys_through_unapplied(tmp_path: Path) -> None:
    pipe = _pipe("tiny-cogvideox")
    key = "transformer.transformer_blocks.0.attn1.to_q"
    tensors = _pair(key, _lin(pipe, key)) | {"text_encoder.q.lora_A.weight": torch.zeros(4, 8)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    src = AdapterSource(name="x", model="tiny-cogvideox", path=path)
    with pytest.raises(AdapterRejected, match="tolerance 0"):
        read_adapter(src, type(pipe), adapted_components(pipe), 8)
    adapter = read_adapter(src, type(pipe), adapted_components(pipe), 8, max_unknown_keys=1)
    assert list(adapter.layers) == [key] and adapter.skipped == ("text_encoder.q.lora_A.weight",)
