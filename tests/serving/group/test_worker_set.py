"""The worker-set seam's own contract, on in-process workers of a kind that loads no model:
results in rank order, a killed worker failing its waiting calls at once, one rebuild per
failure however many callers saw it, a failed rebuild leaving the set at its generation."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from xema_ray.parallel.groups import ParallelConfig
from xema_ray.runtime.worker import ModelLoadConfig
from xema_ray.runtime.worker_base import WorkerBase
from xema_ray.serving.group.worker_set import (
    WORKER_KINDS,
    RebuildFailed,
    WorkerDied,
    WorkerKind,
    WorkerSetSpec,
    worker_set_for,
)
from xema_ray.serving.group.worker_set_local import InProcessWorkerSet


class _EchoWorker(WorkerBase):
    """The worker interface without a model: ``load_model`` counts, ``echo`` answers, ``block`` waits."""

    loads = 0
    fail_loads = threading.Event()
    release = threading.Event()

    def __init__(self, platform: str, static_allocator: bool = False) -> None:
        super().__init__()
        self.platform = platform
        self.rank: int | None = None

    def device_topology(self, local_index: int = 0) -> tuple[str, list[str]]:
        return f"echo:{id(self)}", []

    def init_device(self, parallel: ParallelConfig, local_index: int = 0) -> None:
        self.rank = parallel.rank

    def load_model(self, load: ModelLoadConfig) -> Any:
        if type(self).fail_loads.is_set():
            raise RuntimeError("no memory for the weights")
        type(self).loads += 1
        return f"loaded {load.model}"

    def _loaded(self) -> bool:
        return True

    def _run_batch(self, batch: Any, observer: Any, control: Any) -> Any:
        raise NotImplementedError("an echo worker runs no batch")

    def layout_reserved_bytes(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass

    def echo(self, x: Any) -> tuple[int, Any]:
        return id(self), x

    def block(self) -> str:
        type(self).release.wait(30)
        return "released"


@pytest.fixture()
def echo_kind() -> Iterator[str]:
    WORKER_KINDS["echo"] = WorkerKind(_EchoWorker, platform="cpu", backend="inprocess")
    _EchoWorker.fail_loads.clear()
    _EchoWorker.release.clear()
    try:
        yield "echo"
    finally:
        del WORKER_KINDS["echo"]
        _EchoWorker.release.set()


def _set(kind: str, size: int = 3) -> InProcessWorkerSet:
    ws = worker_set_for(WorkerSetSpec(device=kind, size=size, load=ModelLoadConfig(model="tiny-flux2")))
    assert isinstance(ws, InProcessWorkerSet)  # the kind's backend chose it
    return ws


def test_collective_rpc_answers_in_rank_order(echo_kind: str) -> None:
    ws = _set(echo_kind)
    assert ws.start() == "loaded tiny-flux2" and ws.health().state == "ok" and ws.generation == 1

    async def run() -> None:
        every = await ws.collective_rpc("echo", args=("hi",))
        ids = [i for i, _ in every]
        assert len(set(ids)) == 3 and [x for _, x in every] == ["hi"] * 3
        assert [i for i, _ in await ws.collective_rpc("echo", [2, 0], kwargs={"x": 1})] == [ids[2], ids[0]]
        with pytest.raises(ValueError, match=r"ranks must be in \[0, 3\), got \[3\]"):
            await ws.collective_rpc("echo", [3], ("x",))

    asyncio.run(run())
    ws.shutdown()


def test_a_killed_worker_fails_its_waiting_call_at_once_and_every_later_one(echo_kind: str) -> None:
    ws = _set(echo_kind, size=2)
    ws.start()

    async def run() -> None:
        waiting = asyncio.ensure_future(ws.collective_rpc("block", [1]))
        await asyncio.sleep(0.05)
        ws.kill(1)
        with pytest.raises(WorkerDied) as died:
            await asyncio.wait_for(waiting, 5)  # not when the blocked call would have returned
        assert died.value.rank == 1
        assert ws.health().state == "failed" and "worker 1 died" in (ws.health().reason or "")
        with pytest.raises(WorkerDied):
            await ws.collective_rpc("echo", [1], ("x",))
        assert await ws.probe() == ["ok", "dead"]
        assert len(await ws.collective_rpc("echo", [0], ("x",))) == 1  # the live rank still answers

    asyncio.run(run())
    ws.shutdown()


def test_one_rebuild_per_failure_however_many_callers_saw_it(echo_kind: str) -> None:
    ws = _set(echo_kind, size=2)
    ws.start()
    loads = _EchoWorker.loads

    async def run() -> None:
        old = await ws.collective_rpc("echo", args=("x",))
        ws.kill(0)
        rebuilt = await asyncio.gather(ws.rebuild(1), ws.rebuild(1))
        assert sorted(rebuilt) == [False, True] and ws.generation == 2 and ws.health().state == "ok"
        assert _EchoWorker.loads == loads + 2  # one new set of two workers
        new = await ws.collective_rpc("echo", args=("x",))
        assert {i for i, _ in new}.isdisjoint({i for i, _ in old})
        assert not await ws.rebuild(1)  # a stale failure rebuilds nothing

    asyncio.run(run())
    ws.shutdown()


def test_a_failed_rebuild_keeps_the_generation_and_the_next_one_may_succeed(echo_kind: str) -> None:
    ws = _set(echo_kind, size=1)
    seen: list[Any] = []
    ws.on_loaded = seen.append
    ws.start()

    async def run() -> None:
        _EchoWorker.fail_loads.set()
        with pytest.raises(RebuildFailed, match="no memory for the weights"):
            await ws.rebuild(1)
        h = ws.health()
        assert (h.state, h.generation, h.reason) == ("failed", 1, "rebuild failed: RuntimeError")
        _EchoWorker.fail_loads.clear()
        assert await ws.rebuild(1) and ws.generation == 2 and ws.health().state == "ok"

    asyncio.run(run())
    assert seen == ["loaded tiny-flux2"] * 2  # the group hears of each set it gets
    ws.shutdown()


def test_a_pause_is_sent_without_waiting_for_the_busy_worker(echo_kind: str) -> None:
    spec = WorkerSetSpec(device=echo_kind, size=1, load=ModelLoadConfig(model="tiny-flux2"), concurrency=2)
    ws = InProcessWorkerSet(spec)
    ws.start()
    paused = threading.Event()
    worker = ws._live().workers[0].worker
    worker.pause = lambda run_id, offload: paused.set()  # what Worker.pause does is test_preemption's

    async def run() -> None:
        busy = asyncio.ensure_future(ws.collective_rpc("block", [0]))
        await asyncio.sleep(0.05)
        ws.pause([0], "run-1", offload=False)
        assert await asyncio.to_thread(paused.wait, 5)  # reached the worker while it is busy
        _EchoWorker.release.set()
        assert await busy == ["released"]

    asyncio.run(run())
    ws.shutdown()


def test_every_kind_names_a_worker_class_and_naming_one_imports_no_torch() -> None:
    from xema_ray.runtime.emulated import EmulatedWorker
    from xema_ray.runtime.worker import Worker

    assert {d: k.load_class() for d, k in WORKER_KINDS.items()} == {"cpu": Worker, "cuda": Worker,
                                                                     "emulated": EmulatedWorker}
    with pytest.raises(TypeError, match="WorkerBase"):
        WorkerKind(InProcessWorkerSet, platform="cpu").load_class()  # type: ignore[arg-type]
    code = ("import sys\nfrom xema_ray.serving.group.worker_set import WORKER_KINDS\n"
            "print(sorted(m for m in ('torch', 'xema_ray.runtime.worker') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
