"""The static allocator's counters through the Serve app on CPU: a plan entry with a layout, served
by a CPU worker, shows in ``/v1/stats`` (and ``/healthz``) with zeros and the reason it is not armed."""

from __future__ import annotations

import pytest
import requests

ray = pytest.importorskip("ray")
from serve_app import running_app  # noqa: E402

from deployments.planning import machine_fingerprint  # noqa: E402
from xema_ray.plan import ExecutionConfig, PlanEntry, PlanPrediction, PlanTable  # noqa: E402
from xema_ray.runtime.layouts import layouts_dir, save_artifact, solve_entry_layout  # noqa: E402
from xema_ray.serving.config import ServeConfig  # noqa: E402
from xema_ray.serving.stats import StatsResponse  # noqa: E402
from xema_ray.templates import RequestTemplate  # noqa: E402

pytestmark = pytest.mark.slow

WITH = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
WITHOUT = RequestTemplate(model="tiny-flux2", width=128, height=128, steps=2)


def test_v1_stats_shows_layout_counters_per_template_and_why_not_armed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = {"device": "cpu", "worker_cpus": 0.25, "jobs": {"path": str(tmp_path / "jobs")},
            "models": [{"model": "tiny-flux2", "workers": 1,
                        "templates": [{"width": 64, "height": 64, "steps": 2}, {"width": 128, "height": 128, "steps": 2}]}]}
    art = solve_entry_layout(ExecutionConfig(template=WITH), gpu="any")
    save_artifact(art, layouts_dir(tmp_path / "table.json"))  # running_app saves the table there
    pred = PlanPrediction(peak_bytes=10**7, latency_s=0.5, goodput_rps=1.0, slo_s=30.0, latency_source="measured")
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(args), 1), gpus=1, budget_bytes=10**9,
                      entries={WITH.shape_key: PlanEntry(config=ExecutionConfig(template=WITH, layout_ref=art.layout_id),
                                                         prediction=pred),
                               WITHOUT.shape_key: PlanEntry(config=ExecutionConfig(template=WITHOUT), prediction=pred)})
    with running_app(args, table, tmp_path) as url:
        before = StatsResponse.model_validate(requests.get(f"{url}/v1/stats", timeout=60).json())
        group = before.static_layouts["tiny-flux2"]
        assert "1 layout(s) loaded and validated; not armed" in group.status and "cpu" in group.status
        assert group.templates[WITH.shape_key].layout_ref == art.layout_id
        assert group.templates[WITHOUT.shape_key].layout_ref is None
        r = requests.post(f"{url}/v1/images/generations", timeout=120,
                          json={"model": "tiny-flux2", "prompt": "a red fox", "size": "64x64", "seed": 3})
        assert r.status_code == 200, r.text
        after = StatsResponse.model_validate(requests.get(f"{url}/v1/stats", timeout=60).json())
        assert after.received == before.received + 1
        st = after.static_layouts["tiny-flux2"].templates[WITH.shape_key]
        # on CPU nothing is armed: the counters are honest zeros, the status says why
        assert (st.batches, st.armed_batches, st.hits, st.fallbacks, st.reserved_bytes) == (1, 0, 0, 0, 0)
        assert "not armed" in after.static_layouts["tiny-flux2"].status
        health = requests.get(f"{url}/healthz", timeout=60).json()
        assert health["groups"]["tiny-flux2"]["static_layouts"]["templates"][WITH.shape_key]["batches"] == 1
