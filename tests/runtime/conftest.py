"""Fixtures shared by the runtime tests: the CPU execution engine of a tiny model.

A module that uses ``engine`` names its models in ``ENGINE_MODELS``; each of its tests that
asks for the engine runs once per model, on one engine per model built for the whole module
(fp32 on the CPU, so that outputs compare across batch sizes and runs).
"""

from __future__ import annotations

import pytest
import torch

from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.runtime import ExecutionEngine


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine" in metafunc.fixturenames:
        models = getattr(metafunc.module, "ENGINE_MODELS", None)
        assert models, f"{metafunc.module.__name__} asks for `engine`: name its models in ENGINE_MODELS"
        metafunc.parametrize("engine", list(models), indirect=True, scope="module")


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> ExecutionEngine:
    """The fp32 CPU execution engine of the model ``request.param`` (one of the module's ENGINE_MODELS)."""
    spec = get_model_spec(request.param)
    return ExecutionEngine(spec.build_pipeline(BuildOptions(device="cpu", dtype=torch.float32)), spec,
                           torch.device("cpu"), torch.float32)
