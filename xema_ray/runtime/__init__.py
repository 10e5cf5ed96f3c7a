"""Runtime: the execution engine, the worker interface and the output encoders."""

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
]
