"""CUDA's stream semantics on the CPU (``xema_ray.platforms.async_host``): the serving worker, its
mitigations and the static allocator run unchanged on an emulated asynchronous device whose side
streams are queues run at the latest legal point and whose device memory is the host arena, handed
out again at once. Every mitigation that moves data across streams, armed with a layout and not,
a residency switch and a pause/resume of an offloaded state give the unmitigated run's bytes with
no hazard; on main's code each of these raised a ``StreamHazard`` (BENCHMARKS.md, "Stream
semantics on the CPU")."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xema_ray.allocator.artifact import save_artifact
from xema_ray.allocator.emulated import recorded_layout
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig, ExpertSwap, Mitigation
from xema_ray.platforms.async_host import OnHazard, make_async_host_platform
from xema_ray.runtime import Batch, GenerationRequest
from xema_ray.runtime.pause import PausedRun
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.streams

COG = RequestTemplate(model="tiny-cogvideox", height=48, width=64, frames=9, steps=3)
FLUX = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=3)
FLUX_B = RequestTemplate(model="tiny-flux2", height=32, width=32, steps=2)

ACT_VAE = Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=64)
ACT_DIT = Mitigation(kind="activation_offload", modules=("transformer",), intensity=4)


def _batch(config: ExecutionConfig, seed: int = 1) -> Batch:
    return Batch(config=config, requests=(GenerationRequest(request_id=f"r{seed}", prompt=f"a lighthouse {seed}", seed=seed),), steps=config.template.steps)


def _plain(t: RequestTemplate, seed: int = 1) -> bytes:
    """The unmitigated run's bytes on the plain (synchronous) CPU."""
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model=t.model))
    return w.execute(_batch(ExecutionConfig(template=t), seed)).outputs[0].data  # type: ignore[union-attr]


class Emulated:
    """A worker on the emulated asynchronous device, with the host arena as its memory."""

    def __init__(self, plans: tuple[ExecutionConfig, ...], layouts_dir: Path | None = None,
                 on_hazard: OnHazard = "raise") -> None:
        self.platform = make_async_host_platform(on_hazard=on_hazard)
        self.worker = Worker(platform=self.platform, static_allocator=True)
        self.worker.init_device(ParallelConfig(rank=0, world_size=1))
        self.worker.load_model(ModelLoadConfig(model=plans[0].template.model, plans=plans, layouts_dir=layouts_dir))

    @property
    def hazards(self) -> list[str]:
        return self.platform.device_emulation.hazards

    def stats(self) -> Any:
        return self.worker.allocator.stats(device=self.worker.alloc_device)

    def close(self) -> None:
        self.worker.shutdown()
        self.platform.uninstall()
        gc.collect()
        alloc, d = self.worker.allocator, self.worker.alloc_device
        alloc.poll(device=d)
        if alloc.stats(device=d).live_blocks == 0 and alloc.stats(device=d).pending_blocks == 0:
            alloc.release(device=d)


@pytest.fixture
def emulated() -> Iterator[list[Emulated]]:
    made: list[Emulated] = []
    yield made
    for e in made:
        e.close()


def _with_layout(config: ExecutionConfig, tmp_path: Path) -> ExecutionConfig:
    """``config`` with its layout solved from the emulated device's own recorded compute stream (as
    the GPU check records a GPU's), so the armed batch follows its plan to the end and the static
    region's offsets are really reused while side-stream copies are in flight."""
    e = Emulated((config,), on_hazard="record")  # the stream is what it records; the armed run checks
    try:
        art = recorded_layout(e.worker.allocator, e.worker.alloc_device, lambda: e.worker.execute(_batch(config)), config)
    finally:
        e.close()
    save_artifact(art, tmp_path)
    return config.model_copy(update={"layout_ref": art.layout_id})


def test_activation_offload_armed_with_a_layout(emulated: list[Emulated], tmp_path: Path) -> None:
    config = _with_layout(ExecutionConfig(template=COG, mitigations=(ACT_DIT, ACT_VAE)), tmp_path)
    e = Emulated((config,), tmp_path)
    emulated.append(e)
    result = e.worker.execute(_batch(config))
    assert result.layout_armed and result.layout_hits > 0 and result.layout_misses == 0
    assert e.hazards == []
    assert result.outputs[0].data == _plain(COG)
    s = e.stats()
    # the copies' sources were held until the side stream had read them, and that memory counted
    assert s.deferred_frees > 0 and s.peak_pending_free_bytes > 0


def test_activation_offload_unarmed(emulated: list[Emulated]) -> None:
    config = ExecutionConfig(template=COG, mitigations=(ACT_DIT, ACT_VAE))
    e = Emulated((config,))
    emulated.append(e)
    result = e.worker.execute(_batch(config))
    assert not result.layout_armed and e.hazards == []
    assert result.outputs[0].data == _plain(COG)


