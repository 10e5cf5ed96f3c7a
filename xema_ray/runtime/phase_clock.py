"""Where a pipeline call's phases begin and end: time in ``encode_prompt`` and the first entry into
a decoder, marked by shadowing methods and forward hooks for the length of one call."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from xema_ray.platforms import Platform

def _shadow(obj: Any, name: str, value: Callable[..., Any]) -> Callable[[], None]:
    """Set an instance attribute that shadows a method; return the undo. Restores a previous
    instance-level override (another hook, e.g. the analyzer's markers) instead of deleting it."""
    previous = vars(obj).get(name)
    setattr(obj, name, value)

    def undo() -> None:
        if previous is None:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)

    return undo


class PhaseClock:
    """Marks phase boundaries inside a pipeline call: time spent in ``encode_prompt`` and the
    first entry into a decoder (video VAE, audio VAE, vocoder). Installed as instance
    attributes / forward hooks and removed on exit."""

    def __init__(self, pipe: Any, platform: Platform) -> None:
        self.pipe = pipe
        self.platform = platform
        self.encode_prompt_s = 0.0
        self.first_decode: float | None = None
        self._undo: list[Callable[[], None]] = []

    def _mark_decode(self) -> None:
        if self.first_decode is None:
            self.platform.synchronize()  # the denoising loop's kernels belong to the denoise phase
            self.first_decode = time.perf_counter()

    def __enter__(self) -> PhaseClock:
        pipe = self.pipe
        if hasattr(pipe, "encode_prompt"):
            original = pipe.encode_prompt

            @functools.wraps(original)
            def encode_prompt(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.platform.synchronize()
                    self.encode_prompt_s += time.perf_counter() - t0

            self._undo.append(_shadow(pipe, "encode_prompt", encode_prompt))
        for name in ("vae", "audio_vae"):
            comp = getattr(pipe, name, None)
            if comp is None or not hasattr(comp, "decode"):
                continue
            orig = comp.decode

            def decode(*args: Any, _orig: Callable[..., Any] = orig, **kwargs: Any) -> Any:
                self._mark_decode()
                return _orig(*args, **kwargs)

            self._undo.append(_shadow(comp, "decode", decode))
        vocoder = getattr(pipe, "vocoder", None)
        if isinstance(vocoder, nn.Module):
            handle = vocoder.register_forward_pre_hook(lambda *_: self._mark_decode())
            self._undo.append(handle.remove)
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
