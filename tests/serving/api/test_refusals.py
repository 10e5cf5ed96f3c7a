"""``xema_requests_refused{reason}``: every refusal counted once, by a reason from a fixed set,
in-process (no Ray cluster): the Router's middlewares and error handlers on a FastAPI app with the
real request models, and the HTTP proxy's middleware on stand-in proxies."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tests.serving.api.asgi_client import call, post_json
from xema_ray.runtime.out_of_memory import DeviceOutOfMemory
from xema_ray.serving.api import refusals
from xema_ray.serving.api.auth import AuthConfig, TenantGuard, set_auth
from xema_ray.serving.api.errors import exception_response, install_error_handlers
from xema_ray.serving.api.middleware import ProxyErrorsAsJson, RequestGuard
from xema_ray.serving.api.refusals import REASONS, RefusalMeter, refusal_reason
from xema_ray.serving.api.schemas import ImageRequest, RequestLimits, UnsupportedTemplate, set_limits
from xema_ray.serving.messages import QueueFull

IMAGES = "/v1/images/generations"
KEY = "k" * 20
GOOD = {"model": "tiny-flux2", "prompt": "a red fox", "size": "64x64"}


class _Counted:
    """Stands in for the Ray counter: what ``inc`` was called with."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        assert value == 1.0 and tags is not None and set(tags) == {"reason"}
        self.reasons.append(tags["reason"])


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Counted]:
    c = _Counted()
    monkeypatch.setattr(refusals, "_counter", c)
    yield c


@pytest.fixture
def app() -> Iterator[FastAPI]:
    """The Router's middleware stack (refusals outermost, keys, limits) over endpoints that raise
    what a model group raises."""
    set_limits(RequestLimits(max_body_bytes=1024))
    set_auth(AuthConfig(api_keys=[KEY]))
    a = FastAPI()
    install_error_handlers(a)
    a.add_middleware(RequestGuard)
    a.add_middleware(TenantGuard)
    a.add_middleware(RefusalMeter)

    @a.post(IMAGES, response_model=None)
    async def images(req: ImageRequest) -> dict | JSONResponse:
        try:  # as the Router does (``Router._guarded``): a group's error becomes its HTTP answer
            if req.prompt == "full":
                raise QueueFull("tiny-flux2/64x64x1: 3 requests queued (limit 3)", retry_after_s=1.0)
            if req.prompt == "oom":
                raise DeviceOutOfMemory("out of memory", "tiny-flux2/64x64x1", 10**9, 10**6, "cuda:0")
            if req.size != "64x64":
                raise UnsupportedTemplate(f"{req.size} is not served", ["tiny-flux2/64x64x1"], "size")
        except Exception as e:
            mapped = exception_response(e)
            assert mapped is not None
            return mapped
        return {"ok": True}

    yield a
    set_auth(None)
    set_limits(RequestLimits())


AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(("body", "headers", "status", "reason"), [
    (GOOD, {}, 401, "unauthorized"),
    (GOOD, {"authorization": "Bearer not-a-key"}, 401, "unauthorized"),
    ({**GOOD, "prompt": "x" * 2000}, AUTH, 413, "body_too_large"),
    ({**GOOD, "seed": -1}, AUTH, 422, "bad_request_field"),
    (b"not json", AUTH, 422, "bad_request_field"),
    ({**GOOD, "size": "96x96"}, AUTH, 400, "unknown_template"),
    ({**GOOD, "prompt": "full"}, AUTH, 503, "queue_full"),
    ({**GOOD, "prompt": "oom"}, AUTH, 503, "out_of_memory"),
])
def test_each_refusal_counts_once_with_its_reason(app: FastAPI, counted: _Counted, body: object,
                                                   headers: dict[str, str], status: int, reason: str) -> None:
    r = post_json(app, IMAGES, body, headers=headers)
    assert r.status == status, r.body[:300]
    assert counted.reasons == [reason]


def test_a_served_request_and_an_unknown_path_are_told_apart(app: FastAPI, counted: _Counted) -> None:
    assert post_json(app, IMAGES, GOOD, headers=AUTH).status == 200
    assert counted.reasons == []
    assert asyncio.run(call(app, "GET", "/nowhere")).status == 404
    assert counted.reasons == ["not_found"]


@pytest.mark.parametrize(("raised", "reason"), [
    (QueueFull("full", retry_after_s=1.0), "queue_full"), (RuntimeError("a bug"), "internal_error")])
def test_an_exception_left_to_the_outermost_handler_is_counted_too(counted: _Counted, raised: Exception,
                                                                   reason: str) -> None:
    async def raising(scope, receive, send):  # type: ignore[no-untyped-def]
        raise raised

    with pytest.raises(type(raised)):  # passed on to Starlette's outermost handler, which answers it
        asyncio.run(call(RefusalMeter(raising), "POST", IMAGES, b"{}"))
    assert counted.reasons == [reason]


async def _backpressure(scope, receive, send):  # type: ignore[no-untyped-def]
    await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"Request dropped due to backpressure (max_queued_requests=1)."})


async def _router_refused(scope, receive, send):  # type: ignore[no-untyped-def]
    body = b'{"error": {"message": "queue full", "type": "service_unavailable", "code": "queue_full"}}'
    await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def _gone(scope, receive, send):  # type: ignore[no-untyped-def]
    return None


@pytest.mark.parametrize(("inner", "reasons"), [
    (_backpressure, ["busy"]),  # Serve's own queue, before the Router
    (_gone, ["unavailable"]),  # the Router replica died: the proxy answers
    (_router_refused, []),  # the Router's own answer: counted there, not again here
])
def test_the_proxy_counts_only_the_answers_it_makes(counted: _Counted, inner, reasons: list[str]) -> None:  # type: ignore[no-untyped-def]
    r = asyncio.run(call(ProxyErrorsAsJson(inner), "POST", IMAGES, b"{}"))
    assert r.status == 503 and counted.reasons == reasons


def test_reasons_are_a_fixed_set_whatever_the_answer() -> None:
    seen = {refusal_reason(s, c) for s in range(400, 600) for c in (None, "made-up", *refusals.CODE_REASONS)}
    assert seen <= set(REASONS)
    with pytest.raises(ValueError, match="unknown refusal reason"):
        refusals.count_refusal("client-chosen")
