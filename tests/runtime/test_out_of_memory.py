"""A real CPU worker on the host arena (``Worker(platform="cpu", static_allocator=True)``: each
batch's tensors mirrored into the C++ arena, the host "device" the budget less the weights):

* a batch that outgrows the arena fails alone with ``DeviceOutOfMemory`` naming the entry, the
  bytes asked and the bytes free, and the next batch on the same worker runs, armed;
* a worker in a process without ``PYTHONHASHSEED=0`` reserves no arena, so its batches run
  disarmed and say why (arming would fail "no arena reserved" on every batch).
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xema_ray import hash_seed
from xema_ray.allocator.artifact import save_artifact
from xema_ray.measure.layout_solve import solve_entry_layout
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.runtime.out_of_memory import DeviceOutOfMemory
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

#: issue #35: CUDA's out-of-memory semantics, modelled on the CPU (with the stream tests: ``-m streams``)
pytestmark = pytest.mark.streams

SMALL = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2)
LARGE = SMALL.with_(width=128, height=128)
#: room beside the small entry's weights and static region: its dynamic region and what its plan
#: misses on a CPU (~0.7 MB: CPU attention is not the analyzer's CUDA-like one) fit, the large
#: entry's 2.6 MB static region does not
ROOM = 1_200_000


def _batch(c: ExecutionConfig, rid: str = "r") -> Batch:
    return Batch(config=c, requests=(GenerationRequest(request_id=rid, prompt="a fox", seed=1),), steps=c.template.steps)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ExecutionConfig, ExecutionConfig, int]:
    """Both entries with their solved layouts, and a budget the small one fits and the large one does not."""
    folder = tmp_path_factory.mktemp("oom") / "t.layouts"
    configs = []
    arts = []
    for t in (SMALL, LARGE):
        art = solve_entry_layout(ExecutionConfig(template=t), gpu="any")
        save_artifact(art, folder)
        configs.append(ExecutionConfig(template=t, layout_ref=art.layout_id))
        arts.append(art)
    budget = arts[0].loaded_bytes + arts[0].reserved_bytes + ROOM
    assert arts[1].loaded_bytes + arts[1].reserved_bytes > budget
    return folder, configs[0], configs[1], budget


def test_error_raised_if_a_batch_outgrows_the_host_arena_and_the_next_batch_runs(
        monkeypatch: pytest.MonkeyPatch, layouts: tuple[Path, ExecutionConfig, ExecutionConfig, int]) -> None:
    folder, small, large, budget = layouts
    monkeypatch.setattr(hash_seed, "seeded", lambda: True)  # the arena is reserved whatever the test process's seed
    w = Worker(platform="cpu", static_allocator=True)
    w.init_device(ParallelConfig(rank=0, world_size=1))
    loaded = w.load_model(ModelLoadConfig(model="tiny-flux2", plans=(small, large), layouts_dir=folder,
                                          budget_bytes=budget))
    alloc, dev = w.allocator, w.alloc_device
    assert loaded.layout_status is not None and loaded.layout_status.startswith("1 of 2 layout(s) armed per batch")
    first = w.execute(_batch(small))
    assert first.layout_armed and first.layout_hits > 0 and first.outputs[0].media_type == "image/png"

    with pytest.raises(torch.cuda.OutOfMemoryError) as e:  # what users' code catches, on the host arena too
        w.execute(_batch(large))
    oom = e.value
    assert isinstance(oom, DeviceOutOfMemory) and isinstance(oom, MemoryError)
    record = alloc.out_of_memory(device=dev)
    assert record.events == 1 and oom.record == record  # the arena's record travels with the error
    assert pickle.loads(pickle.dumps(oom)).record == record  # across Ray's process boundary too
    assert oom.entry == f"{LARGE.key} (layout {large.layout_ref})" and oom.device == "cpu"
    assert oom.requested_bytes == record.requested_bytes > oom.free_bytes == record.free_bytes
    assert str(oom).startswith(f"{oom.entry}: out of device memory on cpu: asked {oom.requested_bytes} bytes; "
                               f"{oom.free_bytes} free")
    assert record.limit_bytes == budget - loaded.device_bytes  # the device less the weights
    assert oom.__context__ is None and oom.__traceback__ is not None
    # nothing of the failed batch is left: no static block, nothing armed, only what outlives batches
    after = alloc.stats(device=dev)
    assert after.static_active_bytes == 0 and not after.armed
    assert after.active_bytes <= first.layout_reserved_bytes

    again = w.execute(_batch(small, "r2"))  # the same worker, the next batch: armed, same image
    assert again.layout_armed and again.layout_note is None and again.layout_hits == first.layout_hits
    assert again.outputs[0].data == first.outputs[0].data
    assert alloc.out_of_memory(device=dev).events == 1
    w.shutdown()
    gc.collect()


def test_an_armed_batch_leaves_no_static_block_so_the_next_one_arms_too(
        monkeypatch: pytest.MonkeyPatch, layouts: tuple[Path, ExecutionConfig, ExecutionConfig, int]) -> None:
    # the prompt embeddings the engine keeps (last_prompts) and the scheduler's timesteps and
    # sigmas are allocated under the plan; kept past the batch they held a static block, and the
    # next batch of the same template ran disarmed ("static blocks are still live")
    folder, small, _, _ = layouts
    monkeypatch.setattr(hash_seed, "seeded", lambda: True)
    w = Worker(platform="cpu", static_allocator=True)
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model="tiny-flux2", plans=(small,), layouts_dir=folder))
    results = []
    for i in range(3):
        results.append(w.execute(_batch(small, f"r{i}")))
        assert w.allocator.stats(device=w.alloc_device).static_active_bytes == 0
    assert all(r.layout_armed and r.layout_note is None for r in results), [r.layout_note for r in results]
    assert len({r.layout_hits for r in results}) == 1 and results[0].layout_hits > 0
    assert len({r.outputs[0].data for r in results}) == 1
    w.shutdown()


def test_caching_allocator_oom_becomes_device_out_of_memory() -> None:
    from xema_ray.runtime.out_of_memory import device_out_of_memory

    class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name and message, without a GPU
        pass

    msg = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 47.54 GiB of which "
           "1.50 GiB is free. Of the allocated memory 40.00 GiB is allocated by PyTorch")
    failure = device_out_of_memory(OutOfMemoryError(msg), "cogvideox-5b/720x480x49/s50/b1", "cuda:0", None)
    assert failure is not None and failure.requested_bytes == 2 * 2**30 and failure.free_bytes == int(1.5 * 2**30)
    assert device_out_of_memory(RuntimeError("shape mismatch"), "e", "cuda:0", None) is None


_UNSEEDED_CHILD = r"""
import json, sys
from pathlib import Path
from xema_ray.hash_seed import seeded
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.runtime.worker import ModelLoadConfig, Worker

