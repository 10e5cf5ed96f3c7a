"""A decode worker: the model's VAE resident, decoding the latents a DiT worker handed over
(``ExecutionConfig.decode``, docs/decode-stage.md).

A DiT worker whose plan hands its decode to a pool stops at the latents (``run_pipeline(output_type=
"latent")``) and returns them per request as ``HandedLatents`` in its ``BatchResult``; the group
puts them in Ray's object store and a decode worker of its pool (``serving/group/decode_pool.py``)
turns each request's latents into its MP4 (``decode``), bit-exact with a decode in place: the
same seeded weights, the model spec's own decode (``ModelSpec.decode_latents``), the same encoder.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.models import get_model_spec
from xema_ray.plan import Mitigation
from xema_ray.platforms import get_platform
from xema_ray.runtime.encode import encode_mp4
from xema_ray.runtime.requests import DEFAULT_VIDEO_FPS, RequestOutput


class HandedLatents(BaseModel):
    """One request's denoised latents as a DiT worker hands them to the decode stage."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    request_id: str
    seed: int
    latents: np.ndarray = Field(repr=False, description="the pipeline's latents of this one request, [1, ...]")
    prompt_tokens: int | None = None
    prompt_truncated: bool = False


class DecodeLoad(BaseModel):
    """What a decode worker builds: the group's model (its VAE) as the DiT workers build it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    weights_dir: Any = Field(default=None, description="the group's diffusers directory (a Path); None: random weights")
    dtype: str | None = None
    component_dtypes: dict[str, str] = Field(default_factory=dict)
    seed: int = Field(default=0, ge=0, description="seed of random weights: the DiT workers' (identical VAE)")


class DecodeWorker:
    """One decode worker (a Ray actor in a pool, or in-process in tests). ``load`` builds the
    model's pipeline and drops everything but what ``ModelSpec.decode_components`` names (the VAE);
    ``decode`` turns one request's latents into its output."""

    def __init__(self, platform: str = "cpu") -> None:
        self.platform = get_platform(platform)
        self.pipe: Any = None
        self.spec: Any = None
        self.decoded = 0

    def load(self, load: DecodeLoad) -> str:
        """Build the VAE on this worker's device; returns the device's name."""
        from xema_ray.models.build_options import BuildOptions
        from xema_ray.models.dtypes import model_dtypes

        spec = get_model_spec(load.model)
        if not spec.hands_over_latents:
            raise ValueError(f"{spec.name} decodes in place only: its group cannot hold a decode pool")
        dtype, kept = model_dtypes(spec, load.dtype, load.component_dtypes)  # type: ignore[arg-type]
        device = self.platform.device(0)
        opts = BuildOptions(device=str(device), dtype=dtype, weights_dir=load.weights_dir, seed=load.seed,
                            component_dtypes=kept, text_encoder="none")
        pipe = spec.build_pipeline(opts)
        keep = set(spec.decode_components())
        for name in spec.component_names():
            if name not in keep and getattr(pipe, name, None) is not None:
                setattr(pipe, name, None)  # the VAE resident, nothing else of the model
        self.pipe, self.spec, self.device = pipe, spec, device
        return str(device)

    def decode(self, handed: HandedLatents, mitigations: tuple[Mitigation, ...] = ()) -> RequestOutput:
        """``handed``'s frames as its MP4, under the pool's VAE ``mitigations``."""
        if self.pipe is None:
            raise RuntimeError("decode worker not loaded")
        import torch

        from xema_ray.runtime.engine import apply_config_mitigations

        latents = torch.from_numpy(np.ascontiguousarray(handed.latents)).to(self.device, self.pipe.vae.dtype)
        with apply_config_mitigations(self.pipe, self.spec, mitigations):
            frames = np.asarray(self.spec.decode_latents(self.pipe, latents))[0]  # [F, H, W, 3]
        fps = float(getattr(self.spec, "frame_rate", DEFAULT_VIDEO_FPS))
        self.decoded += 1
        return RequestOutput(request_id=handed.request_id, seed=handed.seed, media_type="video/mp4",
                             data=encode_mp4(frames, fps), width=frames.shape[2], height=frames.shape[1],
                             frames=frames.shape[0], prompt_tokens=handed.prompt_tokens,
                             prompt_truncated=handed.prompt_truncated)

    def ping(self) -> float:
        """An answer when alive (a pool's health probe)."""
        return time.time()
