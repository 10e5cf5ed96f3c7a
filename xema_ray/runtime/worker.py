"""The worker: one process, one device, one loaded model (vLLM's worker interface).

``init_device`` binds the device and joins the worker set (all SP process groups are created
here, once); ``load_model`` builds the pipeline once; ``execute`` runs a batch under any
execution config, including a different SP degree than the previous batch, without reloading;
``shutdown`` leaves the worker set. Arguments and results are pydantic, so the class can be
wrapped as a Ray actor (``ray.remote(Worker)``) unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.parallel.groups import ParallelConfig, ProcessGroups, init_process_groups
from xema_ray.parallel.sp import Backend
from xema_ray.platforms import Platform, current_platform, get_platform
from xema_ray.runtime.engine import ArmLayout, Batch, BatchResult, ExecutionEngine
from xema_ray.runtime.progress import StepObserver

DTypeName = Literal["float32", "bfloat16", "float16"]
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadConfig(BaseModel):
    """Which model a worker loads, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="registry name, e.g. 'tiny-flux2' or 'cogvideox-5b'")
    weights_dir: Path | None = Field(default=None, description="local diffusers directory; None = random weights")
    dtype: DTypeName | None = Field(default=None, description="None = bfloat16 for real models, float32 for tiny ones")
    seed: int = Field(default=0, ge=0, description="seed of random weights (identical on every worker)")


class LoadedModel(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: str
    device: str
    dtype: str
    parameters: int


class Worker:
    """One GPU (or CPU slot) of a worker set.

    Example (SP = 1, one process)::

        w = Worker()
        w.init_device(ParallelConfig(rank=0, world_size=1))
        w.load_model(ModelLoadConfig(model="tiny-flux2"))
        result = w.execute(batch)
    """

    def __init__(self, platform: Platform | str | None = None, sp_backend: Backend = "auto", arm_layout: ArmLayout | None = None) -> None:
        self.platform = get_platform(platform) if isinstance(platform, str) else (platform or current_platform())  # type: ignore[arg-type]
        self.sp_backend: Backend = sp_backend
        self.arm_layout = arm_layout
        self.groups: ProcessGroups | None = None
        self.device: torch.device | None = None
        self.engine: ExecutionEngine | None = None
        #: how many times a model was built: SP switches must leave it at 1
        self.load_count = 0

    def device_topology(self, local_index: int = 0) -> tuple[str, list[str]]:
        """This worker's device id and its direct-link peers (for NVLink-aware rank order)."""
        dev, peers = self.platform.device_topology(local_index)
        return dev, sorted(peers)

    def init_device(self, parallel: ParallelConfig, local_index: int = 0) -> None:
        """Bind this process's device and create every SP process group of the worker set."""
        self.platform.set_device(local_index)
        self.device = self.platform.device(local_index)
        self.groups = init_process_groups(parallel)

    def load_model(self, load: ModelLoadConfig) -> LoadedModel:
        """Build the pipeline on this worker's device (replacing any previous model)."""
        if self.device is None:
            raise ValueError("call init_device before load_model")
        spec = get_model_spec(load.model)
        dtype = _DTYPES[load.dtype] if load.dtype else (torch.bfloat16 if spec.size == "real" else torch.float32)
        pipe = spec.build_pipeline(
            BuildOptions(device=str(self.device), dtype=dtype, weights_dir=load.weights_dir, seed=load.seed)
        )
        self.engine = ExecutionEngine(
            pipe, spec, self.device, dtype, groups=self.groups, platform=self.platform,
            arm_layout=self.arm_layout, sp_backend=self.sp_backend,
        )
        self.load_count += 1
        params = sum(p.numel() for p in pipe.transformer.parameters())
        return LoadedModel(model=spec.name, device=str(self.device), dtype=str(dtype).removeprefix("torch."), parameters=params)

    def execute(self, batch: Batch, observer: StepObserver | None = None) -> BatchResult:
        """Run one batch (every rank of the batch's SP group must call this with the same batch);
        ``observer`` hears each finished step and may stop the batch (``xema_ray.runtime.progress``)."""
        if self.engine is None:
            raise ValueError("no model loaded: call load_model first")
        return self.engine.execute(batch, observer)

    def shutdown(self) -> None:
        """Drop the model and leave the worker set."""
        self.engine = None
        if self.groups is not None:
            self.groups.shutdown()
            self.groups = None
