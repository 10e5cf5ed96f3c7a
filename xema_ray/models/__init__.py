"""Model registry: one ``ModelSpec`` per servable model, real size and tiny.

Example:
    >>> spec = get_model_spec("tiny-flux2")
    >>> spec.family, spec.kind
    ('flux2', 'image')
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xema_ray.models.base import BuildOptions, ModelSpec

__all__ = ["BuildOptions", "ModelSpec", "MODEL_NAMES", "get_model_spec"]


def _flux2(size: str) -> ModelSpec:
    from xema_ray.models.flux2 import Flux2Spec
    from xema_ray.models.text_encoders import TextEncoderSpec

    if size == "real":
        spec = Flux2Spec("flux2", "real", "flux2dev_transformer.json", "flux2dev_vae.json", text_tokens=512)
        spec.text_encoder = TextEncoderSpec("mistral3", "flux2dev_text_encoder.json", 512, out_layers=(10, 20, 30))
    else:
        spec = Flux2Spec("tiny-flux2", "tiny", "tiny_flux2_transformer.json", "tiny_flux2_vae.json", text_tokens=8)
        spec.text_encoder = TextEncoderSpec("mistral3", "tiny_flux2_text_encoder.json", 8, out_layers=(1,))
    return spec


def _cogvideox(size: str) -> ModelSpec:
    from xema_ray.models.cogvideox import CogVideoXSpec
    from xema_ray.models.text_encoders import TextEncoderSpec

    if size == "real":
        spec = CogVideoXSpec("cogvideox-5b", "real", "cogvideox5b_transformer.json", "cogvideox5b_vae.json")
        spec.text_encoder = TextEncoderSpec("t5", "cogvideox5b_text_encoder.json", spec.text_tokens)
    else:
        spec = CogVideoXSpec("tiny-cogvideox", "tiny", "tiny_cogvideox_transformer.json", "tiny_cogvideox_vae.json")
        spec.text_encoder = TextEncoderSpec("t5", "tiny_cogvideox_text_encoder.json", spec.text_tokens)
    return spec


def _cogvideox_i2v(size: str) -> ModelSpec:
    from xema_ray.models.cogvideox_i2v import CogVideoXI2VSpec
    from xema_ray.models.text_encoders import TextEncoderSpec

    if size == "real":
        spec = CogVideoXI2VSpec("cogvideox-5b-i2v", "real", "cogvideox5b_i2v_transformer.json", "cogvideox5b_vae.json")
        spec.text_encoder = TextEncoderSpec("t5", "cogvideox5b_text_encoder.json", spec.text_tokens)
    else:
        spec = CogVideoXI2VSpec("tiny-cogvideox-i2v", "tiny", "tiny_cogvideox_i2v_transformer.json",
                                "tiny_cogvideox_vae.json")
        spec.text_encoder = TextEncoderSpec("t5", "tiny_cogvideox_text_encoder.json", spec.text_tokens)
    return spec


def _ltx2(size: str) -> ModelSpec:
    from xema_ray.models.ltx2 import LTX2Spec
    from xema_ray.models.text_encoders import TextEncoderSpec

    if size == "real":
        spec = LTX2Spec("ltx2", "real", "ltx2_transformer.json", "ltx2_vae.json")
        spec.text_encoder = TextEncoderSpec("gemma3", "ltx2_text_encoder.json", spec.text_tokens)
    else:
        spec = LTX2Spec("tiny-ltx2", "tiny", "tiny_ltx2_transformer.json", "tiny_ltx2_vae.json")
        spec.text_encoder = TextEncoderSpec("gemma3", "tiny_ltx2_text_encoder.json", spec.text_tokens)
    return spec


def _wan22(size: str) -> ModelSpec:
    from xema_ray.models.text_encoders import TextEncoderSpec
    from xema_ray.models.wan import A14B_SAMPLING, TINY_SAMPLING, WanSpec

    if size == "real":
        spec = WanSpec("wan2.2-t2v-a14b", "real", "wan22_a14b_transformer.json", "wan21_vae.json", A14B_SAMPLING)
        spec.text_encoder = TextEncoderSpec("umt5", "wan22_umt5_text_encoder.json", spec.text_tokens)
    else:
        spec = WanSpec("tiny-wan2.2", "tiny", "tiny_wan22_transformer.json", "tiny_wan21_vae.json", TINY_SAMPLING)
        spec.text_encoder = TextEncoderSpec("umt5", "tiny_wan22_umt5_text_encoder.json", spec.text_tokens)
    return spec


def _wan22_i2v(size: str) -> ModelSpec:
    from xema_ray.models.text_encoders import TextEncoderSpec
    from xema_ray.models.wan import I2V_A14B_SAMPLING, TINY_I2V_SAMPLING, WanI2VSpec

    if size == "real":
        spec = WanI2VSpec("wan2.2-i2v-a14b", "real", "wan22_i2v_a14b_transformer.json", "wan21_vae.json",
                          I2V_A14B_SAMPLING)
        spec.text_encoder = TextEncoderSpec("umt5", "wan22_umt5_text_encoder.json", spec.text_tokens)
    else:
        spec = WanI2VSpec("tiny-wan2.2-i2v", "tiny", "tiny_wan22_i2v_transformer.json", "tiny_wan21_vae.json",
                          TINY_I2V_SAMPLING)
        spec.text_encoder = TextEncoderSpec("umt5", "tiny_wan22_umt5_text_encoder.json", spec.text_tokens)
    return spec


def _qwen_image(size: str) -> ModelSpec:
    from xema_ray.models.qwen_image import QwenImageSpec
    from xema_ray.models.text_encoders import TextEncoderSpec

    if size == "real":
        spec = QwenImageSpec("qwen-image", "real", "qwen_image_transformer.json", "qwen_image_vae.json", text_tokens=512)
        spec.text_encoder = TextEncoderSpec("qwen2_5_vl", "qwen_image_text_encoder.json", 512)
    else:
        spec = QwenImageSpec("tiny-qwen-image", "tiny", "tiny_qwen_image_transformer.json", "tiny_qwen_image_vae.json",
                             text_tokens=8)
        spec.text_encoder = TextEncoderSpec("qwen2_5_vl", "tiny_qwen_image_text_encoder.json", 8)
    return spec


def _wan22_ti2v_5b(size: str) -> ModelSpec:
    from xema_ray.models.text_encoders import TextEncoderSpec
    from xema_ray.models.wan import TI2V_5B_SAMPLING, TINY_TI2V_SAMPLING, WanSpec

    if size == "real":
        spec = WanSpec("wan2.2-ti2v-5b", "real", "wan22_ti2v5b_transformer.json", "wan22_vae.json", TI2V_5B_SAMPLING)
        spec.text_encoder = TextEncoderSpec("umt5", "wan22_umt5_text_encoder.json", spec.text_tokens)
    else:
        spec = WanSpec("tiny-wan2.2-ti2v", "tiny", "tiny_wan22_ti2v_transformer.json", "tiny_wan22_vae.json",
                       TINY_TI2V_SAMPLING)
        spec.text_encoder = TextEncoderSpec("umt5", "tiny_wan22_umt5_text_encoder.json", spec.text_tokens)
    return spec


_FACTORIES: dict[str, Callable[[], ModelSpec]] = {
    "flux2": lambda: _flux2("real"),
    "cogvideox-5b": lambda: _cogvideox("real"),
    "ltx2": lambda: _ltx2("real"),
    "tiny-flux2": lambda: _flux2("tiny"),
    "tiny-cogvideox": lambda: _cogvideox("tiny"),
    "tiny-ltx2": lambda: _ltx2("tiny"),
    "wan2.2-t2v-a14b": lambda: _wan22("real"),
    "tiny-wan2.2": lambda: _wan22("tiny"),
    "wan2.2-ti2v-5b": lambda: _wan22_ti2v_5b("real"),
    "tiny-wan2.2-ti2v": lambda: _wan22_ti2v_5b("tiny"),
    "wan2.2-i2v-a14b": lambda: _wan22_i2v("real"),
    "tiny-wan2.2-i2v": lambda: _wan22_i2v("tiny"),
    "cogvideox-5b-i2v": lambda: _cogvideox_i2v("real"),
    "tiny-cogvideox-i2v": lambda: _cogvideox_i2v("tiny"),
    "qwen-image": lambda: _qwen_image("real"),
    "tiny-qwen-image": lambda: _qwen_image("tiny"),
}

MODEL_NAMES: tuple[str, ...] = tuple(_FACTORIES)


@cache
def get_model_spec(name: str) -> ModelSpec:
    """The spec registered under ``name``; ValueError listing the known names otherwise."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}") from None
    return factory()


def __getattr__(name: str) -> Any:
    """``BuildOptions`` and ``ModelSpec`` import torch: loaded on first use, so that reading
    ``MODEL_NAMES`` (the CLI's ``--model`` choices) stays cheap."""
    if name in ("BuildOptions", "ModelSpec"):
        from xema_ray.models import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
