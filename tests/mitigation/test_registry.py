"""Every primitive has the one entry point ``apply(pipe, spec, config, comm)``; the registry finds it
by the config's type (a table, no ``isinstance`` chain)."""

from __future__ import annotations

import inspect
import typing

import pytest

from xema_ray.mitigation import activation_offload, block_offload, dit_chunking, hsdp, serialization, vae_chunking
from xema_ray.mitigation.registry import PRIMITIVES, PrimitiveConfig, apply_config, apply_mitigations
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import Mitigation

MODULES = (activation_offload, block_offload, dit_chunking, hsdp, serialization, vae_chunking)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_primitive_has_the_one_signature(module: object) -> None:
    params = list(inspect.signature(module.apply).parameters)  # type: ignore[attr-defined]
    assert params == ["pipe", "spec", "config", "comm"]
    assert module.apply in PRIMITIVES.values()  # type: ignore[attr-defined]


def test_the_table_covers_every_config_type() -> None:
    assert set(PRIMITIVES) == set(typing.get_args(PrimitiveConfig))


def test_an_unknown_config_is_refused_by_name() -> None:
    spec = get_model_spec("tiny-flux2")
    pipe = spec.build_pipeline(BuildOptions(device="meta"))
    with pytest.raises(TypeError, match="no primitive applies a Mitigation; known: BlockOffloadConfig"):
        apply_config(pipe, spec, Mitigation(kind="hsdp", blocks=(0,), intensity=1), None)  # type: ignore[arg-type]


def test_hsdp_without_a_group_is_refused() -> None:
    spec = get_model_spec("tiny-flux2")
    pipe = spec.build_pipeline(BuildOptions(device="meta"))
    with pytest.raises(ValueError, match="hsdp needs a process group"):
        apply_mitigations(pipe, spec, [Mitigation(kind="hsdp", blocks=(0,), intensity=1)])
