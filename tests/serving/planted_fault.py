"""A fault planted inside the denoising loop, for the tests of batch isolation: it raises at the end
of a denoising step of every batch whose prompts ``when`` picks — an input no API check can catch.
The engine, the workers and the group run as they do live; only the step callback is wrapped."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from xema_ray.runtime import engine as engine_module


@dataclass
class PlantedFault:
    """What the planted fault saw: the prompts of every batch that ran, and of those it failed."""

    batches: list[list[str]] = field(default_factory=list)
    failed: list[list[str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)


@contextmanager
def planted_denoise_fault(monkeypatch: pytest.MonkeyPatch, when: Callable[[list[str]], bool],
                          error: Callable[[], Exception], times: int | None = None) -> Iterator[PlantedFault]:
    """Batches whose prompts ``when`` picks raise ``error()`` after their first denoising step
    (``times``: only the first that many of them; None: every one)."""
    seen = PlantedFault()
    local = threading.local()  # the batch running on this worker thread
    original_run, original_callback = engine_module.ExecutionEngine.run_pipeline, engine_module.step_callback

    def run_pipeline(self: Any, config: Any, prompts: list[str], *args: Any, **kwargs: Any) -> Any:
        with seen._lock:
            seen.batches.append(list(prompts))
            fire = when(list(prompts)) and (times is None or len(seen.failed) < times)
            if fire:
                seen.failed.append(list(prompts))
        local.fire = fire
        try:
            return original_run(self, config, prompts, *args, **kwargs)
        finally:
            local.fire = False

    def step_callback(*args: Any, **kwargs: Any) -> dict[str, Any]:
        inner = original_callback(*args, **kwargs).get("callback_on_step_end")

        def callback(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            out = inner(pipe, i, t, tensors) if inner is not None else tensors  # the step counts (job progress)
            if getattr(local, "fire", False):
                raise error()
            return out
        return {"callback_on_step_end": callback}

    monkeypatch.setattr(engine_module.ExecutionEngine, "run_pipeline", run_pipeline)
    monkeypatch.setattr(engine_module, "step_callback", step_callback)
    try:
        yield seen
    finally:
        monkeypatch.setattr(engine_module.ExecutionEngine, "run_pipeline", original_run)
        monkeypatch.setattr(engine_module, "step_callback", original_callback)
