"""``--host-budget``: the node's host memory as a planning budget (planner.host_choice).

The Flux.2 tests plan the real model (meta builds, the cost model; ~15 s each): the issue's own
command is the case worth checking, a 32 B DiT whose offloaded blocks and 24 B streamed encoder
land on the host of a one-GPU node.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scenarios.factories import plan_entry
from xema_ray.host_budget import HostBytes, NodeHost
from xema_ray.plan import GroupResidency, PlanEntry, PlanTable, TextEncoderChoice
from xema_ray.templates import RequestTemplate

from planner.cli import main as planner
from planner.finishing import GroupState
from planner.host_choice import HostBudgetError, fit_host_budget

FLUX = ["plan", "--templates", "flux2:1024x1024", "--gpus", "1", "--budget", "48GB", "--hardware", "a6000",
        "--measure", "never", "--no-ray", "--no-layouts"]


def test_flux2_on_one_gpu_within_64GB_is_refused_naming_the_bytes(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "t.json"
    assert planner([*FLUX, "--host-budget", "64GB", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    # 16+ DiT blocks (~23 GB) and the 46.7 GB Mistral-3 encoder on the host of the one worker
    assert "no plan keeps the node's host memory within --host-budget 64.0 GB: the smallest found needs" in err
    assert "flux2: 1 workers" in err and not out.exists()


def test_flux2_with_a_larger_host_budget_gets_a_plan_recording_its_host_bytes(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert planner([*FLUX, "--host-budget", "96GB", "--out", str(out)]) == 0
    table = PlanTable.load(str(out))
    node = table.host
    assert node is not None and node.budget_bytes == 96 * 10**9 and node.fits
    (entry,) = table.entries.values()
    host = entry.prediction.host
    assert host is not None and host.resident_bytes == node.resident_bytes > 64 * 10**9  # no 64 GB plan exists
    assert entry.config.text_encoder in ("streamed", "cpu")  # 46.7 GB cannot join 40 GB of blocks on a 48 GB GPU


# ---------------------------------------------------------------------------- the choice, on synthetic plans
T = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)


def _entry(blocks: tuple[int, ...], goodput: float, encoder: str = "streamed") -> PlanEntry:
    from xema_ray.plan import Mitigation

    mit = (Mitigation(kind="block_offload", blocks=blocks, intensity=len(blocks)),) if blocks else ()
    return plan_entry(T, mitigations=mit, text_encoder=encoder, peak_bytes=1, latency_s=1.0, goodput_rps=goodput,
                      slo_s=10.0, latency_source="estimated")


def _refinish(device_fits: bool):  # type: ignore[no-untyped-def]
    """finish_group's stand-in: the encoder goes on the device where asked and the device holds it."""
    def refinish(model, group, allowed):  # type: ignore[no-untyped-def]
        out = {}
        for k, e in group.items():
            enc = "device" if device_fits and allowed.get(k) == ("device",) else e.config.text_encoder
            lost = 0.5 if enc == "device" and e.config.text_encoder != "device" else 0.0
            out[k] = e.model_copy(update={"config": e.config.model_copy(update={"text_encoder": enc}),
                                          "prediction": e.prediction.model_copy(
                                              update={"goodput_rps": e.prediction.goodput_rps - lost})})
        return GroupState(out, GroupResidency(policy="per_template"),
                          {k: TextEncoderChoice(placement=e.config.text_encoder, seconds_per_batch=0.0)
                           for k, e in out.items()})
    return refinish


def test_over_budget_the_least_goodput_per_byte_is_given_up() -> None:
    from xema_ray.runtime.host_bytes import worker_host_bytes
    from xema_ray.runtime.residency import Residency

    chosen, fewer = _entry((0, 1, 2), 10.0), _entry((0,), 9.0)
    full = worker_host_bytes(T.spec, Residency(host_blocks=(0, 1, 2)), "streamed")
    small = worker_host_bytes(T.spec, Residency(host_blocks=(0,)), "streamed")
    # two workers, nothing shared (a CPU plan): the chosen plan's node is over, the candidate's within
    budget = full.resident_bytes + small.resident_bytes + 2 * full.transient_bytes
    finished, node = fit_host_budget({T.shape_key: chosen}, {T.shape_key: [fewer]}, _refinish(False), {}, 2,
                                     budget, share=False)
    entries = next(iter(finished.values())).entries
    assert entries[T.shape_key].config == fewer.config  # the candidate with fewer host blocks
    assert node.fits and node.load_peak_bytes <= budget
    # the encoder on the device where it fits: cheaper in goodput here than the candidate, so taken first
    finished, node = fit_host_budget({T.shape_key: chosen}, {T.shape_key: [_entry((0,), 1.0)]}, _refinish(True), {},
                                     1, full.resident_bytes + full.transient_bytes - 1, share=False)
    entries = next(iter(finished.values())).entries
    assert entries[T.shape_key].config.text_encoder == "device" and node.fits
    with pytest.raises(HostBudgetError, match=r"within --host-budget 1,000 bytes: the smallest found needs [0-9,]+ bytes"):
        fit_host_budget({T.shape_key: chosen}, {T.shape_key: [fewer]}, _refinish(True), {}, 2, 1000, share=False)


def test_shared_workers_count_once_per_node() -> None:
    w = HostBytes(resident_bytes=100, pinned_bytes=100, shared_bytes=90, shared_pinned_bytes=90, transient_bytes=5)
    from xema_ray.host_budget import GroupHost

    node = NodeHost.of([GroupHost(model="m", workers=4, worker=w)], budget_bytes=150)
    assert (node.groups[0].first_worker_bytes, node.groups[0].further_worker_bytes) == (100, 10)
    assert (node.resident_bytes, node.load_peak_bytes, node.fits) == (130, 150, True)
