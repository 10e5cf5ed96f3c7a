"""Runtime: the execution engine, the workers (``WorkerBase``: real and emulated), weight
residency, the static allocator's arena, pausing a batch, and the output encoders. Offline tools
that drive the worker (verify, layout solving, profiling) are ``xema_ray.measure``, above this
package."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xema_ray.runtime.engine import (
        Batch,
        BatchResult,
        ExecutionEngine,
        GenerationRequest,
        MitigationLibraryMissing,
        PhaseTimings,
        RequestOutput,
    )
    from xema_ray.runtime.worker import LoadedModel, ModelLoadConfig, Worker
    from xema_ray.runtime.worker_base import WorkerBase

#: name -> the module that defines it, imported on first use: a process that only speaks the
#: light modules of this package (``requests``, ``emulation``, ...) never imports torch through here
_LAZY = {
    "Batch": "engine", "BatchResult": "engine", "ExecutionEngine": "engine", "GenerationRequest": "requests",
    "MitigationLibraryMissing": "engine", "PhaseTimings": "engine", "RequestOutput": "requests",
    "LoadedModel": "worker", "ModelLoadConfig": "worker", "Worker": "worker", "WorkerBase": "worker_base",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = [
    "Batch",
    "BatchResult",
    "ExecutionEngine",
    "GenerationRequest",
    "LoadedModel",
    "MitigationLibraryMissing",
    "ModelLoadConfig",
    "PhaseTimings",
    "RequestOutput",
    "Worker",
    "WorkerBase",
]
