"""Runtime: the execution engine, the workers (``WorkerBase``: real and emulated), weight
residency, the static allocator's arena, pausing a batch, and the output encoders. Offline tools
that drive the worker (verify, layout solving, profiling) are ``xema_ray.measure``, above this
package."""

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
