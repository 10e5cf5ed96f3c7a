"""GPU check of the warm load (docs/serving.md, "Warm replicas"): a worker that finds the node's
host copy maps it and copies every device weight from page-locked memory. Measured here: that
copy's bandwidth (``LoadedModel.device_copy_s`` over ``host_copy_bytes``, the figure a warm
replica's weight phase is bytes / bandwidth of), against the same bytes copied from pageable
memory. The CPU half (the same load path, the mapping, the bytes) is tests/models/test_host_pack.py;
the CPU figures are bench/bench_warm_start.py's."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from xema_ray.models.loading import HostShare, SeededWeights, materialize
from xema_ray.platforms.host_memory import SharedSegments

pytestmark = pytest.mark.gpu  # planned in gpu_check/gpu_plan.py: part 2, 7 s, needs the shm step

#: eight 8192 x 8192 bf16 layers: 1 GiB of weights, in tensors large enough for full-bandwidth copies
LAYERS, WIDTH = 8, 8192


def _model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def test_a_warm_load_copies_the_host_copy_to_the_device_at_pinned_bandwidth(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shm = os.environ.get("XEMA_SHM_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path))
    monkeypatch.setenv("XEMA_SHM_DIR", shm)
    device = torch.device("cuda")
    source = SeededWeights(0, "warm")
    cold = _model()
    filled = materialize(cold, device, torch.bfloat16, source, share=HostShare("warm-load-gpu"), host_copy=True)
    warm = _model()
    mapped = materialize(warm, device, torch.bfloat16, source, share=HostShare("warm-load-gpu"), host_copy=True)
    nbytes = LAYERS * WIDTH * WIDTH * 2
    assert filled.host_copy_bytes == mapped.host_copy_bytes == nbytes and filled.host_attached_bytes == 0
    assert mapped.host_attached_bytes == mapped.host_shared_bytes >= nbytes  # mapped: nothing read
    assert all(torch.equal(a, b) for a, b in zip(cold.parameters(), warm.parameters(), strict=True))
    pinned_gbps = nbytes / mapped.device_copy_s / 1e9
    # the same bytes from pageable memory, tensor by tensor, as an unpinned loader copies them
    pageable = [torch.empty(WIDTH, WIDTH, dtype=torch.bfloat16) for _ in range(LAYERS)]
    for t in pageable:
        t.fill_(1.0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    moved = [t.to(device) for t in pageable]
    torch.cuda.synchronize()
    pageable_gbps = nbytes / (time.perf_counter() - start) / 1e9
    print(f"warm load: {nbytes / 2**30:.2f} GiB host copy -> device in {mapped.device_copy_s:.3f} s = "
          f"{pinned_gbps:.1f} GB/s pinned; pageable copy of the same bytes {pageable_gbps:.1f} GB/s; "
          f"the cold load read them in {filled.source_s:.2f} s")
    del moved, cold, warm
    SharedSegments().sweep()
    assert pinned_gbps >= 5.0, f"a warm load's copy ran at {pinned_gbps:.1f} GB/s: not from page-locked memory"
