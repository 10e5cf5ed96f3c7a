"""A model group serving adapters (in-process workers, no Ray): the YAML's folder at start-up,
requests with different adapters in one batch each getting the bytes they get alone, files
hot-added and removed, bad files refused naming the adapter and the key, changing nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from bench.scenarios.group_harness import Harness, entry, running_group
from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.lora import AdapterRejected, AdapterSource, LoraUse
from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.serving.group.adapters import AdapterConflict, split_for_pool
from xema_ray.serving.messages import GroupRequest, InvalidRequest
from xema_ray.templates import RequestTemplate

from tests.batch_sizes import assert_same_picture_across_batch_sizes

T = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("adapters")
    pipe = get_model_spec("tiny-flux2").build_pipeline(BuildOptions())
    out = {"A": write_adapter(d / "A.safetensors", pipe.transformer, rank=4, seed=1),
           "B": write_adapter(d / "B.safetensors", pipe.transformer, rank=8, seed=2, layout="ai-toolkit-flux2")}
    bad = d / "bad" / "broken.safetensors"  # in the folder: refused at start-up, the others load
    bad.parent.mkdir()
    bad.write_bytes(b"not a safetensors file")
    out["broken"] = bad
    hot = tmp_path_factory.mktemp("hot")
    out["C"] = write_adapter(hot / "c.safetensors", pipe.transformer, rank=2, seed=3, layout="peft")
    out["wrong_shape"] = hot / "wrong_shape.safetensors"  # Flux.2-dev's width on the tiny model
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 6144),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(6144, 4)}, str(out["wrong_shape"]))
    out["unknown"] = hot / "unknown.safetensors"  # a Wan block name on Flux.2
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 32),
               "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(32, 4)}, str(out["unknown"]))
    out["pickle"] = hot / "x.bin"
    torch.save({"w": torch.zeros(1)}, out["pickle"])
    for name in ("A", "B"):
        (d / "bad" / f"{name}.safetensors").symlink_to(out[name])
    return out


@pytest.fixture(scope="module")
def group(files: dict[str, Path]) -> Iterator[Harness]:
    pool = LoraPoolConfig(dir=files["A"].parent / "bad", roots=(files["A"].parent, files["C"].parent), slots=2,
                          max_rank=8)
    with running_group("tiny-flux2", {T.shape_key: entry(T, batch=4)}, wait_window_s=1.0, max_queue=16,
                       adapters=pool) as h:
        yield h


def _req(rid: str, seed: int, lora: tuple[tuple[str, float], ...] = ()) -> GroupRequest:
    return GroupRequest(template=T.shape_key, request_id=rid, prompt=f"prompt {seed}", seed=seed, steps=T.steps,
                        lora=tuple(LoraUse(name=n, scale=s) for n, s in lora))


def test_requests_with_different_adapters_share_a_batch_and_their_outputs_ignore_their_neighbours(
        group: Harness) -> None:
    """Batch size, seed and adapters fix the output: the same request in another batch of 4, at
    another position beside other adapters, gets the same bytes; alone (batch 1) it gets the same
    picture within the base model's own batch-size rounding on CPU, LoRA or not (tests/batch_sizes.py)."""
    def batch(asks: list[tuple[int, tuple[tuple[str, float], ...]]]) -> list[Any]:
        futs = [group.submit(lambda g, s=s, u=u: g.generate(_req(f"b{s}-{len(u)}-{id(asks)}", s, u))) for s, u in asks]
        outs = [f.result(300) for f in futs]
        assert {o.batch_id for o in outs} == {outs[0].batch_id} and outs[0].batch_size == 4  # one batch of 4
        return outs

    first = batch([(10, (("A", 1.0),)), (11, (("B", 0.8),)), (12, ()), (13, (("A", 0.5), ("B", 1.0)))])
    assert len({o.data for o in first}) == 4
    second = batch([(13, (("A", 0.5), ("B", 1.0))), (30, ()), (10, (("A", 1.0),)), (31, (("B", 0.8),))])
    assert second[0].data == first[3].data and second[2].data == first[0].data
    for s, u, out in [(10, (("A", 1.0),), first[0]), (13, (("A", 0.5), ("B", 1.0)), first[3])]:
        alone = group.call(lambda g, s=s, u=u: g.generate(_req(f"s{s}", s, u)), timeout=300)
        assert alone.batch_size == 1
        assert_same_picture_across_batch_sizes(alone.data, out.data)
    stats = group.call(lambda g: g.adapter_stats())
    assert stats[0].slots == 2 and stats[0].copies >= 2 and stats[0].wait_s > 0


def test_startup_folder_loads_good_files_and_reports_a_broken_one(group: Harness) -> None:
    names = [i.name for i in group.call(lambda g: g.list_adapters())]
    assert names == ["A", "B"]  # broken.safetensors refused at load, the group serves on


@pytest.mark.parametrize(("key", "match"), [
    ("missing", "does not exist"), ("pickle", "not a .safetensors"), ("wrong_shape", "transformer_blocks.0.attn.to_q"),
    ("unknown", "transformer.blocks.0.attn1.to_q"), ("broken", "not a readable safetensors")])
