"""Run-time adapter changes on a group of several replicas (in-process replicas sharing one
``AdapterRegistry``, no Ray): a change taken by one replica is on every live replica when its
call returns, a replica started later has it before its first request is checked, a name taken
on one replica is a 409 on another, and a refused file changes nothing anywhere."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.scenarios.group_harness import Harness, LocalDeployment, entry, running_group
from xema_ray.lora import AdapterRejected, AdapterSource, LoraUse
from xema_ray.lora.synthetic import write_adapter
from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.serving.group.adapter_registry import AdapterRegistry, RegistryState
from xema_ray.serving.group.adapters import AdapterConflict
from xema_ray.serving.messages import GroupRequest, InvalidRequest
from xema_ray.templates import RequestTemplate

T = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder, hot = tmp_path_factory.mktemp("adapters"), tmp_path_factory.mktemp("hot")
    dit = get_model_spec("tiny-flux2").build_pipeline(BuildOptions(device="meta")).transformer  # shapes only
    write_adapter(folder / "A.safetensors", dit, rank=4, seed=1)
    c = write_adapter(hot / "c.safetensors", dit, rank=4, seed=3, layout="ai-toolkit-flux2")
    bad = hot / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    return {"folder": folder, "hot": hot, "C": c, "bad": bad}


@contextlib.contextmanager
def replica(files: dict[str, Path], registry: LocalDeployment) -> Iterator[Harness]:
    pool = LoraPoolConfig(dir=files["folder"], roots=(files["folder"], files["hot"]), slots=2, max_rank=8)
    with running_group("tiny-flux2", {T.shape_key: entry(T, batch=1)}, wait_window_s=0.05, max_queue=8,
                       adapters=pool, adapter_registry=registry) as h:
        yield h


@contextlib.contextmanager
def ticking(*replicas: Harness) -> Iterator[None]:
    """Serve's routing-stats tick of each replica, every 0.2 s (it acknowledges and syncs)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.2):
            for h in replicas:
                h.call(lambda g: g.record_routing_stats())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)


def _req(rid: str, *names: str) -> GroupRequest:
    return GroupRequest(template=T.shape_key, request_id=rid, prompt="a fox", seed=5, steps=T.steps,
                        lora=tuple(LoraUse(name=n) for n in names))


