"""One validation path: the same malformed body gets the same status on all three generation
endpoints (JSON and multipart), in-process through the Router's error handlers; and the API-key
guard (401 JSON without a valid key, the tenant in the scope with one)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi import FastAPI, Request

from tests.serving.api.asgi_client import call, post_json
from xema_ray.serving.api.schemas import ImageRequest, RequestLimits, VideoRequest, set_limits
from xema_ray.serving.api.auth import ApiKey, AuthConfig, TenantGuard, Tenants, set_auth, tenant_of
from xema_ray.serving.api.errors import install_error_handlers
from xema_ray.serving.api.validation import parse_request
from xema_ray.serving.api.videos import VideoCreate

ENDPOINTS = {"/v1/images/generations": ImageRequest, "/v1/videos": VideoCreate, "/v1/videos/sync": VideoRequest}
GOOD = {"/v1/images/generations": {"model": "m", "prompt": "p", "size": "64x64"},
        "/v1/videos": {"model": "m", "prompt": "p", "size": "64x64"},
        "/v1/videos/sync": {"model": "m", "prompt": "p", "size": "64x64", "num_frames": 9}}


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(TenantGuard)
    for path, model in ENDPOINTS.items():
        async def endpoint(request: Request, model=model) -> dict:  # type: ignore[no-untyped-def]
            req = await parse_request(request, model)
            return {"ok": True, "tenant": tenant_of(request), "seed": req.seed}
        app.add_api_route(path, endpoint, methods=["POST"])

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}
    return app


@pytest.fixture
def app():  # type: ignore[no-untyped-def]
    set_limits(RequestLimits())
    set_auth(None)
    yield _app()
    set_auth(None)


def _multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = "xemaboundary"
    parts = []
    for k, v in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode())
    for k, (fname, data) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{fname}"\r\n'
                     f'Content-Type: text/plain\r\n\r\n'.encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


MALFORMED = {
    "nested brackets": (b'{"model": "m", "size": "64x64", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 422, None),
    "5000-digit seed": (b'{"model": "m", "prompt": "p", "size": "64x64", "seed": ' + b"9" * 5000 + b"}", 422, None),
    "not an object": (b"[1, 2]", 422, None),
    "not json": (b"{nope", 422, None),
    "negative seed": (json.dumps({"model": "m", "prompt": "p", "size": "64x64", "seed": -1}).encode(), 422, "seed"),
    "huge seed": (json.dumps({"model": "m", "prompt": "p", "size": "64x64", "seed": 2**64}).encode(), 422, "seed"),
    "unknown option": (json.dumps({"model": "m", "prompt": "p", "size": "64x64", "colour": 1}).encode(), 400, "colour"),
    "prompt not text": (json.dumps({"model": "m", "prompt": ["a"], "size": "64x64"}).encode(), 422, "prompt"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_body_gets_the_same_status_on_every_endpoint(app: FastAPI, case: str) -> None:
    body, status, param = MALFORMED[case]
    for path in ENDPOINTS:
        r = post_json(app, path, body)
        assert r.status == status, (path, r.body[:300])
        err = r.json()["error"]
        assert err.get("param") == param, (path, err)


def test_good_bodies_pass_as_json_and_as_forms(app: FastAPI) -> None:
    for path, good in GOOD.items():
        assert post_json(app, path, {**good, "seed": 7}).json()["seed"] == 7
        body, ctype = _multipart({k: str(v) for k, v in {**good, "seed": 7}.items()}, {})
        r = asyncio.run(call(app, "POST", path, body, headers={"content-type": ctype}))
        assert r.status == 200 and r.json()["seed"] == 7, (path, r.body[:300])


def test_error_raised_if_a_file_is_sent_where_text_is_expected(app: FastAPI) -> None:
    for path, good in GOOD.items():
        fields = {k: str(v) for k, v in good.items() if k != "prompt"}
        body, ctype = _multipart(fields, {"prompt": ("prompt.txt", b"a red fox")})
        r = asyncio.run(call(app, "POST", path, body, headers={"content-type": ctype}))
        assert r.status == 422, (path, r.body[:300])
        assert r.json()["error"]["param"] == "prompt" and "file" in r.json()["error"]["message"]


def test_error_raised_if_a_form_number_is_not_a_number(app: FastAPI) -> None:
    for path, good in GOOD.items():
        body, ctype = _multipart({**{k: str(v) for k, v in good.items()}, "seed": "x" * 5000}, {})
        r = asyncio.run(call(app, "POST", path, body, headers={"content-type": ctype}))
        assert r.status == 422 and r.json()["error"]["param"] == "seed", (path, r.body[:300])


KEY_A, KEY_B = "a" * 32, "b" * 32


def test_error_raised_if_no_or_a_wrong_key_is_sent(app: FastAPI) -> None:
    set_auth(AuthConfig(api_keys=[ApiKey(key=KEY_A, tenant="alice"), KEY_B]))
    path, good = "/v1/videos", GOOD["/v1/videos"]
    for headers in ({}, {"authorization": "Bearer " + "c" * 32}, {"authorization": KEY_A}, {"authorization": "Bearer "}):
        r = post_json(app, path, good, headers=headers)
        assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert post_json(app, path, good, headers={"authorization": f"Bearer {KEY_A}"}).json()["tenant"] == "alice"
    tenant_b = post_json(app, path, good, headers={"authorization": f"bearer {KEY_B}"}).json()["tenant"]
    assert tenant_b.startswith("t_") and KEY_B not in tenant_b  # a bare key's tenant is a hash, not the key
    assert asyncio.run(call(app, "GET", "/healthz")).status == 200  # probes need no key


def test_without_keys_the_api_is_open(app: FastAPI) -> None:
    assert post_json(app, "/v1/videos", GOOD["/v1/videos"]).json()["tenant"] is None


def test_keys_file_lines(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# team keys\n{KEY_A} alice\n\n{KEY_B}  # ci\n")
    tenants = Tenants(AuthConfig(keys_file=f))
    assert tenants.tenant(f"Bearer {KEY_A}") == "alice" and tenants.tenant(f"Bearer {KEY_B}").startswith("t_")
    with pytest.raises(ValueError, match="does not exist"):
        AuthConfig(keys_file=tmp_path / "missing")
    with pytest.raises(ValueError, match="at least 16"):
        AuthConfig(api_keys=["short"])
