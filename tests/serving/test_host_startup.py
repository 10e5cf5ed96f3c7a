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
from xema_ray.serving.startup import PlanNotRunnable, check_runnable, node_host, served_templates

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    args = yaml.safe_load((ROOT / "deployments" / "xema-a6000x8.yaml").read_text())["applications"][0]["args"]
    cfg = ServeConfig.model_validate(args)
    return cfg, PlanTable.load(str(ROOT / "plans" / "a6000x8.json")), served_templates(cfg)


def test_the_reference_box_fits_its_stated_ram_with_one_copy_per_model(reference, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg, table, templates = reference
    assert cfg.host_memory == "512GB"
    monkeypatch.setattr(startup, "node_memory_bytes", lambda: 10**12)  # a box with more RAM than it states
    spare = check_runnable(table, cfg, templates)
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
        check_runnable(table, cfg.model_copy(update={"host_memory": "128GB"}), templates)
    # a machine with less RAM than the YAML states: its own RAM counts, and the error says so
    monkeypatch.setattr(startup, "node_memory_bytes", lambda: 100 * 10**9)
    with pytest.raises(PlanNotRunnable, match=r"this machine \(the deployment states host_memory 512.0 GB, but it\) "
                                              r"has 100.0 GB"):
        check_runnable(table, cfg, templates)
