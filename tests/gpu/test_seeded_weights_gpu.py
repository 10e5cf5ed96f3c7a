"""GPU check of seeded weights (run by `make gpu-check`, first: every real-size GPU test builds
with them): one Flux.2 double-stream block and the VAE's first up block, built on CUDA (real-size
tensors filled on the GPU from the CPU-drawn pattern) and on the CPU, hold the same bytes; and a
host-homed (pinned) build of the block too. tests/models/test_seeded_weights.py is the CPU half."""

from __future__ import annotations

import pytest
import torch

from xema_ray.models import get_model_spec
from xema_ray.models.loading import TILE_THRESHOLD, SeededWeights, build_on_meta, materialize
from xema_ray.placement import WeightHome

pytestmark = pytest.mark.gpu


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


CASES = [("transformer", "transformer_blocks.0"), ("vae", "decoder.up_blocks.0")]


def test_cuda_build_holds_the_cpu_build_bytes() -> None:
    for component, path in CASES:  # one process for both (the check runs each test in its own)
        _check(component, path)


def _check(component: str, path: str) -> None:
    spec = get_model_spec("flux2" if component == "transformer" else "cogvideox-5b")
    cls, cfg = ((spec.transformer_class(), spec.transformer_config) if component == "transformer"
                else (spec.vae_class(), spec.vae_config))
    built = {}
    for where, home in (("cuda", WeightHome.DEVICE), ("cpu", WeightHome.DEVICE), ("cuda-host", WeightHome.HOST)):
        root = build_on_meta(cls, cfg, torch.bfloat16)
        sub = root.get_submodule(path)
        device = torch.device("cpu" if where == "cpu" else "cuda")
        # only this sub-tree: the seed depends on the module path, so name it as in the whole component
        source = SeededWeights(0, component)
        prefixed = _Prefixed(source, path)
        materialize(sub, device, torch.bfloat16, prefixed, lambda _p, h=home: h)
        built[where] = {n: _bits(t) for n, t in sub.state_dict().items()}
    assert any(t.numel() > TILE_THRESHOLD for t in built["cpu"].values()) or component == "vae"
    for where in ("cuda", "cuda-host"):
        assert built[where].keys() == built["cpu"].keys()
        for n, t in built["cpu"].items():
            assert torch.equal(built[where][n], t), f"{where}: {path}.{n}"


class _Prefixed(SeededWeights):
    """The component's source for a sub-tree materialised on its own (paths prefixed back)."""

    def __init__(self, source: SeededWeights, prefix: str) -> None:
        super().__init__(source.seed, source.component)
        self.prefix = prefix

    def placed_values(self, path, module, dtype, device, pin=False):  # type: ignore[no-untyped-def,override]
        full = f"{self.prefix}.{path}" if path else self.prefix
        return super().placed_values(full, module, dtype, device, pin)
