"""Out of memory on the GPU under the static allocator (issue #35, run by `make gpu-check`).

torch wraps a pluggable allocator's pointer unchecked, so a NULL from ``xema_malloc`` would reach
the first kernel as an illegal address and lose the CUDA context. The allocator torch is given,
``xema_torch_malloc``, throws instead; this checks, in one child process with the allocator
installed by the serving worker's constructor, that

* a request larger than the GPU (1 TiB) raises a ``RuntimeError`` naming the sizes (inside
  ``xema_ray.allocator.oom.out_of_memory_errors``: an ``ArenaOutOfMemory``, a ``torch.cuda.OutOfMemoryError``
  carrying the record), and the next kernel runs (the context lives);
* two armed batches of one template both arm with the same hits (nothing of the first is left in
  the static region);
* an over-budget batch (the device capped with ``set_limit`` just above what the worker held at
  its peak, as a budget-sized GPU would be) fails as ``DeviceOutOfMemory`` (a
  ``torch.cuda.OutOfMemoryError`` with the record) naming the entry, the bytes asked and the bytes
  free, and the next batch on the same worker runs armed and gives the same image as the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xema_ray.hash_seed import seeded_env

# the figures the GPU check plans it with (gpu_check/gpu_plan.py reads them from the marker): a
# pytest process, a child that imports torch and diffusers, initialises CUDA, builds tiny-flux2 and
# runs four tiny batches; the meta-device solve of one layout before it
pytestmark = [pytest.mark.gpu(expected_s=25, timeout_s=150, part=2, needs=("allocator",),
                              what="out of memory raises instead of faulting (1 TiB; a capped device); the next batch arms"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by `make gpu-check`)")]

REPO = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys
from pathlib import Path
from xema_ray.runtime.worker import ModelLoadConfig, Worker
w = Worker(platform="cuda", static_allocator=True)  # installs libxema_alloc before CUDA initialises
import torch
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.engine import Batch, GenerationRequest

small, large = (ExecutionConfig.model_validate_json(a) for a in sys.argv[2:4])
w.init_device(ParallelConfig(rank=0, world_size=1))
w.load_model(ModelLoadConfig(model="tiny-flux2", plans=(small, large), layouts_dir=Path(sys.argv[1]),
                             budget_bytes=64 << 20))
alloc, dev = w.allocator, w.alloc_device
report = {}
try:
    torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
    report["huge"] = "no error"
except RuntimeError as e:
    report["huge"] = str(e)[:400]
try:
    from xema_ray.allocator.oom import out_of_memory_errors
    with out_of_memory_errors(alloc, dev):  # torch's RuntimeError as torch.cuda.OutOfMemoryError
        torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
    report["huge_class"] = "no error"
except torch.cuda.OutOfMemoryError as e:
    report["huge_class"] = [type(e).__name__, e.record.requested_bytes]
x = torch.ones(1 << 20, device="cuda")
report["after_huge"] = float(x.sum().item())
del x

def run(c, rid):
    return w.execute(Batch(config=c, requests=(GenerationRequest(request_id=rid, prompt="a fox", seed=1),), steps=c.template.steps))

alloc.reset_peaks(device=dev)
first = run(small, "a")
second = run(small, "a2")  # the next batch of the same template arms too (nothing of the first left static)
torch.cuda.synchronize()
s = alloc.stats(device=dev)
# a budget-sized device: what the worker holds now, plus the first batch's own driver blocks and 1 MiB
alloc.set_limit(s.peak_reserved_bytes + (1 << 20), device=dev)
try:
    run(large, "b")
    report["large"] = "no error"
except torch.cuda.OutOfMemoryError as e:  # DeviceOutOfMemory is one, carrying the arena's record
    report["large"] = {"message": str(e), "entry": e.entry, "requested": e.requested_bytes, "free": e.free_bytes,
                       "class": type(e).__name__, "record_requested": e.record.requested_bytes}
torch.cuda.synchronize()
again = run(small, "c")
torch.cuda.synchronize()
report.update(first_armed=first.layout_armed, second_armed=second.layout_armed, again_armed=again.layout_armed,
              hits=[first.layout_hits, second.layout_hits, again.layout_hits],
              same_image=first.outputs[0].data == again.outputs[0].data,
              oom_events=alloc.out_of_memory(device=dev).events,
              static_active_after=alloc.stats(device=dev).static_active_bytes)
print("REPORT " + json.dumps(report), flush=True)
"""


def test_an_over_budget_request_raises_instead_of_faulting_and_the_next_batch_runs(tmp_path: Path) -> None:
    from xema_ray.allocator.artifact import save_artifact
    from xema_ray.measure.layout_solve import solve_entry_layout
    from xema_ray.plan import ExecutionConfig
    from xema_ray.templates import RequestTemplate

    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2)
    art = solve_entry_layout(ExecutionConfig(template=t), gpu="any")  # the meta run: no CUDA in this process
    save_artifact(art, tmp_path / "t.layouts")
    small = ExecutionConfig(template=t, layout_ref=art.layout_id)
    large = ExecutionConfig(template=t.with_(width=512, height=512))  # ~64x the activations, no layout
    env = {**seeded_env(), "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "t.layouts"), small.model_dump_json(),
                           large.model_dump_json()], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("REPORT ")).removeprefix("REPORT "))
    assert report["huge"].startswith("xema_alloc: device 0 out of memory: asked 1099511627776 bytes"), report
    assert report["after_huge"] == float(1 << 20)  # the context lives
    assert report["huge_class"] == ["ArenaOutOfMemory", 1 << 40], report
    big = report["large"]
    assert isinstance(big, dict), report
    # free may exceed the request when it is in pieces (the message names the largest block)
    assert big["entry"] == large.template.key and big["requested"] > 0 and big["free"] >= 0
    assert "out of device memory on cuda" in big["message"]
    assert big["class"] == "DeviceOutOfMemory" and big["record_requested"] == big["requested"], big
    assert report["first_armed"] and report["second_armed"] and report["again_armed"] and report["same_image"], report
    assert report["hits"][0] > 0 and len(set(report["hits"])) == 1, report
    assert report["oom_events"] >= 2 and report["static_active_after"] == 0, report
