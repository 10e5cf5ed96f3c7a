"""Start-up refuses a deployment whose node's host memory would not fit (issue #36), before any
worker loads: the reference box (deployments/xema-a6000x8.yaml, plans/a6000x8.json), its stated
512 GB, and smaller nodes. Real-size meta builds of the three models (~15 s): the reference
deployment is the case the check exists for."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from xema_ray.plan import PlanTable
from xema_ray.serving import startup
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.startup import PlanNotRunnable, ShmSpace, check_runnable, node_host, served_templates

ROOT = Path(__file__).resolve().parents[2]
BIG_SHM = ShmSpace(directory=Path("/dev/shm"), free_bytes=10**12)


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    args = yaml.safe_load((ROOT / "deployments" / "xema-a6000x8.yaml").read_text())["applications"][0]["args"]
    cfg = ServeConfig.model_validate(args)
    return cfg, PlanTable.load(str(ROOT / "plans" / "a6000x8.json")), served_templates(cfg)


def test_the_reference_box_fits_its_stated_ram_with_one_copy_per_model(reference, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg, table, templates = reference
    assert cfg.host_memory == "512GB"
    monkeypatch.setattr(startup, "node_memory_bytes", lambda: 10**12)  # a box with more RAM than it states
    spare = check_runnable(table, cfg, templates, shm=ShmSpace(directory=Path("/dev/shm"), free_bytes=256 * 10**9))
    node = node_host(table, cfg, templates, 512 * 10**9)
    assert spare == 512 * 10**9 - node.resident_bytes and node.fits
    # four Flux.2 workers hold one copy: the first pays its host-homed blocks and encoder, the others nothing more
    flux = next(g for g in node.groups if g.model == "flux2")
    assert flux.workers == 4 and flux.further_worker_bytes == 0 and flux.first_worker_bytes > 40 * 10**9


def test_a_node_that_would_not_fit_is_refused_naming_the_bytes(reference, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg, table, templates = reference
    monkeypatch.setattr(startup, "node_memory_bytes", lambda: 10**12)
    with pytest.raises(PlanNotRunnable, match=r"host memory: the node's workers hold [0-9.]+ GB of weights on the host, "
                                              r"[0-9.]+ GB while loading \(.*flux2: 4 workers.*\); the node "
                                              r"\(host_memory\) has 128.0 GB"):
        check_runnable(table, cfg.model_copy(update={"host_memory": "128GB"}), templates, shm=BIG_SHM)
    # a machine with less RAM than the YAML states: its own RAM counts, and the error says so
    monkeypatch.setattr(startup, "node_memory_bytes", lambda: 100 * 10**9)
    with pytest.raises(PlanNotRunnable, match=r"this machine \(the deployment states host_memory 512.0 GB, but it\) "
                                              r"has 100.0 GB"):
        check_runnable(table, cfg, templates, shm=BIG_SHM)


def test_error_raised_if_the_shared_segments_exceed_dev_shms_free_bytes(reference, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue #47: the planned shared segments (beside Ray's object store on the same tmpfs) against
    the tmpfs's free bytes, refused at start-up naming both, not found when each worker loads; a
    deployment that pins nothing (CPU: no shared segments) starts on a container's 64 MB."""
    cfg, table, templates = reference
    monkeypatch.setattr(startup, "node_memory_bytes", lambda: 10**12)
    shared = node_host(table, cfg, templates).shared_bytes
    assert shared > 100 * 10**9
    container = ShmSpace(directory=Path("/dev/shm"), free_bytes=64 * 2**20)
    with pytest.raises(PlanNotRunnable, match=rf"/dev/shm: 67,108,864 bytes free, the node's workers plan "
                                              rf"{shared / 1e9:.1f} GB of shared weight segments there \(enlarge it"):
        check_runnable(table, cfg, templates, shm=container)
    # room for the segments, not for them and Ray's object store on the same tmpfs
    beside = ShmSpace(directory=Path("/dev/shm"), free_bytes=shared + 10**9, object_store_bytes=30 * 10**9)
    with pytest.raises(PlanNotRunnable, match=r"shared weight segments there beside Ray's object store of 30.0 GB on "
                                              r"the same tmpfs"):
        check_runnable(table, cfg, templates, shm=beside)
    assert beside.model_copy(update={"object_store_bytes": 0}).problem(shared) is None
    # the CPU demo and CI: no segment planned, so a 64 MB /dev/shm is enough
    cpu = cfg.model_copy(update={"device": "cpu"})
    assert node_host(table, cpu, templates).shared_bytes == 0 and container.problem(0) is None


@pytest.fixture(scope="module")
def demo():  # type: ignore[no-untyped-def]
    args = yaml.safe_load((ROOT / "deployments" / "xema.yaml").read_text())["applications"][0]["args"]
    cfg = ServeConfig.model_validate({k: v for k, v in args.items() if k != "plan_table"})
    return cfg, PlanTable.load(str(ROOT / "plans" / "demo-cpu.json")), served_templates(cfg)


def test_start_up_takes_the_tables_host_figures_where_counted_from_the_same_plans(demo, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue #49: the demo's table records each group's host figure with its basis (``host_basis``), as
    ``make demo-plan`` counts it; start-up takes it instead of building eight models on the meta device
    (seconds of diffusers imports in Serve's build task), and only where its own group hashes the same."""
    from deployments.planning import with_node_host
    from xema_ray.runtime import host_bytes

    cfg, table, templates = demo
    assert table.host is not None and all(g.basis is not None for g in table.host.groups)
    counted = node_host(table.model_copy(update={"host": None}), cfg, templates)
    assert with_node_host(table, cfg, templates).host == table.host  # the committed figures are current
    calls: list[str] = []
    real = host_bytes.group_host
    monkeypatch.setattr(host_bytes, "group_host", lambda model, *a, **k: calls.append(model) or real(model, *a, **k))
    assert node_host(table, cfg, templates) == counted and calls == []
    # another sharing or residency for one group: that group is counted again, the others are taken
    share = cfg.model_copy(update={"models": [g.model_copy(update={"share_host_weights": "on"}) if g.model == "tiny-flux2"
                                              else g for g in cfg.models]})
    assert node_host(table, share, templates).groups[0].basis != table.host.groups[0].basis and calls == ["tiny-flux2"]
    resid = cfg.model_copy(update={"models": [g.model_copy(update={"residency": "shared"}) if g.model == "tiny-ltx2"
                                              else g for g in cfg.models]})
    node_host(table, resid, templates)
    assert calls == ["tiny-flux2", "tiny-ltx2"]
    # a figure recorded for other plans is not taken, whatever it says
    wrong = table.host.model_copy(update={"groups": [g.model_copy(update={"worker": g.worker.model_copy(
        update={"resident_bytes": 10**15}), "basis": "0" * 16}) for g in table.host.groups]})
    assert node_host(table.model_copy(update={"host": wrong}), cfg, templates).resident_bytes == counted.resident_bytes
