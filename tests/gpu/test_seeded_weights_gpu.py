"""GPU check of seeded weights (run by `make gpu-check`, first: every real-size GPU test builds
with them): one Flux.2 double-stream block and the VAE's first up block, built on CUDA (real-size
tensors filled on the GPU from the CPU-drawn pattern) and on the CPU, hold the same bytes; and a
host-homed (pinned) build of the block too. tests/models/test_seeded_weights.py is the CPU half.

The host-homed build is also the host-memory check of issue #36 (no extra build: the check's
device time is spent): a Flux.2 worker's offloaded block lands in one exact-size buffer page-locked
with ``cudaHostRegister``, as many bytes as the plan's figure (``worker_host_bytes``), none through
torch's power-of-two pinned allocator; the same block pinned tensor by tensor shows the rounding it
avoids; and a second mapping of a shared segment is registered too (as a second worker's is).
tests/models/test_host_pack.py is the CPU half of that."""

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


def test_cuda_build_holds_the_cpu_build_bytes_and_pins_what_the_plan_says() -> None:
    for component, path in CASES:  # one process for all (the check runs each test in its own)
        _check(component, path)
    _check_shared_registration()


def _host_reserved() -> int:
    """Bytes torch's pinned allocator holds (``torch.cuda.host_memory_stats``)."""
    return int(torch.cuda.host_memory_stats().get("reserved_bytes.current", 0))


def _check_host_memory(sub: torch.nn.Module, report, torch_before: int) -> None:  # type: ignore[no-untyped-def]
    """The host-homed Flux.2 block: one registered exact buffer, the plan's pinned bytes."""
    from xema_ray.placement import HOST_BUFFER_ATTR
    from xema_ray.platforms.host_memory import torch_pinned_bytes
    from xema_ray.runtime.host_bytes import worker_host_bytes
    from xema_ray.runtime.residency import Residency

    planned = worker_host_bytes(get_model_spec("flux2"), Residency(host_blocks=(0,)), None, share=False)
    buf = getattr(sub, HOST_BUFFER_ATTR)
    print(f"host buffer {buf.nbytes:,} B, planned pinned {planned.pinned_bytes:,} B, torch's pinned allocator "
          f"+{_host_reserved() - torch_before:,} B; per-tensor pinning would hold {report.host_pow2_bytes:,} B")
    assert buf.registered and buf.nbytes == planned.pinned_bytes == report.host_pinned_bytes
    assert _host_reserved() == torch_before  # nothing went through torch's pinned allocator
    params = list(sub.parameters())
    assert all(p.device.type == "cpu" and p.is_pinned() for p in params)  # registered memory reads as pinned
    back = params[0].to("cuda", non_blocking=True).cpu()  # an asynchronous copy from it lands intact
    assert torch.equal(_bits(back), _bits(params[0]))
    pinned = [p.detach().pin_memory() for p in params]  # the loader before: tensor by tensor
    grew, own = _host_reserved() - torch_before, sum(p.numel() * p.element_size() for p in pinned)
    print(f"the block pinned per tensor: {grew:,} B for {own:,} B of tensors ({grew / own:.3f}x)")
    assert grew == sum(torch_pinned_bytes(p.numel() * p.element_size()) for p in pinned) == report.host_pow2_bytes
    del pinned


def _check_shared_registration() -> None:
    """A shared segment registered by two mappings (as two workers of a node map it), copied from both."""
    import os

    from xema_ray.platforms import get_platform
    from xema_ray.platforms.host_memory import SharedSegments

    nbytes = 8 * 2**20  # small: /dev/shm in a container may be 64 MB
    segs = SharedSegments()
    key = f"gpu-check-{os.getpid()}"
    first = segs.open(key, nbytes)
    first.view(0, (nbytes // 2,), torch.bfloat16).copy_(torch.arange(nbytes // 2, dtype=torch.float32))
    SharedSegments.publish(first)
    second = segs.open(key, nbytes)
    assert second.filled and first.register(get_platform("cuda")) and second.register(get_platform("cuda"))
    a, b = (x.view(0, (nbytes // 2,), torch.bfloat16).to("cuda", non_blocking=True) for x in (first, second))
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    first.close()
    second.close()
    assert not segs.path(key).exists()  # the last mapping out removed it


def _check(component: str, path: str) -> None:
    spec = get_model_spec("flux2" if component == "transformer" else "cogvideox-5b")
    cls, cfg = ((spec.transformer_class(), spec.transformer_config) if component == "transformer"
                else (spec.vae_class(), spec.vae_config))
    built = {}
    torch_before = _host_reserved()
    for where, home in (("cuda", WeightHome.DEVICE), ("cpu", WeightHome.DEVICE), ("cuda-host", WeightHome.HOST)):
        root = build_on_meta(cls, cfg, torch.bfloat16)
        sub = root.get_submodule(path)
        device = torch.device("cpu" if where == "cpu" else "cuda")
        # only this sub-tree: the seed depends on the module path, so name it as in the whole component
        source = SeededWeights(0, component)
        prefixed = _Prefixed(source, path)
        report = materialize(sub, device, torch.bfloat16, prefixed, lambda _p, h=home: h)
        built[where] = {n: _bits(t) for n, t in sub.state_dict().items()}
        if where == "cuda-host" and component == "transformer":
            _check_host_memory(sub, report, torch_before)
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

    def placed_values(self, path, module, dtype, device, pin=False, dest=None):  # type: ignore[no-untyped-def,override]
        full = f"{self.prefix}.{path}" if path else self.prefix
        return super().placed_values(full, module, dtype, device, pin, dest)