def _until(ok: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _names(h: Harness) -> set[str]:
    return set(h.group.adapters.names)


def test_a_change_taken_by_one_replica_is_served_by_every_replica_and_by_one_started_later(
        files: dict[str, Path]) -> None:
    registry = LocalDeployment(AdapterRegistry())
    try:
        with replica(files, registry) as r1, replica(files, registry) as r2, ticking(r1, r2):
            _until(lambda: _names(r1) == _names(r2) == {"A"} and {r for _, r in registry.target._acks}
                   >= {r1.group.owner, r2.group.owner})  # both loaded the folder and count as live

            info = r1.call(lambda g: g.add_adapter(AdapterSource(name="C", model="tiny-flux2", path=files["C"])))
            assert info.name == "C"
            assert _names(r2) == {"A", "C"}  # when the call returned, the other live replica had it

            # the same request on either replica: served with C, the same bytes
            a = r1.call(lambda g: g.generate(_req("on-1", "C")))
            b = r2.call(lambda g: g.generate(_req("on-2", "C")))
            assert a.data == b.data
            assert r2.call(lambda g: g.generate(_req("plain"))).data != a.data  # C is applied

            with pytest.raises(AdapterConflict):  # taken on r1: a 409 on r2 too
                r2.call(lambda g: g.add_adapter(AdapterSource(name="C", model="tiny-flux2", path=files["C"])))
            with pytest.raises(AdapterRejected):  # refused on r2: nothing changes anywhere
                r2.call(lambda g: g.add_adapter(AdapterSource(name="D", model="tiny-flux2", path=files["bad"])))
            assert "D" not in registry.target._states["tiny-flux2"].added and _names(r1) == _names(r2) == {"A", "C"}
            with pytest.raises(AdapterConflict):  # the YAML folder's A is served: its name is taken everywhere
                r2.call(lambda g: g.add_adapter(AdapterSource(name="A", model="tiny-flux2", path=files["C"])))

            with replica(files, registry) as r3:  # started later, never ticked: synced by its first request
                assert r3.call(lambda g: g.generate(_req("on-3", "C"))).data == a.data
                stop_r3 = ticking(r3)
                stop_r3.__enter__()  # from now on it ticks like the others (and is waited for)

                assert r2.call(lambda g: g.remove_adapter("A")) is True  # a folder adapter, deleted at run time
                assert _names(r1) == _names(r2) == {"C"}
                with pytest.raises(InvalidRequest, match="unknown adapter 'A'"):
                    r1.call(lambda g: g.generate(_req("gone", "A")))
                assert _names(r3) == {"C"}  # live: the delete waited for it
                stop_r3.__exit__(None, None, None)
    finally:
        registry.close()


def test_adapters_changed_at_run_time_survive_a_new_plan_table(files: dict[str, Path]) -> None:
    """A plan swap loads a new worker set: with the adapters served now, not the YAML folder's."""
    from xema_ray.serving.group.plan_reload import GroupPlans

    pool = LoraPoolConfig(dir=files["folder"], roots=(files["folder"], files["hot"]), slots=2, max_rank=8)
    with running_group("tiny-flux2", {T.shape_key: entry(T, batch=1)}, wait_window_s=0.05, adapters=pool) as h:
        _until(lambda: _names(h) == {"A"})
        h.call(lambda g: g.add_adapter(AdapterSource(name="C", model="tiny-flux2", path=files["C"])))
        assert h.call(lambda g: g.remove_adapter("A")) is True
        before = h.call(lambda g: g.status())["generation"]
        new = GroupPlans(plans={T.shape_key: entry(T, batch=2)}, source="test")
        h.call(lambda g: g.reconfigure(new.model_dump(mode="json")))
        _until(lambda: h.call(lambda g: g.status())["plans_swapped"] == 1)
        assert h.call(lambda g: g.status())["generation"] == before + 1  # a new worker set
        assert _names(h) == {"C"}
        assert h.call(lambda g: g.generate(_req("after-swap", "C"))).media_type == "image/png"


def test_a_change_waits_for_live_replicas_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica that stopped acknowledging (scaled down, died) drops out of the wait after LIVE_S;
    one that acknowledges the version ends it. On a clock of the test's own (no timing on CI)."""
    import asyncio

    from xema_ray.serving.group import adapter_registry

    clock = [1000.0]
    monkeypatch.setattr(adapter_registry, "_now", lambda: clock[0])
    reg = AdapterRegistry()
    epoch = reg.epoch
    c = AdapterSource(name="C", model="m", path=Path("/x.safetensors"))

    async def scenario() -> None:
        await reg.ack("m", "gone", 0)
        await reg.ack("m", "up", 0)
        assert await reg.reserve("m", "C", in_folder=False) and not await reg.reserve("m", "C", in_folder=False)
        v = await reg.commit(c)
        assert not await reg.reserve("m", "C", in_folder=False)  # added: taken
        assert reg.behind("m", v) == ["gone", "up"]
        waiting = asyncio.ensure_future(reg.wait_synced("m", v, timeout_s=60.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # both live, neither has v
        clock[0] += adapter_registry.LIVE_S + 1  # "gone" is silent from now on; "up" acknowledges v
        await reg.ack("m", "up", v)
        assert await asyncio.wait_for(waiting, 2.0) == []
        assert (await reg.poll("m", "up", v, epoch)) is None  # nothing newer
        assert (await reg.poll("m", "up", v - 1, epoch)).added == {"C": c}  # newer: the state

    asyncio.run(scenario())


def test_the_registry_refuses_folder_names_and_a_refused_add_changes_nothing() -> None:
    import asyncio

    reg = AdapterRegistry()

    async def scenario() -> None:
        assert not await reg.reserve("m", "A", in_folder=True)  # the YAML folder's A, served
        v = await reg.remove("m", "A", from_folder=True)
        assert await reg.reserve("m", "A", in_folder=True)  # deleted at run time: A may be added again
        await reg.release("m", "A")  # ... but the file was refused
        s = await reg.state("m")
        assert s.version == v and s.removed == ["A"] and not s.added  # still deleted, nothing added
        assert await reg.reserve("m", "A", in_folder=True)  # released: free again

    asyncio.run(scenario())


def test_a_replaced_registry_gets_back_what_the_replicas_served() -> None:
    """Serve replaced the registry's replica (a new, empty one): the first replica to sync hands
    back the state it applied, so a later change elsewhere does not drop what was added before."""
    import asyncio

    old = AdapterRegistry()
    c = AdapterSource(name="C", model="m", path=Path("/c.safetensors"))

    async def scenario() -> None:
        await old.reserve("m", "C", in_folder=False)
        await old.commit(c)
        await old.remove("m", "A", from_folder=True)
        applied = await old.poll("m", "r1", 0, 0)  # r1 synced with the old registry
        assert applied is not None
        new = AdapterRegistry()
        assert new.epoch != old.epoch
        again = await new.poll("m", "r1", applied.version, applied.epoch)
        assert again is not None and again.epoch == new.epoch and not again.added  # another epoch: the state, empty
        restored = await new.restore("m", applied)
        assert restored.added == {"C": c} and restored.removed == ["A"]
        assert (await new.restore("m", RegistryState())).added == {"C": c}  # taken once; later replicas get it

    asyncio.run(scenario())


def test_a_drop_waiting_for_a_batch_blocks_no_other_change(files: dict[str, Path]) -> None:
    """r2's workers cannot forget A yet (a batch uses it): r2 refuses A at once, and an add on r1
    still reaches r2 and is acknowledged while the drop waits; the drop ends once the batch does."""
    from xema_ray.lora import AdapterRejected as InUse

    registry = LocalDeployment(AdapterRegistry())
    try:
        with replica(files, registry) as r1, replica(files, registry) as r2, ticking(r1, r2):
            _until(lambda: _names(r1) == _names(r2) == {"A"} and {r for _, r in registry.target._acks}
                   >= {r1.group.owner, r2.group.owner})
            busy, real, removes = threading.Event(), r2.group.workers.collective_rpc, []
            busy.set()

            async def rpc(method: str, *args, **kwargs):  # type: ignore[no-untyped-def]
                if method == "remove_adapter":
                    removes.append(kwargs.get("args"))
                    if busy.is_set():
                        raise InUse("adapter 'A' is used by a running batch", "A")
                return await real(method, *args, **kwargs)

            r2.group.workers.collective_rpc = rpc  # type: ignore[method-assign]
            assert r1.call(lambda g: g.remove_adapter("A")) is True
            assert "A" not in _names(r2)  # acknowledged: r2 refuses A from now on
            _until(lambda: bool(removes), timeout_s=30)  # its workers are told in the background, and refuse
            assert "A" in r2.group.adapters._dropping  # the workers still hold it
            r1.call(lambda g: g.add_adapter(AdapterSource(name="C", model="tiny-flux2", path=files["C"])), timeout=60)
            assert _names(r2) == {"C"} and "A" in r2.group.adapters._dropping  # applied beside the waiting drop
            busy.clear()
            _until(lambda: "A" not in r2.group.adapters._dropping, timeout_s=30)
    finally:
        registry.close()