def test_error_raised_if_an_adapter_file_is_bad_and_nothing_changes(group: Harness, files: dict[str, Path], key: str,
                                                                    match: str) -> None:
    before = group.call(lambda g: g.list_adapters())
    path = files.get(key, files["A"].parent / "missing.safetensors")
    with pytest.raises(AdapterRejected, match=match) as e:
        group.call(lambda g: g.add_adapter(AdapterSource(name=f"bad-{key}", model="tiny-flux2", path=path)))
    assert f"bad-{key}" in str(e.value)
    assert group.call(lambda g: g.list_adapters()) == before


def test_error_raised_if_the_adapter_is_for_another_model_or_already_loaded(group: Harness, files: dict[str, Path]) -> None:
    with pytest.raises(AdapterRejected, match="tiny-ltx2"):
        group.call(lambda g: g.add_adapter(AdapterSource(name="x", model="tiny-ltx2", path=files["C"])))
    with pytest.raises(AdapterConflict, match="already loaded"):
        group.call(lambda g: g.add_adapter(AdapterSource(name="A", model="tiny-flux2", path=files["C"])))


def test_hot_added_adapter_serves_then_is_removed(group: Harness, files: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequest, match="unknown adapter 'C'") as e:
        group.call(lambda g: g.generate(_req("c0", 5, (("C", 1.0),))))
    assert e.value.param == "lora[0].name"
    info = group.call(lambda g: g.add_adapter(AdapterSource(name="C", model="tiny-flux2", path=files["C"])))
    assert info.rank == 2 and info.layers > 0
    with_c = group.call(lambda g: g.generate(_req("c1", 5, (("C", 1.0),))), timeout=300)
    plain = group.call(lambda g: g.generate(_req("c2", 5)), timeout=300)
    assert with_c.data != plain.data
    assert group.call(lambda g: g.remove_adapter("C")) is True
    assert "C" not in [i.name for i in group.call(lambda g: g.list_adapters())]
    with pytest.raises(InvalidRequest, match="unknown adapter 'C'"):
        group.call(lambda g: g.generate(_req("c3", 5, (("C", 1.0),))))


def test_a_request_whose_adapter_was_deleted_while_it_waited_fails_alone(group: Harness) -> None:
    failed: dict[str, InvalidRequest] = {}
    reqs = [_req("w0", 1, (("A", 1.0),)), _req("w1", 2, (("gone", 1.0),)), _req("w2", 3)]
    runs = group.group.adapters.fit_pool({None: reqs}, lambda r: r.lora, failed, lambda r: r.request_id)
    assert runs == [(None, [reqs[0], reqs[2]])] and list(failed) == ["w1"] and "'gone'" in str(failed["w1"])


def test_a_batch_needing_more_adapters_than_slots_is_cut() -> None:
    u = {n: (LoraUse(name=n),) for n in "abc"}
    runs = split_for_pool([u["a"], u["b"], (), u["c"], u["a"]], lambda x: x, 2)
    assert runs == [[u["a"], u["b"], ()], [u["c"], u["a"]]]


def test_a_pool_refuses_a_stack_larger_than_its_slots() -> None:
    """One request's adapters are resident together: ``max_per_request`` above ``slots`` would pass
    admission and then fail its whole batch; it is refused in the YAML instead (default: min(4, slots))."""
    assert LoraPoolConfig(slots=2).max_per_request == 2 and LoraPoolConfig().max_per_request == 4
    with pytest.raises(ValueError, match=r"max_per_request \(3\) must be at most slots \(2\)"):
        LoraPoolConfig(slots=2, max_per_request=3)


def test_deleting_an_adapter_a_paused_batch_uses_waits_for_that_batch() -> None:
    """A batch paused at a step boundary resumes with its adapters: DELETE refuses new requests at
    once but forgets the adapter on the workers only after the paused batch is gone."""
    import asyncio
    import types

    from xema_ray.serving.group.adapters import GroupAdapters

    calls: list[tuple[str, tuple[Any, ...]]] = []

    class Workers:
        spec = types.SimpleNamespace(load=types.SimpleNamespace(adapter_sources=()))

        async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[bool]:
            calls.append((method, args))
            return [True]

    paused = [{"B"}, {"A"}]  # the adapters each paused batch's requests stack
    g = GroupAdapters("tiny-flux2", "replica", LoraPoolConfig(slots=2), Workers(),  # type: ignore[arg-type]
                      in_use=lambda name: any(name in names for names in paused))
    g.names = {"A", "B"}
    g._set_sources = lambda sources: None  # type: ignore[method-assign]

    async def scenario() -> None:
        removing = asyncio.ensure_future(g.remove("A"))
        await asyncio.sleep(0.2)
        assert "A" not in g.names and not removing.done() and calls == []  # held by the paused batch
        paused.pop()  # it resumed and finished
        assert await asyncio.wait_for(removing, 2.0) is True
        assert calls == [("remove_adapter", ("A",))]

    asyncio.run(scenario())
