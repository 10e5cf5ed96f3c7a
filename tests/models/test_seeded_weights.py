"""Seeded random weights filled where they live (issue #24): the real-size (tiled) tensors are
allocated at their home and filled there from a pattern drawn on the CPU, so a GPU build holds
the same bytes as a CPU build of the same seed. On CPU: the placed fill equals the reference
fill (the pattern copied chunk by chunk into a host tensor, as before), for device and host
homes; tests/gpu/test_seeded_weights_gpu.py checks a CUDA build against a CPU build."""

from __future__ import annotations

import torch
from torch import nn

from xema_ray.models.loading import _TILE, TILE_THRESHOLD, SeededWeights, _seed_for, materialize
from xema_ray.placement import WeightHome


def _reference(seed: int, component: str, path: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tiled values as the CPU path always made them: a host tensor per weight, the pattern
    copied in chunk by chunk, 1-D tensors by the documented fallback."""
    gen = torch.Generator(device="cpu").manual_seed(_seed_for(seed, component, path))
    out = {}
    for n, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        v = torch.empty(t.shape, dtype=dtype)
        if v.dim() <= 1:
            v.fill_(1.0 if "weight" in n else 0.0)
        else:
            bound = v.shape[-1] ** -0.5
            base = torch.empty(_TILE, dtype=dtype).uniform_(-bound, bound, generator=gen)
            flat = v.view(-1)
            for start in range(0, flat.numel(), _TILE):
                k = min(_TILE, flat.numel() - start)
                flat[start:start + k].copy_(base[:k])
        out[n] = v
    return out


def _big_linear() -> nn.Module:
    # 4097 x 4097 > 2^24 elements (tiled) and a bias; the last repeat of the pattern is cut short
    with torch.device("meta"):
        return nn.Linear(4097, 4097, dtype=torch.bfloat16)


def test_placed_fill_gives_the_reference_bytes_for_device_and_host_homes() -> None:
    module = _big_linear()
    assert module.weight.numel() > TILE_THRESHOLD and module.weight.numel() % _TILE
    ref = _reference(7, "transformer", "blocks.3.ff", module, torch.bfloat16)
    source = SeededWeights(7, "transformer")
    for values in (source.values("blocks.3.ff", module, torch.bfloat16),
                   source.placed_values("blocks.3.ff", module, torch.bfloat16, torch.device("cpu")),
                   source.placed_values("blocks.3.ff", module, torch.bfloat16, torch.device("cpu"), pin=False)):
        assert values.keys() == ref.keys()
        for n in ref:
            assert torch.equal(values[n].view(torch.int16), ref[n].view(torch.int16)), n


def test_materialize_places_the_same_bytes_whatever_the_home() -> None:
    seed_source = SeededWeights(3, "vae")

    def build(home: WeightHome) -> nn.Module:
        root = nn.Sequential(_big_linear(), nn.Linear(8, 8, device="meta"))
        materialize(root, torch.device("cpu"), torch.bfloat16, seed_source, lambda _p: home)
        return root

    device_homed, host_homed = build(WeightHome.DEVICE), build(WeightHome.HOST)
    for (n, a), (_, b) in zip(device_homed.state_dict().items(), host_homed.state_dict().items(), strict=True):
        assert a.device.type == "cpu" and torch.equal(a.view(torch.int16), b.view(torch.int16)), n
    ref = _reference(3, "vae", "0", device_homed[0], torch.bfloat16)
    assert torch.equal(device_homed[0].weight.view(torch.int16), ref["weight"].view(torch.int16))
