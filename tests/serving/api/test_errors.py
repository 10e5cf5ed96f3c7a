"""The bad-input matrix and the JSON error shape, in-process (no Ray cluster): the Router's
error handlers and request guard on a FastAPI app taking the real request models, the proxy
middleware on stand-in proxies, and the exception -> status mapping."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
from fastapi import FastAPI
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError

from tests.serving.api.asgi_client import call, post_json
from xema_ray.serving.api.schemas import ImageRequest, RequestLimits, UnsupportedTemplate, VideoRequest, set_limits
from xema_ray.serving.api.errors import exception_response, install_error_handlers
from xema_ray.serving.api.middleware import ProxyErrorsAsJson, RequestGuard
from xema_ray.serving.messages import GroupRequest, GroupUnavailable, InvalidRequest, QueueFull
from xema_ray.serving.api.openapi import build_openapi
from xema_ray.templates import RequestTemplate

GOOD = {"model": "tiny-flux2", "prompt": "a red fox", "size": "64x64"}
IMAGES = "/v1/images/generations"


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestGuard)

    @app.post(IMAGES)
    async def images(req: ImageRequest) -> dict:
        await asyncio.sleep(0.2 if req.prompt == "slow" else 0)
        return {"ok": True}

    @app.post("/v1/videos")
    async def videos(req: VideoRequest) -> dict:
        return {"ok": True}

    return app


@pytest.fixture
def app():  # type: ignore[no-untyped-def]
    set_limits(RequestLimits())
    yield _app()
    set_limits(RequestLimits())


def _assert_shape(r, status: int, param: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert r.status == status, r.body[:500]
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    if param is not None:
        assert err.get("param") == param, err
    return err


def test_a_good_request_passes(app: FastAPI) -> None:
    assert post_json(app, IMAGES, GOOD).status == 200


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_error_raised_if_guidance_is_not_finite(app: FastAPI, value: str) -> None:
    body = json.dumps(GOOD)[:-1] + f', "guidance_scale": {value}}}'
    err = _assert_shape(post_json(app, IMAGES, body.encode()), 422, "guidance_scale")
    assert "finite" in err["message"]
    body = json.dumps({**GOOD, "num_frames": 9})[:-1] + f', "guidance_scale": {value}}}'
    _assert_shape(post_json(app, "/v1/videos", body.encode()), 422, "guidance_scale")


def test_error_raised_if_derived_seeds_could_overflow(app: FastAPI) -> None:
    """Image i runs with seed + i: an image request's seed is at most 2^63 - 10 (the last of the
    most images a request takes is still a seed), one bound whatever n, as the document says."""
    err = _assert_shape(post_json(app, IMAGES, {**GOOD, "seed": 2**63 - 1, "n": 2}), 422, "seed")
    assert "9223372036854775798" in err["message"]
    _assert_shape(post_json(app, IMAGES, {**GOOD, "seed": 2**63 - 9}), 422, "seed")
    assert post_json(app, IMAGES, {**GOOD, "seed": 2**63 - 10, "n": 2}).status == 200
    _assert_shape(post_json(app, IMAGES, {**GOOD, "seed": 2**63}), 422, "seed")
    seed = ImageRequest.model_json_schema()["properties"]["seed"]
    assert [b.get("maximum") for b in seed["anyOf"]] == [2**63 - 10, None]  # what the document says


def test_error_quotes_only_a_prefix_of_a_huge_prompt(app: FastAPI) -> None:
    r = post_json(app, IMAGES, {**GOOD, "prompt": "x" * 1_000_000})
    err = _assert_shape(r, 422, "prompt")
    assert len(r.body) < 1000 and "1000000 characters" in err["message"] and "at most 10000" in err["message"]


def test_error_raised_if_a_free_text_field_is_too_long(app: FastAPI) -> None:
    err = _assert_shape(post_json(app, IMAGES, {**GOOD, "user": "u" * 300}), 422, "user")
    assert "at most 256" in err["message"]


def test_error_raised_if_the_body_is_too_large(app: FastAPI) -> None:
    big = {**GOOD, "user": "u" * (16 * 2**20)}  # the 16 MB `user` field of the report
    _assert_shape(post_json(app, IMAGES, big), 413)
    # without a Content-Length (chunked), the body is held to the same limit
    body = json.dumps(big).encode()
    r = asyncio.run(call(app, "POST", IMAGES, body, chunks=64, content_length=False))
    _assert_shape(r, 413)


def test_limits_are_configurable(app: FastAPI) -> None:
    set_limits(RequestLimits(max_prompt_chars=5, max_body_bytes=2048))
    _assert_shape(post_json(app, IMAGES, {**GOOD, "prompt": "abcdef"}), 422, "prompt")
    assert post_json(app, IMAGES, {**GOOD, "prompt": "abcde"}).status == 200
    _assert_shape(post_json(app, IMAGES, {**GOOD, "prompt": "a" * 3000}), 413)


@pytest.mark.parametrize(("ctype", "body"), [
    ("text/plain", json.dumps(GOOD).encode()),
    ("application/x-www-form-urlencoded", b"model=tiny-flux2&prompt=x&size=64x64"),
])
def test_error_raised_if_the_body_is_not_json(app: FastAPI, ctype: str, body: bytes) -> None:
    err = _assert_shape(post_json(app, IMAGES, body, headers={"content-type": ctype}), 415)
    assert "application/json" in err["message"] and ctype in err["message"]


def test_error_raised_if_the_json_is_malformed(app: FastAPI) -> None:
    err = _assert_shape(post_json(app, IMAGES, b'{"model": '), 422)
    assert "not valid JSON" in err["message"]


def test_unknown_path_is_json(app: FastAPI) -> None:
    _assert_shape(asyncio.run(call(app, "GET", "/nope")), 404)


def test_overload_gets_json_503_with_retry_after(app: FastAPI) -> None:
    set_limits(RequestLimits(max_in_flight=2, busy_retry_after_s=3))

    async def burst() -> list:
        body = json.dumps({**GOOD, "prompt": "slow"}).encode()
        return await asyncio.gather(*(call(app, "POST", IMAGES, body) for _ in range(5)))

    rs = asyncio.run(burst())
    assert sorted(r.status for r in rs) == [200, 200, 503, 503, 503]
    for r in rs:
        if r.status == 503:
            err = _assert_shape(r, 503)
            assert err["code"] == "busy" and r.headers["retry-after"] == "3"
            assert err["limit"] == "limits.max_in_flight"  # overload names the limit that was hit


# ---------------------------------------------------------------------------- per-request checks
def _request(seed: int, guidance_scale: float | None) -> GroupRequest:
    return GroupRequest(template="tiny-flux2-64x64", request_id="r1", prompt="x", seed=seed, guidance_scale=guidance_scale,
                        steps=2)


def test_error_raised_if_a_request_cannot_join_a_batch() -> None:
    with pytest.raises(InvalidRequest) as e:
        _request(2**63, None).validated()
    assert e.value.param == "seed"
    with pytest.raises(InvalidRequest) as e:
        _request(1, float("nan")).validated()
    assert e.value.param == "guidance_scale"
    assert _request(2**63 - 1, 3.5).validated().seed == 2**63 - 1


def test_the_group_request_crosses_the_replica_boundary() -> None:
    req = _request(7, 3.5)
    assert pickle.loads(pickle.dumps(req)) == req  # Serve pickles a handle call's arguments


# ---------------------------------------------------------------------------- exceptions -> status
@pytest.mark.parametrize(("exc", "status", "code", "limit"), [
    (QueueFull("t: 3 queued", retry_after_s=2.2), 503, "queue_full", "models[].max_queue"),
    (GroupUnavailable("down"), 503, "group_unavailable", None),
    (ActorDiedError(), 503, "replica_died", None),
    (RayActorError(), 503, "replica_died", None),
    (BackPressureError(num_queued_requests=5, max_queued_requests=5), 503, "busy", "max_ongoing_requests"),
    (UnsupportedTemplate("no", ["a"], "size"), 400, "unsupported_template", None),
    (InvalidRequest("seed: too big", "seed"), 422, "invalid_value", None),
])
def test_exceptions_map_to_json_statuses(exc: Exception, status: int, code: str, limit: str | None) -> None:
    r = exception_response(exc)
    assert r is not None and r.status_code == status
    err = json.loads(r.body)["error"]
    assert err["code"] == code
    assert err.get("limit") == limit  # only overload names an admission limit
    if status == 503:
        assert int(r.headers["retry-after"]) >= 1


def test_a_replicas_wrapped_error_maps_like_its_cause() -> None:
    wrapped = RayTaskError("generate", "traceback", QueueFull("full", retry_after_s=4.0))
    r = exception_response(wrapped)
    assert r is not None and r.status_code == 503 and r.headers["retry-after"] == "4"
    assert exception_response(ValueError("a bug")) is None


# ---------------------------------------------------------------------------- the proxy middleware
def _plain(status: int, text: bytes, headers: list | None = None):  # type: ignore[no-untyped-def]
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"), *(headers or [])]})
        await send({"type": "http.response.body", "body": text})
    return app


async def _dies(scope, receive, send):  # type: ignore[no-untyped-def]
    raise RayActorError()


async def _silent(scope, receive, send):  # type: ignore[no-untyped-def]
    return None


@pytest.mark.parametrize(("inner", "status", "retry"), [
    (_plain(503, b"Request dropped due to backpressure (num_queued_requests=1, max_queued_requests=1).",
            [(b"retry-after", b"2")]), 503, "2"),
    (_plain(503, b"Deployment unavailable"), 503, "5"),
    (_plain(500, b"Internal Server Error"), 503, "5"),
    (_dies, 503, "5"),
    (_silent, 503, "5"),
    (_plain(408, b"Request timed out after 600s."), 408, None),
])
def test_proxy_errors_become_json(inner, status: int, retry: str | None) -> None:  # type: ignore[no-untyped-def]
    r = asyncio.run(call(ProxyErrorsAsJson(inner), "POST", IMAGES, b"{}"))
    err = _assert_shape(r, status)
    assert r.headers.get("retry-after") == retry
    assert err.get("limit") == ("max_queued_requests" if "backpressure" in err["message"] else None)


def test_proxy_passes_json_and_success_unchanged(app: FastAPI) -> None:
    wrapped = ProxyErrorsAsJson(app)
    assert post_json(wrapped, IMAGES, GOOD).json() == {"ok": True}
    assert _assert_shape(post_json(wrapped, IMAGES, {**GOOD, "seed": -1}), 422, "seed")


def test_proxy_stamps_its_response_time() -> None:
    async def slow(scope, receive, send):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.05)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    r = asyncio.run(call(ProxyErrorsAsJson(slow), "POST", IMAGES, b"{}"))
    assert r.status == 200 and 0.05 <= float(r.headers["x-xema-proxy-seconds"]) < 5


# ---------------------------------------------------------------------------- OpenAPI
def test_openapi_lists_statuses_models_and_sizes(app: FastAPI) -> None:
    served = {t.shape_key: t for t in (RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2),
                                       RequestTemplate(model="tiny-flux2", width=128, height=96, steps=2),
                                       RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2))}
    doc = build_openapi(app, served, RequestLimits(max_prompt_chars=500))
    op = doc["paths"][IMAGES]["post"]
    assert {"200", "400", "413", "415", "422", "500", "503"} <= set(op["responses"])
    assert "Retry-After" in op["responses"]["503"]["headers"]
    props = doc["components"]["schemas"]["ImageRequest"]["properties"]
    assert props["model"]["enum"] == ["tiny-flux2"] and props["size"]["enum"] == ["128x96", "64x64"]
    assert props["prompt"]["maxLength"] == 500
    video = doc["components"]["schemas"]["VideoRequest"]["properties"]
    assert video["model"]["enum"] == ["tiny-cogvideox"] and video["num_frames"]["enum"] == [9]


def test_openapi_lists_the_auth_rate_limit_and_timeout_statuses() -> None:
    from xema_ray.serving.api.router import app as router_app

    served = {t.shape_key: t for t in (RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2),
                                       RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2))}
    doc = build_openapi(router_app, served, RequestLimits())
    ops = {(m, p): op for p, item in doc["paths"].items() for m, op in item.items()}
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for (method, path), op in ops.items():
        responses = op["responses"]
        assert "408" in responses, (method, path)  # header/body timeouts, the proxy's request timeout
        needs_key = path.startswith("/v1/") and not path.startswith("/v1/images/files/")
        assert ("401" in responses) == needs_key, (method, path)  # what TenantGuard guards
        if needs_key:
            assert responses["401"]["content"]["application/json"]["schema"] == error_ref
    create = ops[("post", "/v1/videos")]["responses"]["429"]  # a tenant's jobs in flight at its limit
    assert create["content"]["application/json"]["schema"] == error_ref and "Retry-After" in create["headers"]
    assert [k for k, op in ops.items() if "429" in op["responses"]] == [("post", "/v1/videos")]
