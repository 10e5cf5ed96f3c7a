"""Wan2.2 LoRA pairs: ``experts: {high_noise, low_noise}`` (the slot decides the expert whatever the
keys' prefix, as diffusers' ``load_into_transformer_2=True``), a combined file given as ``path``
split per expert, and the 4xx that name the field or the file (meta-built models: shapes only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from xema_ray.lora import AdapterPathRefused, AdapterRejected, AdapterSource, read_adapter
from xema_ray.lora.pool import adapted_components
from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.serving.api.adapters import _refused
from xema_ray.serving.api.errors import BodyError
from xema_ray.serving.api.validation import parse_body

_PIPES: dict[str, Any] = {}
Q = "blocks.0.attn1.to_q"


def _pipe(model: str) -> Any:
    if model not in _PIPES:
        _PIPES[model] = get_model_spec(model).build_pipeline(BuildOptions(device="meta"))
    return _PIPES[model]


def _pair(prefix: str, r: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    m = dict(_pipe("tiny-wan2.2").transformer.named_modules())[Q]
    g = torch.Generator().manual_seed(seed)
    return {f"{prefix}{Q}.lora_A.weight": torch.randn(r, m.in_features, generator=g),
            f"{prefix}{Q}.lora_B.weight": torch.randn(m.out_features, r, generator=g)}


def _read(tmp_path: Path, model: str = "tiny-wan2.2", **files: Any) -> Any:
    pipe = _pipe(model)
    return read_adapter(AdapterSource(name="pair", model=model, **files), type(pipe), adapted_components(pipe), 8)


def _file(tmp_path: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    p = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(p))
    return p


@pytest.mark.parametrize(("body", "param"), [
    ({"path": "/srv/a.safetensors", "experts": {"low_noise": "/srv/b.safetensors"}}, "experts"),
    ({"experts": {"middle_noise": "/srv/b.safetensors"}}, "experts.middle_noise"),
    ({"experts": {}}, "experts"),
])
def test_error_raised_if_experts_is_given_badly(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BodyError) as e:
        parse_body(AdapterSource, {"name": "pair", "model": "tiny-wan2.2", **body})
    assert e.value.status == 422 and e.value.param == param, (e.value.status, e.value.param)


def test_error_raised_if_experts_names_a_one_expert_model(tmp_path: Path) -> None:
    f = write_adapter(tmp_path / "f.safetensors", _pipe("tiny-flux2").transformer)
    with pytest.raises(AdapterRejected, match="one expert") as e:
        _read(tmp_path, "tiny-flux2", experts={"low_noise": f})
    answer = _refused(e.value)
    assert answer is not None and answer.status_code == 422
    assert json.loads(answer.body)["error"]["param"] == "experts"


@pytest.mark.parametrize("prefix", ["transformer.", "transformer_2.", "diffusion_model."])
def test_the_slot_decides_the_expert_whatever_the_prefix(prefix: str, tmp_path: Path) -> None:
    if prefix == "diffusion_model.":  # Wan's original names, as diffusers' converter reads them
        tensors = {k.replace("attn1.to_q", "self_attn.q"): v for k, v in _pair(prefix).items()}
    else:
        tensors = _pair(prefix)
    f = _file(tmp_path, "f", tensors)
    low = _read(tmp_path, experts={"low_noise": f})
    high = _read(tmp_path, experts={"high_noise": f})
    assert list(low.layers) == [f"transformer_2.{Q}"] and list(high.layers) == [f"transformer.{Q}"]
    assert torch.equal(low.layers[f"transformer_2.{Q}"].a, high.layers[f"transformer.{Q}"].a)
    assert low.layers_per_component() == {"transformer_2": 1}


def test_a_single_path_adapts_the_high_noise_expert_and_a_combined_file_is_split(tmp_path: Path) -> None:
    one = _file(tmp_path, "one", _pair("transformer."))
    assert list(_read(tmp_path, path=one).layers) == [f"transformer.{Q}"]
    both = _file(tmp_path, "both", _pair("transformer.", seed=1) | _pair("transformer_2.", seed=2))
    split = _read(tmp_path, path=both)
    assert split.layers_per_component() == {"transformer": 1, "transformer_2": 1}
    assert not torch.equal(split.layers[f"transformer.{Q}"].a, split.layers[f"transformer_2.{Q}"].a)
    # the same pair as two files through experts lands on the same layers with the same factors
    hi = _file(tmp_path, "hi", _pair("transformer.", seed=1))
    lo = _file(tmp_path, "lo", _pair("transformer.", seed=2))
    pair = _read(tmp_path, experts={"high_noise": hi, "low_noise": lo})
    assert set(pair.layers) == set(split.layers)
    for k in pair.layers:
        assert torch.equal(pair.layers[k].a, split.layers[k].a) and torch.equal(pair.layers[k].b, split.layers[k].b)


def test_error_raised_if_an_expert_file_holds_both_experts(tmp_path: Path) -> None:
    both = _file(tmp_path, "both", _pair("transformer.") | _pair("transformer_2."))
    with pytest.raises(AdapterRejected, match="both experts") as e:
        _read(tmp_path, experts={"low_noise": both})
    assert e.value.param == "experts.low_noise"


def test_error_raised_naming_the_file_if_its_keys_fit_no_layer_of_its_expert(tmp_path: Path) -> None:
    good = _file(tmp_path, "good", _pair("transformer."))
    flux = write_adapter(tmp_path / "flux.safetensors", _pipe("tiny-flux2").transformer)  # another model's layers
    with pytest.raises(AdapterRejected, match=r"experts.low_noise: no LoRA layer of flux.safetensors matches the "
                                              r"low-noise expert \(transformer_2\)"):
        _read(tmp_path, experts={"high_noise": good, "low_noise": flux})


def test_a_path_outside_the_roots_is_refused_naming_its_field() -> None:
    answer = _refused(AdapterPathRefused("pair", "experts.low_noise"))
    assert answer is not None and answer.status_code == 403
    body = json.loads(answer.body)["error"]
    assert body["param"] == "experts.low_noise" and "experts.low_noise is not under" in body["message"]
