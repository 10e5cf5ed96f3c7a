"""The console's parts without a browser or Ray: the admin-key rule, the observed attainment window,
the operator view assembled from a Router's state, the trace view of a served template (the
analyzer's data, against the budget, the mitigations placed on its pressure), and the static pages
(served with their CSP, every asset they name present, no URL of another host).
The browser test on a live app: ``test_console_browser.py``."""

from __future__ import annotations

import asyncio
import re
import types
from pathlib import Path

import pytest
from fastapi import FastAPI

from bench.scenarios.console_app import ADMIN_KEY, COG, FLUX, USER_KEY, app_args, app_table
from tests.serving.api.asgi_client import call
from xema_ray.serving.api.auth import AuthConfig, TenantGuard, set_auth
from xema_ray.serving.api.health import GroupHealth
from xema_ray.serving.stats import StatsResponse
from xema_ray.serving.console.operator import attainment_of, operator_view
from xema_ray.serving.group.handle import GroupHandle
from xema_ray.serving.group.load_metrics import GroupLoad, LoadMetrics
from xema_ray.serving.console.static import CSP, STATIC, install_ui


@pytest.fixture
def keys():  # type: ignore[no-untyped-def]
    set_auth(AuthConfig.model_validate(app_args(Path("/tmp"))["auth"]))
    yield
    set_auth(None)


async def _ok(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.usefixtures("keys")
def test_the_operator_data_needs_an_admin_key() -> None:
    guard = TenantGuard(_ok)

    def get(path: str, key: str | None) -> int:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return asyncio.run(call(guard, "GET", path, headers=headers)).status

    assert get("/v1/console/operator", None) == 401
    assert get("/v1/console/operator", USER_KEY) == 403
    assert get("/v1/console/traces/tiny-flux2/64x64x1", USER_KEY) == 403
    assert get("/v1/console/operator", ADMIN_KEY) == 200
    assert get("/v1/templates", USER_KEY) == 200  # a tenant's key still reaches the rest of the API
    assert get("/ui/", None) == 200  # the pages hold no data: served without a key
    r = asyncio.run(call(guard, "GET", "/v1/console/operator", headers={"authorization": f"Bearer {USER_KEY}"}))
    assert r.json()["error"]["code"] == "admin_key_required"


def test_a_keys_file_marks_admin_keys(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"{USER_KEY} team\n{ADMIN_KEY} ops admin\n")
    keys = AuthConfig(keys_file=f).keys()
    assert [(k.tenant, k.admin) for k in keys] == [("team", False), ("ops", True)]
    f.write_text(f"{ADMIN_KEY} ops root\n")
    with pytest.raises(ValueError, match="KEY TENANT admin"):
        AuthConfig(keys_file=f)


def test_attainment_is_the_groups_window_summed_over_replicas_video_jobs_and_failures_included() -> None:
    """The operator view's attainment is what the group replicas finished (sync or job alike; a
    request failed alone counts as missed), over their window, each replica counted once."""
    a = LoadMetrics("m", lambda: ({}, None), window_s=10.0)
    a.observe_request("t", met=True, now=0.0)
    a.observe_request("t", met=False, now=5.0)  # e.g. a video job finished after its SLO
    a.observe_request("t", met=True, now=12.0)
    b = LoadMetrics("m", lambda: ({}, None), window_s=10.0)
    b.observe_request("t", met=True, now=12.0)
    got = attainment_of([a.snapshot(now=13.0).model_copy(update={"replica": "r1"}),
                         b.snapshot(now=13.0).model_copy(update={"replica": "r2"})])["t"]
    assert (got.requests, got.met, got.fraction, got.window_s) == (3, 2, 2 / 3, 10.0)
    assert attainment_of([a.snapshot(now=100.0)])["t"].fraction is None


def test_the_operator_view_from_a_routers_state() -> None:
    table = app_table(app_args(Path("/tmp")))

    class Handle:
        class replica_summary:  # noqa: N801 (a Serve handle's method)
            @staticmethod
            async def remote() -> None:
                raise RuntimeError("replaced")

        class load_stats:  # noqa: N801
            @staticmethod
            async def remote() -> GroupLoad:
                load = LoadMetrics(COG.model, lambda: ({}, None))
                load.observe_request(COG.shape_key, met=True)
                return load.snapshot().model_copy(update={"replica": "r1"})

    router = types.SimpleNamespace(groups={FLUX.model: GroupHandle(Handle()), COG.model: GroupHandle(Handle())}, table=table,  # type: ignore[arg-type]
                                   served={FLUX.shape_key: FLUX, COG.shape_key: COG})
    router.health = GroupHealth(router.groups)
    view = asyncio.run(operator_view(router, StatsResponse(received=3)))
    assert view.received == 3 and view.budget_bytes == table.budget_bytes
    cog = next(g for g in view.groups if g.model == COG.model)
    [row] = cog.plans
    assert row.template == COG.shape_key and "vae_chunking×4" in row.config
    assert row.mitigations == ["vae_chunking×4 (vae.decoder[up_blocks.2:])"]
    assert not row.layout_armed and "no static layout" in row.layout_why
    assert cog.attainment[COG.shape_key].fraction == 1.0
    assert cog.replicas == [] and cog.status == "starting"  # a group that does not answer: shown as such


def test_the_trace_view_places_the_mitigation_on_the_pressure() -> None:
    from deployments.console_traces import trace_view

    table = app_table(app_args(Path("/tmp")))
    v = trace_view(COG.shape_key, table.entries[COG.shape_key], table.budget_bytes)
    assert max(v.unmitigated) > v.budget_bytes > max(v.mitigated)  # the plan fits, the bare model does not
    assert v.pressure and all(p.peak_bytes > v.budget_bytes for p in v.pressure)
    [m] = v.mitigations
    assert any(m.start < p.stop and p.start < m.stop for p in v.pressure), "the mitigation acts on no pressure interval"
    assert len(v.x) == len(v.unmitigated) == len(v.mitigated) <= 600
    assert {p.label for p in v.phases} >= {"text", "denoise", "decode"}
    assert max(p.stop for p in v.phases) == v.events


def test_the_pages_are_served_with_their_policy_and_name_no_other_host() -> None:
    app = FastAPI()
    install_ui(app)
    assert asyncio.run(call(app, "GET", "/ui")).status == 307
    for page in ("/ui/", "/ui/operator.html"):
        r = asyncio.run(call(app, "GET", page))
        assert r.status == 200 and r.headers["content-security-policy"] == CSP
        for asset in re.findall(r'(?:src|href)="([^"]+)"', r.body.decode()):
            if asset.startswith(("data:", "/docs", "./", "operator.html")):
                continue
            assert (STATIC / asset).is_file(), asset
    for f in STATIC.iterdir():
        text = f.read_text()
        urls = set(re.findall(r"[a-z]+://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{f.name} names another host: {urls}"
    weight = sum(f.stat().st_size for f in STATIC.iterdir())
    assert weight < 64 * 1024, f"the console's files weigh {weight} bytes"
