"""Quantized weights on the worker (``xema_ray.mitigation.weight_quant``, the ``balanced`` tier):
tiny-flux2's transformer loaded int8 weight-only with torchao holds about a quarter of its fp32
bytes in the layers it quantizes, its image stays within a bounded error of lossless's, a worker
serving both holds a quantized copy beside its own weights and lossless stays bit-exact, and a
model whose spec names no quantizable weights refuses a quantized config."""

from __future__ import annotations

import pytest
import torch

from tests.batch_sizes import mean_abs_difference
from xema_ray.mitigation.weight_quant import WeightQuantConfig, quantized_copy, stored_bytes
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.models.weight_formats import transformer_bytes
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime import Batch, GenerationRequest
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

T = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=4)
#: the issue's bound on a quantized image's mean difference from lossless, in 8-bit levels
MEAN_BOUND = 32.0


def _worker(plans: tuple[ExecutionConfig, ...], formats: tuple[str, ...] = ()) -> Worker:
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model=T.model, plans=plans, weight_formats=formats))  # type: ignore[arg-type]
    return w


def _image(w: Worker, config: ExecutionConfig, seed: int = 5) -> bytes:
    batch = Batch(config=config, requests=(GenerationRequest(request_id="r", prompt="a red fox", seed=seed),),
                  steps=T.steps)
    return w.execute(batch).outputs[0].data


def _quantized_layers(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    rule = get_model_spec(T.model).weight_quant
    assert rule is not None
    return [m for n, m in transformer.named_modules() if rule.quantizes(n, m)]


def test_int8_load_holds_a_quarter_of_the_fp32_bytes_and_stays_within_the_bound() -> None:
    lossless = _worker((ExecutionConfig(template=T),))
    balanced = _worker((ExecutionConfig(template=T, weights="int8"),))
    own = lossless.engine.pipe.transformer  # type: ignore[union-attr]
    quant = balanced.engine.pipe.transformer  # type: ignore[union-attr]
    assert balanced.engine.weights == "int8" and type(_quantized_layers(quant)[0].weight).__name__ == "Int8Tensor"
    fp32 = sum(stored_bytes(m) for m in _quantized_layers(own))
    int8 = sum(stored_bytes(m) for m in _quantized_layers(quant))
    assert 0.25 <= int8 / fp32 <= 0.30  # 1 byte of 4, plus a scale and a zero point per output channel
    rule = get_model_spec(T.model).weight_quant
    assert int8 == transformer_bytes(own, rule, "int8")[0]  # type: ignore[arg-type]  # the planner's figure, exact
    whole = stored_bytes(quant) / stored_bytes(own)
    assert whole < 0.6  # the kept layers (embedders, modulation, output) stay fp32
    diff = mean_abs_difference(_image(lossless, ExecutionConfig(template=T)),
                               _image(balanced, ExecutionConfig(template=T, weights="int8")))
    print(f"tiny-flux2 int8: quantized layers {int8 / fp32:.3f} of fp32, transformer {whole:.3f}; "
          f"image mean |diff| {diff:.2f} of 255 levels")
    assert 0 < diff <= MEAN_BOUND


def test_a_worker_serving_both_keeps_a_copy_and_lossless_bit_exact() -> None:
    plain = _worker((ExecutionConfig(template=T),))
    both = _worker((ExecutionConfig(template=T),), formats=("int8",))
    assert set(both.engine.quantized) == {"int8"}  # type: ignore[union-attr]
    lossless = ExecutionConfig(template=T)
    own = both.engine.pipe.transformer  # type: ignore[union-attr]
    assert _image(both, lossless) == _image(plain, lossless)  # the copy leaves the model's own weights alone
    alone = _worker((ExecutionConfig(template=T, weights="int8"),))
    quantized = ExecutionConfig(template=T, weights="int8")
    assert _image(both, quantized) == _image(alone, quantized)  # a swapped-in copy runs as a quantized load
    assert both.engine.pipe.transformer is own  # type: ignore[union-attr]  # swapped back after the batch
    assert _image(both, lossless) == _image(plain, lossless)


def test_quantized_copy_leaves_the_original() -> None:
    spec = get_model_spec(T.model)
    t = spec.build_transformer(BuildOptions())
    before = stored_bytes(t)
    q = quantized_copy(t, spec, WeightQuantConfig(format="fp8"))
    assert stored_bytes(t) == before and stored_bytes(q) < before


def test_error_raised_if_model_has_no_quantizable_weights() -> None:
    with pytest.raises(ValueError, match="no quantizable weights"):
        ExecutionConfig(template=RequestTemplate(model="tiny-qwen-image", height=64, width=64, steps=2),
                        weights="int8")
