"""Static layouts per plan entry: solved from the worker's own stream, stored next to the table,
validated by the worker (hash, version, GPU model), replayed through the C++ host arena."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.scenarios.factories import plan_entry, plan_table
from xema_ray.allocator.solver import solve_layout
from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import ExecutionConfig, Mitigation, PlanTable
from xema_ray.runtime.engine import Batch, GenerationRequest
from xema_ray.allocator.layout_replay import replay
from xema_ray.allocator.artifact import LayoutMismatch, layouts_dir, load_artifact, save_artifact
from xema_ray.measure.layout_solve import solve_entry_layout
from xema_ray.measure.verify import verify_table
from xema_ray.runtime.worker import ModelLoadConfig, Worker
from xema_ray.templates import RequestTemplate

T = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=4)
CFG = ExecutionConfig(template=T, mitigations=(Mitigation(kind="block_offload", blocks=(0, 2), intensity=2),))


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("plans") / "table.json"
    art = solve_entry_layout(CFG, gpu="NVIDIA RTX A6000")
    save_artifact(art, layouts_dir(path))
    plan_table([plan_entry(CFG, layout_ref=art.layout_id, peak_bytes=1, latency_s=1.0, slo_s=10.0,
                           latency_source="estimated")], hardware="x").save(str(path))
    return path


def test_verify_replays_the_workers_stream_with_no_miss(table_path) -> None:  # type: ignore[no-untyped-def]
    (e,) = verify_table(PlanTable.load(str(table_path)), path=str(table_path)).entries
    assert e.error is None and e.fits
    assert e.layout_misses == 0
    assert e.lower_bound_bytes and e.static_reserved_bytes and e.static_reserved_bytes <= 1.02 * e.lower_bound_bytes


def test_cpu_worker_loads_and_validates_layouts_and_says_why_it_cannot_arm(table_path) -> None:  # type: ignore[no-untyped-def]
    table = PlanTable.load(str(table_path))
    cfg = table.entries[T.shape_key].config
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model=T.model, plans=(cfg,), layouts_dir=layouts_dir(table_path)))
    assert cfg.layout_ref in w.layouts
    out = w.execute(Batch(config=cfg, requests=(GenerationRequest(request_id="r", prompt="a fox", seed=1),), steps=cfg.template.steps))
    assert not out.layout_armed
    assert out.layout_status is not None and "not armed" in out.layout_status and "CUDA" in out.layout_status


def test_error_raised_if_layout_is_for_another_gpu_or_edited(table_path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ref = PlanTable.load(str(table_path)).entries[T.shape_key].config.layout_ref
    assert ref is not None
    folder = layouts_dir(table_path)
    with pytest.raises(LayoutMismatch, match=r"solved for 'NVIDIA RTX A6000', this worker runs on 'NVIDIA H200'"):
        load_artifact(folder, ref, gpu="NVIDIA H200")
    doc = json.loads((folder / f"{ref}.json").read_text())
    doc["layout"]["offset"][0] += 512
    (tmp_path / f"{ref}.json").write_text(json.dumps(doc))
    with pytest.raises(LayoutMismatch, match=r"content hashes to .*, the plan names"):
        load_artifact(tmp_path, ref)
    with pytest.raises(LayoutMismatch, match=r"is missing"):
        load_artifact(tmp_path, "0123456789abcdef")


def test_real_cpu_stream_replays_against_the_meta_layout_with_no_miss() -> None:
    # the meta trace (what layouts are solved from) against a real CPU run of the same pipeline
    t = RequestTemplate(model="tiny-cogvideox", height=32, width=48, frames=5, steps=3)
    meta = trace_template(t, TraceOptions(device="meta", count_host=True))
    cpu = trace_template(t, TraceOptions(device="cpu", replicate=False))
    layout = solve_layout(meta)
    report = replay(layout, cpu)
    assert report.misses == 0 and report.hits == int(np.count_nonzero(cpu.size))
