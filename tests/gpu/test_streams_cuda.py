"""The static allocator's stream-ordered frees under torch's own error checks, on the GPU (run by
`make gpu-check`; the CPU halves: ``pytest -m cuda_stub`` and ``pytest -m streams``).

In one child process with libxema_alloc installed as torch's allocator:

* a block freed while another stream still uses it is polled (``cudaEventQuery`` answers
  ``cudaErrorNotReady``), and the next kernel launches: torch's launch check
  (``cudaGetLastError``) finds no error left behind ("CUDA error: device not ready" before);
* block offload of six linear blocks whose compute keeps the stream busy (``torch.cuda._sleep``,
  so no released block's event has passed when the next copy is issued): after the first step the
  onloads take nothing from the driver (no ``cudaMalloc``, no device-synchronising ``cudaFree``),
  the released weights coming back stream-ordered, and every step gives the same output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu(expected_s=15, timeout_s=90, part=1, needs=("allocator",),
                              what="stream-ordered frees under torch's launch checks; block offload steady state"),
              pytest.mark.streams,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by `make gpu-check`)")]

REPO = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json
from xema_ray.allocator.cuda import install_cuda_allocator
alloc = install_cuda_allocator()  # before anything initialises CUDA
import torch
from torch import nn
from xema_ray.mitigation.block_offload import BlockOffloadConfig, apply_block_offload
from xema_ray.placement import COMPUTE_DEVICE_ATTR

WIDTH, BLOCKS = 256, 6
BLOCK_BYTES = WIDTH * WIDTH * 4 + WIDTH * 4
alloc.reserve(0, 4 * BLOCK_BYTES + (64 << 20))  # two blocks in flight, one released, cuBLAS workspaces
alloc.warm_up()
report = {}

# a deferred free polled not ready, then a kernel launch
side = torch.cuda.Stream()
x = torch.ones(1 << 20, device="cuda")
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    torch.cuda._sleep(200_000_000)  # the side stream is busy for a while (GPU clock cycles)
    y = x * 2
alloc.mark_used(x.untyped_storage().data_ptr(), side.cuda_stream)
del x
report["polled"] = alloc.poll()
report["pending_blocks"] = alloc.stats().pending_blocks
z = torch.ones(1024, device="cuda") + 1  # torch checks this launch with cudaGetLastError
report["after_not_ready"] = float(z.sum().item())
torch.cuda.synchronize()
report["y"] = float(y[:4].sum().item())
del y, z


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))

    def forward(self, x):
        for b in self.blocks:
            if x.is_cuda:
                torch.cuda._sleep(2_000_000)  # a block that computes for a while: its reads outlast the host
            x = torch.tanh(b(x))
        return x


model = Stack()  # on the host; computes on the GPU (the loader's record of a host-homed model)
inp = torch.randn(8, WIDTH)
with torch.no_grad():
    expected = model(inp)
setattr(model, COMPUTE_DEVICE_ATTR, torch.device("cuda", 0))
handle = apply_block_offload(model, list(model.blocks.named_children()),
                             BlockOffloadConfig(blocks=tuple(range(BLOCKS))))
dev_in = inp.cuda()
with torch.no_grad():
    outs = [model(dev_in)]
    warm = alloc.stats()
    outs += [model(dev_in) for _ in range(4)]
    steady = alloc.stats()
torch.cuda.synchronize()
report.update(warm_driver_allocs=warm.driver_allocs, steady_driver_allocs=steady.driver_allocs,
              deferred=[warm.deferred_frees, steady.deferred_frees],
              same=all(torch.equal(o, outs[0]) for o in outs),
              close=bool(torch.allclose(outs[0].cpu(), expected, atol=1e-3)))
handle.remove()
print("REPORT " + json.dumps(report), flush=True)
"""


def test_stream_ordered_frees_leave_no_cuda_error_and_block_offload_reuses_its_memory() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("REPORT ")).removeprefix("REPORT "))
    out = Path(os.environ.get("XEMA_GPU_OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "streams_cuda.json").write_text(json.dumps(report, indent=1))
    assert report["polled"] == 0 and report["pending_blocks"] == 1, report  # the query answered not ready
    assert report["after_not_ready"] == 2048.0 and report["y"] == 8.0, report
    assert report["steady_driver_allocs"] == report["warm_driver_allocs"], report
    assert report["deferred"][1] > report["deferred"][0], report
    assert report["same"] and report["close"], report


def test_a_failed_host_register_leaves_no_cuda_error_for_the_next_kernel() -> None:
    """``cudaHostRegister`` refused (a range already registered) is an error the platform handles
    (``RuntimeError`` naming it); the runtime's last error it set is cleared, so torch's next
    kernel-launch check does not report it as the kernel's failure."""
    from xema_ray.platforms.cuda import CudaPlatform, _loaded_cudart

    platform = CudaPlatform()
    host = torch.empty(1 << 20, dtype=torch.uint8)
    assert platform.register_host(host.data_ptr(), host.numel())
    try:
        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            platform.register_host(host.data_ptr(), host.numel())  # already registered
        lib = _loaded_cudart()
        assert lib is not None, "torch's libcudart was not found among the process's mappings"
        assert lib.cudaPeekAtLastError() == 0
        x = torch.ones(1024, device="cuda")
        torch.cuda.synchronize()
        assert float((x * 2).sum()) == 2048.0
    finally:
        platform.unregister_host(host.data_ptr())