assert not seeded()
small = ExecutionConfig.model_validate_json(sys.argv[2])
w = Worker(platform="cpu", static_allocator=True)
w.init_device(ParallelConfig(rank=0, world_size=1))
loaded = w.load_model(ModelLoadConfig(model="tiny-flux2", plans=(small,), layouts_dir=Path(sys.argv[1])))
out = w.execute(Batch(config=small, requests=(GenerationRequest(request_id="r", prompt="a fox", seed=1),), steps=small.template.steps))
print(json.dumps({"status": loaded.layout_status, "note": out.layout_note, "armed": out.layout_armed,
                  "media": out.outputs[0].media_type, "arena": w.arena is not None,
                  "requests_armed": w.allocator.stats(device=w.alloc_device).requests_armed}))
"""


def test_an_unseeded_worker_with_layouts_serves_its_batches_disarmed(
        layouts: tuple[Path, ExecutionConfig, ExecutionConfig, int]) -> None:
    folder, small, _, _ = layouts
    env = {k: v for k, v in os.environ.items() if k != hash_seed.HASH_SEED_ENV}
    run = subprocess.run([sys.executable, "-c", _UNSEEDED_CHILD, str(folder), small.model_dump_json()],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["media"] == "image/png" and not got["armed"] and not got["arena"] and got["requests_armed"] == 0
    assert "not armed" in got["status"] and "PYTHONHASHSEED" in got["status"]
    assert got["note"] == f"{small.layout_ref} not armed for this batch: {got['status']}"
