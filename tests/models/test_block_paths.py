"""A spec's DiT block paths read from its config (``ModelSpec.dit_block_paths``: what the residency,
the host-memory count and the planner use without building the transformer) are those of the built
transformer's blocks (``ModelSpec.dit_blocks``), in execution order, for every registered model."""

from __future__ import annotations

import pytest
import torch

from xema_ray.models import MODEL_NAMES, get_model_spec
from xema_ray.models.loading import build_on_meta
from xema_ray.runtime.residency import block_paths


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_block_paths_from_the_config_are_the_built_transformers(model: str) -> None:
    spec = get_model_spec(model)
    transformer = build_on_meta(spec.transformer_class(), spec.transformer_config, torch.float32)
    built = [p for p, _ in spec.dit_blocks(transformer)]
    assert built and spec.dit_block_paths() == built == block_paths(spec)
