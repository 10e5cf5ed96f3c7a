"""The adapter admin API's key check: open API, admin key, other key (docs/tenancy.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.requests import Request

from tests.serving.api.asgi_client import call
from xema_ray.serving.api.adapters import AdapterEndpoints
from xema_ray.serving.api.auth import ApiKey, AuthConfig, TenantGuard, set_auth

ADMIN, USER = "sk-admin-0123456789abcdef", "sk-user-0123456789abcdef"


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """What the endpoints see: the admin API's answer for this request (None: allowed)."""
    denied = AdapterEndpoints()._forbidden(Request(scope))
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
