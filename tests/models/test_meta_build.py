"""``build_on_meta`` skips ``torch.nn.init`` on meta parameters (nothing to set) and nothing else."""

from __future__ import annotations

import torch
from torch import nn

from xema_ray.models.loading import build_on_meta, no_init_on_meta


def test_initialisers_skip_meta_tensors_only() -> None:
    meta, real = torch.empty(4, 4, device="meta"), torch.zeros(4, 4)
    with no_init_on_meta():
        assert nn.init.kaiming_uniform_(meta) is meta
        nn.init.ones_(real)
    assert bool((real == 1).all())
    nn.init.zeros_(real)  # restored afterwards
    assert bool((real == 0).all()) and nn.init.ones_ is not None


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.arange(4.0))  # computed by the constructor, kept real


class _Model(_Block):
    @classmethod
    def from_config(cls, _config: dict) -> _Model:  # the diffusers interface build_on_meta calls
        return cls()


def test_meta_build_keeps_shapes_and_real_buffers() -> None:
    model = build_on_meta(_Model, {}, torch.float32)
    assert model.proj.weight.is_meta and tuple(model.proj.weight.shape) == (8, 8)
    assert model.scale.device.type == "cpu" and model.scale.tolist() == [0.0, 1.0, 2.0, 3.0]
