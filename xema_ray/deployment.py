"""What a deployment serves, as the planner and the serving app both read it: the model groups'
sizes and templates from a ``serve run`` YAML (``applications[0].args``).

The serving app validates the whole document (``xema_ray.serving.config.ServeConfig``, whose
``ModelGroupConfig`` extends ``GroupShape`` here); the planner reads only the shape it plans for,
so planning never imports serving (docs/architecture.md, "The layers").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from xema_ray.models import MODEL_NAMES
from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.plan import gpu_share
from xema_ray.tier_plan import QualityTierSpec, check_tiers
from xema_ray.templates import RequestTemplate


class TemplateSpec(BaseModel):
    """A template to serve: ``{"width": 64, "height": 64, "frames": 1, "steps": 4}``."""

    model_config = ConfigDict(extra="forbid")

    width: int = Field(gt=0)
    height: int = Field(gt=0)
    frames: int = Field(default=1, ge=1)
    steps: int = Field(default=50, ge=1)
    references: int = Field(default=0, ge=0, description="reference images per request (edits, image-to-video)")
    reference_width: int = Field(default=0, ge=0, description="width the references are encoded at (0: output width)")
    reference_height: int = Field(default=0, ge=0, description="height the references are encoded at (0: output "
                                                               "height)")


#: the dtypes a group may compute in or keep a component in (``xema_ray.models.base.DTYPES``)
DTypeName = Literal["float32", "bfloat16", "float16"]


class DecodePoolConfig(BaseModel):
    """A model group's decode pool (the YAML's ``decode:`` block): ``workers`` decode workers, Ray
    actors of their own beside the group's DiT workers (on top of its ``workers``), each holding
    the model's VAE and decoding the latents the DiT workers hand over (docs/decode-stage.md). On
    ``device: cuda`` each takes ``gpus_per_worker`` GPUs (a whole number or a fraction that divides
    one: 1, 0.5, 0.25); on ``device: cpu`` each takes the app's ``worker_cpus`` and no GPU.

    Example:
        >>> DecodePoolConfig(workers=2, gpus_per_worker=0.5).gpus
        1.0
        >>> DecodePoolConfig(workers=3, gpus_per_worker=0.5).whole_gpus
        2
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    workers: int = Field(ge=1, le=64, description="decode workers in the pool (at least 1)")
    gpus_per_worker: float = Field(default=1.0, gt=0, description="GPUs each decode worker takes on device: cuda: a "
                                   "whole number or a fraction that divides one GPU (1, 0.5, 0.25, 0.125); "
                                   "unused on device: cpu (a decode worker takes worker_cpus)")

    @field_validator("gpus_per_worker")
    @classmethod
    def _divides_a_gpu(cls, v: float) -> float:
        return gpu_share(v)

    @property
    def gpus(self) -> float:
        """The GPUs the whole pool takes on a GPU device."""
        return self.workers * self.gpus_per_worker

    @property
    def whole_gpus(self) -> int:
        """The whole GPUs the pool occupies (fractional workers packed onto shared GPUs), as a plan
        counts a pool (``xema_ray.plan.DecodeStage.gpus``)."""
        return math.ceil(self.gpus - 1e-9)


