"""The adapter admin API's key check: open API, admin key, other key (docs/tenancy.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.requests import Request

from tests.serving.api.asgi_client import call
from xema_ray.serving.api.adapters import AdapterAdmin, _forbidden
from xema_ray.serving.api.auth import ApiKey, AuthConfig, TenantGuard, set_auth
from xema_ray.serving.group.handle import GroupHandle

ADMIN, USER = "sk-admin-0123456789abcdef", "sk-user-0123456789abcdef"


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """What the endpoints see: the admin API's answer for this request (None: allowed)."""
    denied = _forbidden(Request(scope))
    body = json.dumps({"status": None if denied is None else denied.status_code}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def keys() -> Iterator[None]:
    set_auth(AuthConfig(api_keys=[ApiKey(key=ADMIN, tenant="ops", admin=True), ApiKey(key=USER, tenant="team")]))
    yield
    set_auth(None)


def _admin_answer(key: str | None) -> Any:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = asyncio.run(call(TenantGuard(_echo), "POST", "/v1/adapters", b"{}", headers=headers))
    return r.status if r.status != 200 else r.json()["status"]


def test_admin_key_manages_adapters_other_keys_get_403(keys: None) -> None:
    assert _admin_answer(ADMIN) is None
    assert _admin_answer(USER) == 403
    assert _admin_answer(None) == 401  # no key at all: the guard's 401, before any endpoint


def test_an_open_api_lets_anyone_manage_adapters() -> None:
    set_auth(None)
    assert _admin_answer(None) is None


def test_the_list_shows_file_paths_only_to_an_admin_key(keys: None) -> None:
    """GET /v1/adapters is for every tenant (what it may ask for); where the server keeps the files is
    an admin's business."""
    from xema_ray.lora.pool import AdapterInfo

    class _Remote:
        def __init__(self, value: Any) -> None:
            self.value = value

        async def remote(self) -> Any:
            return self.value

    class _Group:
        list_adapters = _Remote([AdapterInfo(name="style", model="tiny-flux2", rank=4, layers=2, bytes=64, resident=False,
                                             path="/srv/adapters/style.safetensors")])

    class _Admin(AdapterAdmin):
        async def pool_stats(self, timeout_s: float) -> Any:
            return {}

    admin = _Admin({"tiny-flux2": GroupHandle(_Group())})  # type: ignore[arg-type]

    async def _list(scope: dict[str, Any], receive: Any, send: Any) -> None:
        r = await admin.list_adapters(Request(scope))
        await r(scope, receive, send)

    def paths(key: str) -> list[str]:
        r = asyncio.run(call(TenantGuard(_list), "GET", "/v1/adapters", b"", headers={"authorization": f"Bearer {key}"}))
        assert r.status == 200, r.body
        return [a["path"] for a in r.json()["data"]]

    assert paths(ADMIN) == ["/srv/adapters/style.safetensors"] and paths(USER) == [""]
