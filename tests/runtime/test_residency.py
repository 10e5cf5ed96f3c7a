"""Weight residency decided at load: the worker's own load + execute path, counted.

On the meta device (what ``xema verify`` runs) a worker whose plan offloads blocks never holds
them on the device; on the CPU its outputs equal the unmitigated worker's bit for bit; two
templates with different residency served alternately move only the difference; a plan table
a group cannot run is refused at start-up; weights load from a local diffusers directory.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from bench.scenarios.factories import plan_entry, plan_table
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.models.loading import CheckpointError
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import DecodeStage, ExecutionConfig, Mitigation, PlanTable
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.runtime.residency import Residency, block_sizes
from xema_ray.measure.verify import verify_config
from xema_ray.runtime.host_bytes import worker_host_bytes
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.startup import PlanNotRunnable, check_runnable
from xema_ray.templates import RequestTemplate

TEMPLATES = {
    "tiny-flux2": RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2),
    "tiny-cogvideox": RequestTemplate(model="tiny-cogvideox", height=64, width=64, frames=9, steps=2),
    "tiny-ltx2": RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=2),
}


def _offload(blocks: tuple[int, ...]) -> Mitigation:
    return Mitigation(kind="block_offload", blocks=blocks, intensity=len(blocks))


def _worker(model: str, plans: tuple[ExecutionConfig, ...] = (), platform: str = "cpu") -> Worker:
    w = Worker(platform=platform)
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model=model, plans=plans))
    return w


def _run(w: Worker, config: ExecutionConfig, seed: int = 3) -> bytes:
    batch = Batch(config=config, requests=(GenerationRequest(request_id="r", prompt="a red fox", seed=seed),), steps=config.template.steps)
    return w.execute(batch).outputs[0].data


@pytest.mark.parametrize("model", list(TEMPLATES))
def test_offloaded_blocks_never_on_device_and_budget_met(model: str) -> None:
    t = TEMPLATES[model]
    n = t.spec.num_dit_blocks
    base = verify_config(ExecutionConfig(template=t), budget_bytes=10**12)
    offloaded = tuple(range(0, n, 2))
    sizes = block_sizes(t.spec)
    # a budget the unmitigated worker misses and the offloading one must meet
    budget = base.device_peak_bytes - sum(sizes[i] for i in offloaded) // 2
    assert not verify_config(ExecutionConfig(template=t), budget_bytes=budget).fits
    mitigated = verify_config(ExecutionConfig(template=t, mitigations=(_offload(offloaded),)), budget_bytes=budget)
    assert mitigated.error is None and mitigated.fits, mitigated
    # the load placed none of the offloaded blocks' bytes on the device: they are on the host
    assert mitigated.host_bytes == sum(sizes[i] for i in offloaded)
    assert mitigated.load_peak_bytes <= base.load_peak_bytes - mitigated.host_bytes + 512 * 4
    # while executing, at most one offloaded block and the one prefetched are on the device on top
    in_flight = max((sizes[a] + sizes[b] for a, b in zip(offloaded, offloaded[1:], strict=False)),
                    default=max(sizes[i] for i in offloaded))
    assert mitigated.device_peak_bytes <= base.device_peak_bytes - mitigated.host_bytes + in_flight + 4096


@pytest.mark.parametrize("model", list(TEMPLATES))
def test_residency_outputs_bitwise_equal(model: str) -> None:
    t = TEMPLATES[model]
    n = t.spec.num_dit_blocks
    plain = ExecutionConfig(template=t)
    offload = ExecutionConfig(template=t, mitigations=(_offload(tuple(range(n))),))
    ref = _run(_worker(model), plain)
    w = _worker(model, (offload,))
    assert w.residency is not None and w.residency.current.host_blocks == tuple(range(n))
    assert _run(w, offload) == ref
    assert _run(w, offload) == ref  # the second batch finds the blocks where the first left them


def test_alternating_templates_move_only_the_difference() -> None:
    model = "tiny-flux2"
    a = ExecutionConfig(template=TEMPLATES[model], mitigations=(_offload((0, 1)),))
    b = ExecutionConfig(template=TEMPLATES[model].with_(width=128, height=128), mitigations=(_offload((1, 2)),))
    ref_w = _worker(model)
    refs = {c.template.key: _run(ref_w, c.model_copy(update={"mitigations": ()})) for c in (a, b)}
    w = _worker(model, (a, b))
    sizes = block_sizes(get_model_spec(model))
    moved = []
    for c in (a, b, a, b):
        batch = Batch(config=c, requests=(GenerationRequest(request_id="r", prompt="a red fox", seed=3),), steps=c.template.steps)
        result = w.execute(batch)
        assert result.outputs[0].data == refs[c.template.key]
        moved.append(result.residency_bytes_moved)
    assert moved == [0, sizes[0] + sizes[2], sizes[0] + sizes[2], sizes[0] + sizes[2]]
    assert w.residency is not None and w.residency.switches == 3


def test_shared_residency_streams_every_host_block() -> None:
    model = "tiny-flux2"
    a = ExecutionConfig(template=TEMPLATES[model], mitigations=(_offload((0,)),))
    b = ExecutionConfig(template=TEMPLATES[model].with_(width=128, height=128), mitigations=(_offload((2,)),))
    ref = _run(_worker(model), a.model_copy(update={"mitigations": ()}))
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    loaded = w.load_model(ModelLoadConfig(model=model, plans=(a, b), residency="shared"))
    assert loaded.host_blocks == (0, 2)
    result = w.execute(Batch(config=a, requests=(GenerationRequest(request_id="r", prompt="a red fox", seed=3),), steps=a.template.steps))
    assert result.outputs[0].data == ref and result.residency_bytes_moved == 0


def _table(entries: dict[RequestTemplate, ExecutionConfig], gpus: int = 2) -> PlanTable:
    return plan_table([plan_entry(c, peak_bytes=1, latency_s=1.0, slo_s=10.0, latency_source="estimated")
                       for c in entries.values()], hardware="x", gpus=gpus)


def test_error_raised_if_group_cannot_run_plan() -> None:
    t = TEMPLATES["tiny-cogvideox"]
    cfg = ServeConfig.model_validate({"models": [{"model": t.model, "workers": 3,
                                                  "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 2}]}]})
    table = _table({t: ExecutionConfig(template=t, ulysses=2)})
    with pytest.raises(PlanNotRunnable, match=r"tiny-cogvideox/64x64x9: plan SP2 DP1 BS1 needs SP groups of 2 workers, "
                                              r"but the tiny-cogvideox group has 3"):
        check_runnable(table, cfg, [t])
    table = _table({t: ExecutionConfig(template=t, ulysses=1, dp=4)}, gpus=8)
    with pytest.raises(PlanNotRunnable, match=r"uses 4 GPUs \(SP 1 x DP 4\), the tiny-cogvideox group has 3"):
        check_runnable(table, cfg, [t])
    # a decode pool planned for it (xema plan --stages split): its DiT config cannot decode in place
    pooled = ExecutionConfig(template=t, decode=DecodeStage(workers=1, gpus_per_worker=1))
    with pytest.raises(PlanNotRunnable, match=r"hands its decode to a decode pool of 1 worker\(s\) x 1 GPU \(config.decode.*"
                                              r"the tiny-cogvideox group has no decode: block"):
        check_runnable(_table({t: pooled}), cfg, [t])



def test_error_raised_if_table_planned_for_group_without_its_decode_pool() -> None:
    """A group's GPUs are its DiT workers and, on top of them, its decode pool's (as serving runs
    them): a table planned for the workers alone (the pool carved out of them) is refused."""
    t = TEMPLATES["tiny-cogvideox"]
    cfg = ServeConfig.model_validate({"models": [{"model": t.model, "workers": 2, "decode": {"workers": 1},
                                                  "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 2}]}]})
    assert cfg.models[0].gpus == 3
    pooled = ExecutionConfig(template=t, dp=2, decode=DecodeStage(workers=1, gpus_per_worker=1))
    table = _table({t: pooled}, gpus=3)
    check_runnable(table.model_copy(update={"group_gpus": {t.model: 3}}), cfg, [t])  # 2 DiT workers + the pool
    with pytest.raises(PlanNotRunnable, match=r"tiny-cogvideox: the table was planned for a group of 2 GPUs, the "
                                              r"deployment gives it 3 \(2 DiT workers \+ a decode pool of 1\)"):
        check_runnable(_table({t: ExecutionConfig(template=t, decode=DecodeStage(workers=1, gpus_per_worker=1))})
                       .model_copy(update={"group_gpus": {t.model: 2}}), cfg, [t])


def test_error_raised_if_host_memory_too_small() -> None:
    t = TEMPLATES["tiny-flux2"]
    cfg = ServeConfig.model_validate({"models": [{"model": t.model, "workers": 2,
                                                  "templates": [{"width": 64, "height": 64, "steps": 2}]}]})
    table = _table({t: ExecutionConfig(template=t, mitigations=(_offload((0, 1, 2)),))})
    check_runnable(table, cfg, [t])  # the node has far more than a tiny model's blocks
    with pytest.raises(PlanNotRunnable, match=r"host memory: the node's workers hold [0-9,]+ bytes of weights on the "
                                              r"host, [0-9,]+ bytes while loading .*; the node has 1,000 bytes"):
        check_runnable(table, cfg, [t], host_memory_bytes=1000)
    # the deployment's stated RAM is the node's (here: less than a tiny model's blocks, so refused)
    small = cfg.model_copy(update={"host_memory": "1KB"})
    with pytest.raises(PlanNotRunnable, match=r"the node \(host_memory\) has 1,000 bytes"):
        check_runnable(table, small, [t])


# ---------------------------------------------------------------------------- checkpoints
def _save_component(module: torch.nn.Module, directory, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    module.to(dtype).save_pretrained(str(directory))


@pytest.mark.parametrize("model", list(TEMPLATES))
def test_checkpoint_load_equals_seeded_build(model: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = get_model_spec(model)
    seeded = spec.build_transformer(BuildOptions(seed=7))
    _save_component(seeded, tmp_path / "transformer", torch.float32)
    n = spec.num_dit_blocks
    loaded = spec.build_transformer(BuildOptions(weights_dir=tmp_path, host_modules=(f"transformer.{spec.dit_blocks(seeded)[n - 1][0]}",)))
    ref, got = seeded.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_error_raised_if_checkpoint_is_wrong(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    spec = get_model_spec("tiny-flux2")
    with pytest.raises(CheckpointError, match=r"transformer/config.json: missing"):
        spec.build_transformer(BuildOptions(weights_dir=tmp_path))
    # a checkpoint stored in another dtype is cast on load, with a log line (as from_pretrained(torch_dtype=...))
    seeded = spec.build_transformer(BuildOptions())
    _save_component(seeded, tmp_path / "transformer", torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="xema_ray.models.base"):
        cast = spec.build_transformer(BuildOptions(weights_dir=tmp_path))
    assert "tiny-flux2 transformer: stored as bfloat16, cast to float32 on load" in caplog.text
    assert all(p.dtype == torch.float32 for p in cast.parameters())
    ref = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in seeded.state_dict().items()}
    assert all(torch.equal(ref[k], v) for k, v in cast.state_dict().items())
    # a checkpoint of another config: shapes differ, named with the file and what was expected
    cfg = json.loads((tmp_path / "transformer" / "config.json").read_text())
    _save_component(spec.build_transformer(BuildOptions()), tmp_path / "transformer", torch.float32)
    cfg["num_layers"] = cfg["num_layers"] + 1
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"is missing from the checkpoint"):
        spec.build_transformer(BuildOptions(weights_dir=tmp_path))


def test_verify_cli_reports_entries(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from xema_ray.cli import main

    t = TEMPLATES["tiny-flux2"]
    n = t.spec.num_dit_blocks
    table = _table({t: ExecutionConfig(template=t, mitigations=(_offload(tuple(range(n))),))})
    path = tmp_path / "plans.json"
    table.save(str(path))
    out = tmp_path / "verify.json"
    assert main(["verify", "--plan-table", str(path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (entry,) = report["entries"]
    assert entry["template"] == t.shape_key and entry["fits"] is True
    assert set(entry) >= {"template", "device_peak_bytes", "load_peak_bytes", "host_bytes", "budget_bytes", "fits"}
    assert entry["host_bytes"] == sum(block_sizes(t.spec))
    # host memory per node: the loader's exact buffer, shared by the group's workers (meta stands
    # for GPU workers), against the same tensors pinned one by one in power-of-two blocks per worker
    host, before = entry["host"], entry["host_before"]
    assert entry["host_bytes"] <= host["resident_bytes"] == host["pinned_bytes"] == host["shared_bytes"]
    assert before["pinned_bytes"] > host["pinned_bytes"] and before["shared_bytes"] == 0
    assert host["resident_bytes"] == worker_host_bytes(t.spec, Residency(host_blocks=tuple(range(n))), None).resident_bytes
    node, node_before = report["node"], report["node_before"]
    assert node["groups"][0]["workers"] == 2 and node["resident_bytes"] == host["resident_bytes"]  # once per node
    assert node_before["resident_bytes"] == 2 * before["resident_bytes"]
    assert "host memory per node" in capsys.readouterr().out
    small = table.model_copy(update={"budget_bytes": 1000})
    small.save(str(path))
    assert main(["verify", "--plan-table", str(path)]) == 1
    assert "NO" in capsys.readouterr().out


def test_residency_of_config() -> None:
    t = TEMPLATES["tiny-flux2"]
    c = ExecutionConfig(template=t, ulysses=2, mitigations=(_offload((0,)), Mitigation(kind="hsdp", blocks=(2,), intensity=1)))
    assert Residency.of_config(c).host_blocks == (0, 2)


class _RecordingPlatform:
    """Stands for the CUDA platform's page-locking (``cudaHostRegister``): records the order."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def register_host(self, ptr: int, nbytes: int) -> bool:
        self.calls.append("register")
        return True

    def unregister_host(self, ptr: int) -> None:
        self.calls.append("unregister")