class GroupShape(BaseModel):
    """One model group as planning sees it: the model, its GPUs, its templates and its dtypes
    (they decide the weights' and activations' bytes the plans are traced with)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description=f"registry name: {', '.join(MODEL_NAMES)}")
    workers: int = Field(default=1, ge=1, le=64, description="the group's DiT workers: its GPUs (or CPU slots) "
                                                              "but a decode pool's, which come on top")
    templates: list[TemplateSpec] = Field(min_length=1)
    dtype: DTypeName | None = Field(
        default=None, description="the dtype the group computes in; a checkpoint stored in another is cast on load "
                                  "(a log line says so). None: bfloat16 for real models, float32 for tiny ones")
    component_dtypes: dict[str, DTypeName] = Field(
        default_factory=dict,
        description="components kept in a dtype of their own, e.g. {vae: float32} (CogVideoX-5b's repository stores "
                    "its VAE in fp32): their bytes are what the plans are traced with. Not the transformer")
    adapters: LoraPoolConfig | None = Field(
        default=None, description="serve LoRA adapters per request: the folder loaded at start-up and the device "
                                  "pool (slots x max_rank) the plans count; None: no adapters")
    quality_tiers: dict[str, QualityTierSpec] | None = Field(
        default=None, description="the quality tiers the group serves, name -> {cache, weights} (lossless "
                                  "required, as every step in the model's weights); None: lossless and fast "
                                  "(xema_ray.tier_plan.DEFAULT_TIERS; docs/quality.md)")
    weights_dir: Path | None = Field(
        default=None, description="the group's diffusers checkpoint (None: random weights): its scheduler config is "
                                  "the one the workers run, so plans are priced on it")
    decode: DecodePoolConfig | None = Field(
        default=None, description="a decode pool of the group's own: {workers, gpus_per_worker}, on top of its "
                                  "workers; the templates the plan table hands to a pool (config.decode) decode "
                                  "there, the others in place. None: every decode in place (docs/decode-stage.md)")

    def scheduler_config(self) -> dict[str, Any] | None:
        """The scheduler config of the group's checkpoint (None: no ``weights_dir``, or it has none:
        the workers run the spec's). A relative ``weights_dir`` is the current directory's, as
        ``serve run`` reads it."""
        if self.weights_dir is None:
            return None
        from xema_ray.models.base import checkpoint_scheduler_config

        return checkpoint_scheduler_config(self.weights_dir.expanduser().resolve())

    @model_validator(mode="after")
    def _known_model(self) -> GroupShape:
        if self.model not in MODEL_NAMES:
            raise ValueError(f"unknown model {self.model!r}; known: {', '.join(MODEL_NAMES)}")
        if self.quality_tiers is not None:
            check_tiers(self.quality_tiers)
        if self.decode is not None:
            from xema_ray.models import get_model_spec

            if not get_model_spec(self.model).hands_over_latents:
                raise ValueError(f"decode: {self.model} decodes in place only (its spec offers no decode of handed-over "
                                 "latents): drop its decode: block")
        if self.component_dtypes:
            from xema_ray.models import get_model_spec
            from xema_ray.models.base import model_dtypes

            model_dtypes(get_model_spec(self.model), self.dtype, self.component_dtypes)  # names checked there
        return self

    @property
    def gpus(self) -> int:
        """The GPUs the group occupies, as its plan table counts them (``PlanTable.group_gpus``): its
        DiT workers and, on top of them, its decode pool's whole GPUs."""
        return self.workers + (self.decode.whole_gpus if self.decode is not None else 0)

    @property
    def pool(self) -> tuple[int, float] | None:
        """The decode pool's shape, ``(workers, gpus_per_worker)`` (None: no pool), as the planner's
        decode-stage pass takes it (``planner.decode_stage.choose_decode``)."""
        return None if self.decode is None else (self.decode.workers, self.decode.gpus_per_worker)

    @property
    def default_dtypes(self) -> bool:
        """The group computes in its model's default dtype and keeps no component in another."""
        return self.dtype is None and not self.component_dtypes


class DeploymentShape(BaseModel):
    """The model groups of a deployment (every other key of the app's args is serving's)."""

    model_config = ConfigDict(extra="ignore")

    models: list[GroupShape] = Field(min_length=1)
    host_memory: str | None = Field(default=None, description="the node's RAM the deployment states, e.g. 512GB "
                                                               "(the planner's host budget unless --host-budget)")

    @classmethod
    def from_serve_yaml(cls, path: Path) -> DeploymentShape:
        """Read ``applications[0].args`` of a ``serve run`` YAML.

        Raises:
            ValueError: the file is not a Serve config with an application's args.
        """
        import yaml

        doc = yaml.safe_load(path.read_text())
        apps = (doc or {}).get("applications") or []
        if not apps or "args" not in apps[0]:
            raise ValueError(f"{path}: expected a Serve config with applications[0].args (as deployments/xema.yaml)")
        return cls.model_validate(apps[0]["args"])


def served_templates(groups: list[GroupShape]) -> list[RequestTemplate]:
    """Every configured template, validated (a bad one fails with its reason)."""
    return [RequestTemplate(model=g.model, width=t.width, height=t.height, frames=t.frames, steps=t.steps,
                            references=t.references, reference_width=t.reference_width,
                            reference_height=t.reference_height)
            for g in groups for t in g.templates]