def test_block_offload_armed(emulated: list[Emulated], tmp_path: Path) -> None:
    config = _with_layout(ExecutionConfig(template=FLUX, mitigations=(
        Mitigation(kind="block_offload", blocks=(0, 1), intensity=2),)), tmp_path)
    e = Emulated((config,), tmp_path)
    emulated.append(e)
    result = e.worker.execute(_batch(config))
    assert result.layout_armed and result.layout_misses == 0 and e.hazards == []
    assert result.outputs[0].data == _plain(FLUX)
    # the onloaded weights the compute stream read were kept until it had passed them
    assert e.stats().deferred_frees > 0


def test_residency_switch(emulated: list[Emulated]) -> None:
    """Two templates whose plans keep different blocks on the host: each batch switches the
    residency (blocks move host <-> device on the emulated device) and streams its own."""
    a = ExecutionConfig(template=FLUX, mitigations=(Mitigation(kind="block_offload", blocks=(0, 1), intensity=2),))
    b = ExecutionConfig(template=FLUX_B, mitigations=(Mitigation(kind="block_offload", blocks=(2,), intensity=1),))
    e = Emulated((a, b))
    emulated.append(e)
    first = e.worker.execute(_batch(a))
    other = e.worker.execute(_batch(b))
    again = e.worker.execute(_batch(a))
    assert other.residency_bytes_moved > 0 and again.residency_bytes_moved > 0
    assert e.hazards == []
    assert first.outputs[0].data == again.outputs[0].data == _plain(FLUX)
    assert other.outputs[0].data == _plain(FLUX_B)


class _PauseAt:
    def __init__(self, worker: Worker, run_id: str, step: int) -> None:
        self.worker, self.run_id, self.step = worker, run_id, step

    def on_step(self, step: int, total: int) -> bool:
        if step == self.step:
            assert self.worker.pause(self.run_id, offload=True)
        return False

    def on_decoded(self) -> None:
        pass


def test_pause_resume_of_an_offloaded_state(emulated: list[Emulated]) -> None:
    """A batch with activation offload parks with its state moved to the host, another batch runs
    on the pipeline meanwhile, the first resumes: both give the unmitigated bytes."""
    config = ExecutionConfig(template=COG, mitigations=(ACT_DIT, ACT_VAE))
    short = ExecutionConfig(template=RequestTemplate(model="tiny-cogvideox", height=32, width=32, frames=5, steps=2),
                            mitigations=(ACT_DIT,))
    e = Emulated((config, short))
    emulated.append(e)
    paused = e.worker.execute(_batch(config), observer=_PauseAt(e.worker, "long", 1), run_id="long")
    assert isinstance(paused, PausedRun) and paused.offloaded
    between = e.worker.execute(_batch(short, seed=2))
    done = e.worker.resume("long")
    assert e.hazards == []
    assert done.outputs[0].data == _plain(COG)  # type: ignore[union-attr]
    assert between.outputs[0].data == _plain(short.template, seed=2)


WAN = RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=9, steps=4)
WAN_SWAP = ExecutionConfig(template=WAN, experts=ExpertSwap(strategy="swap_prefetched", prefetch_blocks=1, prefetch_steps=1,
                                                            decode_blocks=1))


def test_expert_swap(emulated: list[Emulated]) -> None:
    """Wan2.2's planned expert switch on the emulated device: the low-noise expert's first block
    prefetched on the side stream during the last high-noise step, the high-noise expert released
    at the switch while its last reads may still be queued, one block back under the decode and
    the rest after the batch. Two requests (the second starts on what the first sent back) give
    the plain run's bytes, with no hazard."""
    e = Emulated((WAN_SWAP,))
    emulated.append(e)
    swapper = e.worker.engine.experts  # type: ignore[union-attr]
    first = e.worker.execute(_batch(WAN_SWAP))
    second = e.worker.execute(_batch(WAN_SWAP))
    assert e.hazards == []
    assert first.outputs[0].data == second.outputs[0].data == _plain(WAN)
    blocks = swapper.block_bytes
    assert swapper.switches == 4 and swapper.copied == {"transformer": 3 * blocks, "transformer_2": 2 * blocks}
    assert e.stats().deferred_frees > 0


def test_expert_swap_without_the_wait_is_a_race(emulated: list[Emulated], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same swap with the compute stream not ordered after the copies (a block run before its
    side-stream copy has landed) is caught by the emulated device."""
    from xema_ray.mitigation import expert_swap

    monkeypatch.setattr(expert_swap._WaitHook, "pre_forward", lambda self, module, *a, **k: (a, k))
    e = Emulated((WAN_SWAP,), on_hazard="record")
    emulated.append(e)
    e.worker.execute(_batch(WAN_SWAP))
    assert e.hazards