def test_a_switch_back_to_the_device_waits_for_its_copies_before_freeing_their_host_buffer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A block an earlier switch sent to the host lives in a registered (page-locked) buffer; its
    copies back to the device are non_blocking, so the buffer may be unregistered and freed only
    after the CPU waited on an event recorded behind them."""
    from xema_ray.placement import HOST_BUFFER_ATTR
    from xema_ray.platforms import streams
    from xema_ray.platforms.host_memory import HostBuffer, align
    from xema_ray.runtime.residency import ResidencyManager

    spec = get_model_spec("tiny-flux2")
    transformer = spec.build_pipeline(BuildOptions()).transformer
    calls: list[str] = []
    manager = ResidencyManager(spec, transformer, Residency(host_blocks=(0,)))
    block = manager.blocks[0][1]
    tensors = [*block.parameters(), *block.buffers()]
    buf = HostBuffer.private(sum(align(t.numel() * t.element_size()) for t in tensors))
    buf.register(_RecordingPlatform(calls))  # what a switch to the host makes on CUDA
    setattr(block, HOST_BUFFER_ATTR, buf)
    manager._load_host.pop(0)  # homed by that switch, not by the load

    def copy(host: torch.Tensor, device: torch.device, stream: object, pending: object = None) -> torch.Tensor:
        calls.append("copy")
        return host.clone()

    monkeypatch.setattr(streams, "to_device", copy)
    monkeypatch.setattr(streams, "compute_done", lambda device: calls.append("record") or "event")
    monkeypatch.setattr(streams, "host_ready", lambda event: calls.append(f"wait {event}"))
    report = manager.switch(Residency())
    assert report.to_device == (0,)
    n = len(tensors)
    assert calls == ["register", *["copy"] * n, "record", "wait event", "unregister"], calls
    assert not hasattr(block, HOST_BUFFER_ATTR) and not buf.registered
