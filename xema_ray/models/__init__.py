"""Model registry: one ``ModelSpec`` per servable model, real size and tiny.

Example:
    >>> spec = get_model_spec("tiny-flux2")
    >>> spec.family, spec.kind
    ('flux2', 'image')
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xema_ray.models.base import BuildOptions, ModelSpec

__all__ = ["BuildOptions", "ModelSpec", "MODEL_NAMES", "get_model_spec"]


#: registry name -> the module under ``xema_ray.models`` whose ``VARIANTS`` builds it: each spec
#: module declares its real and tiny models; the names are here too so that reading them (the
#: CLI's ``--model`` choices) imports no model code (``tests/test_cli_imports.py``)
_MODULES: dict[str, str] = {
    "flux2": "flux2",
    "cogvideox-5b": "cogvideox",
    "ltx2": "ltx2",
    "tiny-flux2": "flux2",
    "tiny-cogvideox": "cogvideox",
    "tiny-ltx2": "ltx2",
    "wan2.2-t2v-a14b": "wan",
    "tiny-wan2.2": "wan",
    "wan2.2-ti2v-5b": "wan",
    "tiny-wan2.2-ti2v": "wan",
    "wan2.2-i2v-a14b": "wan",
    "tiny-wan2.2-i2v": "wan",
    "cogvideox-5b-i2v": "cogvideox_i2v",
    "tiny-cogvideox-i2v": "cogvideox_i2v",
    "qwen-image": "qwen_image",
    "tiny-qwen-image": "qwen_image",
}

MODEL_NAMES: tuple[str, ...] = tuple(_MODULES)


@cache
def get_model_spec(name: str) -> ModelSpec:
    """The spec registered under ``name``; ValueError listing the known names otherwise."""
    try:
        module = _MODULES[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}") from None
    variants: dict[str, Callable[[], ModelSpec]] = import_module(f"xema_ray.models.{module}").VARIANTS
    return variants[name]()


def __getattr__(name: str) -> Any:
    """``BuildOptions`` and ``ModelSpec`` import torch: loaded on first use, so that reading
    ``MODEL_NAMES`` (the CLI's ``--model`` choices) stays cheap."""
    if name in ("BuildOptions", "ModelSpec"):
        from xema_ray.models import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
