"""Tiny pipelines and a runner shared by the mitigation tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.templates import RequestTemplate

TINY_MODELS = ("tiny-flux2", "tiny-cogvideox", "tiny-ltx2")


def tiny_template(model: str, batch: int = 1) -> RequestTemplate:
    spec = get_model_spec(model)
    frames = 1 if spec.kind == "image" else 9
    return RequestTemplate(model=model, height=64, width=64, frames=frames, steps=2, batch=batch)


def run_pipeline(pipe: Any, model: str, batch: int = 1) -> torch.Tensor:
    """One seeded pipeline call; returns the decoded pixels."""
    spec = get_model_spec(model)
    t = tiny_template(model, batch)
    prompts = [f"prompt {i}" for i in range(batch)]
    generator = torch.Generator("cpu").manual_seed(0)
    with torch.no_grad():
        out = pipe(**spec.call_kwargs(t), **spec.prompt_embeddings(prompts, "cpu", torch.float32),
                   generator=generator, output_type="pt")
    return out[0]


@pytest.fixture(scope="module")
def no_onednn() -> Iterator[None]:
    """oneDNN off for the whole module (reference and mitigated runs alike): it picks a convolution
    algorithm by batch size, so a sub-batch would take another (equally correct) kernel than the
    whole batch and the last bits would differ. A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("no_onednn")``."""
    with torch.backends.mkldnn.flags(enabled=False):
        yield


@pytest.fixture(scope="module")
def pipelines() -> dict[str, Any]:
    return {m: get_model_spec(m).build_pipeline(BuildOptions()) for m in TINY_MODELS}
