"""Several model groups in one replica process (``SharedReplica``, ``shared_replicas:``): each member
is still its own ModelGroup (its own queue, workers and job owner), reached through a
``GroupHandle`` that names it; the shared replica's health fails when any member's does; a new plan
table reaches the members it names. Without Ray: the handles are in-process stand-ins."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Iterator

import pytest
from PIL import Image

from bench.scenarios.group_harness import entry, group_config, request
from tests.serving.api.router_harness import LocalHandle
from xema_ray.serving.group.handle import GroupHandle
from xema_ray.serving.group.model_group import GroupSettings, ModelGroup
from xema_ray.serving.group.plan_reload import GroupPlans, SharedPlans
from xema_ray.serving.group.shared_replica import SharedMember, SharedReplica
from xema_ray.serving.group.worker_set_local import InProcessWorkerSet
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
QWEN = RequestTemplate(model="tiny-qwen-image", width=64, height=64, steps=2)


def _member(t: RequestTemplate) -> SharedMember:
    plans = {t.shape_key: entry(t)}
    return SharedMember(config=group_config(t.model, plans), plans=plans, settings=GroupSettings(worker_set="inprocess"))


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[SharedReplica, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="shared-replica", daemon=True)
    thread.start()
    built: list[str] = []

    def make(m: SharedMember) -> ModelGroup:
        built.append(m.config.model)
        return ModelGroup(m.config, m.plans, m.settings, worker_set=InProcessWorkerSet)

    replica = SharedReplica([_member(FLUX), _member(QWEN)], make_group=make)
    assert built == ["tiny-flux2", "tiny-qwen-image"]  # one at a time, in the order given
    try:
        yield replica, loop
    finally:
        async def stop() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        for g in replica.groups.values():
            g.workers.shutdown()
        loop.call_soon_threadsafe(loop.stop)


def _on(loop: asyncio.AbstractEventLoop, coro: object) -> object:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(120)  # type: ignore[arg-type]


def test_each_member_serves_its_own_model_through_a_handle_naming_it(shared: tuple[SharedReplica, asyncio.AbstractEventLoop]) -> None:
    replica, loop = shared
    handle = LocalHandle(replica)
    flux = GroupHandle(handle, member="tiny-flux2", deployment="SharedReplica:0")
    qwen = GroupHandle(handle, member="tiny-qwen-image", deployment="SharedReplica:0")

    async def both() -> list[object]:
        return list(await asyncio.gather(flux.generate(request(FLUX.shape_key, "f1", "a fox", 1, steps=2)),
                                         qwen.generate(request(QWEN.shape_key, "q1", "a fox", 1, steps=2))))

    a, b = _on(loop, both())  # type: ignore[misc]
    assert a.request_id == "f1" and a.replica.startswith("tiny-flux2-")
    assert b.request_id == "q1" and b.replica.startswith("tiny-qwen-image-")
    assert Image.open(io.BytesIO(a.data)).size == Image.open(io.BytesIO(b.data)).size == (64, 64)
    statuses = [_on(loop, h.status()) for h in (flux, qwen)]
    assert [s["model"] for s in statuses] == ["tiny-flux2", "tiny-qwen-image"]  # type: ignore[index]
    assert all(s["status"] == "ok" for s in statuses)  # type: ignore[index]
    assert statuses[0]["owner"] != statuses[1]["owner"]  # type: ignore[index]  # each its own job owner
    # each member its own dispatcher: the flux group never saw the qwen template
    assert set(replica.groups["tiny-flux2"].dispatcher.plans) == {FLUX.shape_key}
    assert _on(loop, flux.estimate(FLUX.shape_key)) == pytest.approx(replica.groups["tiny-flux2"].estimates[FLUX.shape_key].total_s)


def test_a_model_the_shared_replica_does_not_hold_is_refused_by_name(shared: tuple[SharedReplica, asyncio.AbstractEventLoop]) -> None:
    replica, loop = shared
    with pytest.raises(KeyError, match="holds tiny-flux2, tiny-qwen-image, not 'tiny-ltx2'"):
        _on(loop, replica.status("tiny-ltx2"))
    with pytest.raises(ValueError, match="name \\['tiny-ltx2'\\]"):
        _on(loop, replica.reconfigure(SharedPlans(groups={"tiny-ltx2": GroupPlans(plans={})}).model_dump(mode="json")))


def test_a_new_plan_table_reaches_the_members_it_names(shared: tuple[SharedReplica, asyncio.AbstractEventLoop]) -> None:
    replica, loop = shared
    before = {m: g.plans_hash for m, g in replica.groups.items()}
    new = GroupPlans(plans={FLUX.shape_key: entry(FLUX, batch=2)})
    _on(loop, replica.reconfigure(SharedPlans(groups={"tiny-flux2": new}).model_dump(mode="json")))

    async def swapped() -> None:
        while replica.groups["tiny-flux2"].plans_hash != new.hash:
            await asyncio.sleep(0.05)

    _on(loop, swapped())
    assert replica.groups["tiny-flux2"].dispatcher.plans[FLUX.shape_key].batch == 2
    assert replica.groups["tiny-qwen-image"].plans_hash == before["tiny-qwen-image"]  # not named: untouched


def test_the_shared_replica_fails_its_health_check_when_one_member_can_no_longer_serve(
        shared: tuple[SharedReplica, asyncio.AbstractEventLoop]) -> None:
    replica, loop = shared
    replica.check_health()
    qwen = replica.groups["tiny-qwen-image"]

    async def ended() -> None:
        raise RuntimeError("planted")

    real = qwen._loop_task
    qwen._loop_task = asyncio.run_coroutine_threadsafe(_task(ended()), loop).result(10)
    try:
        with pytest.raises(RuntimeError, match="tiny-qwen-image: the dispatch loop ended"):
            replica.check_health()
    finally:
        qwen._loop_task = real


async def _task(coro: object) -> asyncio.Task[None]:
    t = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return t


def test_a_shared_replica_holds_each_model_once() -> None:
    with pytest.raises(ValueError, match="at least one group"):
        SharedReplica([])
    with pytest.raises(ValueError, match="each model once"):
        SharedReplica([_member(FLUX), _member(FLUX)], make_group=lambda m: None)  # type: ignore[arg-type,return-value]
