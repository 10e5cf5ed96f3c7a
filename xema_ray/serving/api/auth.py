"""Tenancy: optional API keys, each naming a tenant who owns the video jobs made with it.

``auth:`` in the serve config lists keys (``api_keys``) or names a file of them (``keys_file``,
one key per line, ``#`` comments; or ``KEY TENANT`` per line). Without any key the API is open,
as before, and every job belongs to no one (bind to loopback: ``deployments/xema.yaml`` does).
With keys:

- every ``/v1/...`` request needs ``Authorization: Bearer <key>`` (what the ``openai`` client
  sends for its ``api_key``); without a valid one it gets a JSON 401;
- a video job is listed, retrieved, downloaded and deleted only with a key of its tenant; any
  other tenant gets the 404 of a job that does not exist;
- a tenant holds at most ``max_jobs_in_flight`` queued or running jobs (a create beyond it: 429);
- the console's operator data (``/v1/console/...``: plans, traces, queues of every tenant) needs a
  key marked ``admin: true``; any other valid key gets a JSON 403.

Exempt from the key: ``/healthz``, the OpenAPI document and docs, and image files
(``/v1/images/files/img_<uuid4>``): an image URL is a capability (128 random bits), meant to be
fetched by whatever the client hands it to, like a signed URL.

A tenant is named by its ``tenant`` field or, for a bare key, by a hash of the key (the key
itself is never stored with a job). ``TenantGuard`` is the ASGI middleware of the Router app;
endpoints read the tenant with ``tenant_of(request)``.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request

from xema_ray.serving.api.middleware import ASGIApp, Receive, Scope, Send, _error_body

#: where the guard leaves the tenant in the ASGI scope
SCOPE_KEY = "xema.tenant"
#: paths only an admin key may read when keys are configured
ADMIN_PATHS = ("/v1/console/",)
#: where the guard leaves whether the key is an admin key (the adapter admin API: POST, DELETE /v1/adapters)
SCOPE_ADMIN = "xema.admin"
_OPEN_PATHS = ("/healthz", "/openapi.json", "/docs", "/redoc", "/v1/images/files/")


class ApiKey(BaseModel):
    """One key and the tenant it belongs to (several keys may share a tenant)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(min_length=16, max_length=256, description="the bearer token; at least 16 characters")
    tenant: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                               description="tenant name; None: derived from the key (its SHA-256, 16 hex digits)")
    admin: bool = Field(default=False, description="may read the console's operator data (/v1/console/...) and "
                                                   "manage LoRA adapters (POST, DELETE /v1/adapters)")

    @property
    def tenant_id(self) -> str:
        return self.tenant or "t_" + hashlib.sha256(self.key.encode()).hexdigest()[:16]


class AuthConfig(BaseModel):
    """``auth:`` of the serve config. No keys at all: the API is open (today's behaviour)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_keys: list[ApiKey | str] = Field(default_factory=list, description="keys (strings or {key, tenant})")
    keys_file: Path | None = Field(default=None, description="file of keys: 'KEY', 'KEY TENANT' or 'KEY TENANT admin' "
                                                              "per line")
    max_jobs_in_flight: int = Field(default=16, ge=1, description="queued + running video jobs per tenant (429 beyond)")

    @model_validator(mode="after")
    def _check(self) -> AuthConfig:
        keys = self.keys()
        if len({k.key for k in keys}) != len(keys):
            raise ValueError("auth: a key is listed twice")
        return self

    def keys(self) -> list[ApiKey]:
        """Every configured key (the file's read now: a missing file is a config error)."""
        out = [k if isinstance(k, ApiKey) else ApiKey(key=k) for k in self.api_keys]
        if self.keys_file is not None:
            path = self.keys_file.expanduser()
            if not path.is_file():
                raise ValueError(f"auth.keys_file {str(path)!r} does not exist")
            for n, line in enumerate(path.read_text().splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                parts = line.split()
                if len(parts) > 3 or (len(parts) == 3 and parts[2] != "admin"):
                    raise ValueError(f"{path}:{n}: expected 'KEY', 'KEY TENANT' or 'KEY TENANT admin', got {line!r}")
                out.append(ApiKey(key=parts[0], tenant=parts[1] if len(parts) >= 2 else None, admin=len(parts) == 3))
        return out

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys) or self.keys_file is not None


class Tenants:
    """Key -> tenant lookup, in constant time per key (``hmac.compare_digest`` over digests)."""

    def __init__(self, cfg: AuthConfig) -> None:
        self.cfg = cfg
        keys = cfg.keys()
        self._by_digest = {hashlib.sha256(k.key.encode()).digest(): k.tenant_id for k in keys}
        self._admins = {hashlib.sha256(k.key.encode()).digest() for k in keys if k.admin}
        self.enabled = bool(self._by_digest) or cfg.enabled

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization`` header value, or None (no or unknown key)."""
        found = self.lookup(authorization)
        return found[0] if found is not None else None

    def lookup(self, authorization: str | None) -> tuple[str, bool] | None:
        """(tenant, admin) of an ``Authorization`` header value, or None (no or unknown key)."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return tenant, known in self._admins
        return None


_tenants: Tenants | None = None


def set_auth(cfg: AuthConfig | None) -> None:
    """Install the deployment's keys in this process (the Router does, at start-up)."""
    global _tenants
    _tenants = Tenants(cfg) if cfg is not None and cfg.enabled else None


def auth_enabled() -> bool:
    return _tenants is not None


def key_required(path: str) -> bool:
    """Whether a request for ``path`` needs a key when keys are configured (the OpenAPI document
    lists the 401 on these)."""
    return path.startswith("/v1/") and not path.startswith(_OPEN_PATHS)


def admin_of(request: Request) -> bool:
    """Whether the request may use the adapter admin API: any request while the API is open, else
    one with an admin key (``auth.api_keys[].admin``)."""
    return _tenants is None or bool(request.scope.get(SCOPE_ADMIN))


def tenant_of(request: Request) -> str | None:
    """The request's tenant (None: the API is open)."""
    return request.scope.get(SCOPE_KEY)


class TenantGuard:
    """401 for a ``/v1/`` request without a valid key when keys are configured; otherwise puts the
    tenant in the scope and passes the request on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenants = _tenants
        if scope["type"] != "http" or tenants is None:
            await self.app(scope, receive, send)
            return
        if not key_required(str(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization")
        found = tenants.lookup(header.decode("latin-1") if header is not None else None)
        if found is None:
            why = "no API key given" if header is None else "the API key is not valid"
            body = _error_body(f"{why}: send 'Authorization: Bearer <key>' with a key this deployment lists "
                               "(auth.api_keys)", "authentication_error", "invalid_api_key")
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"www-authenticate", b'Bearer realm="xema-ray"')]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        tenant, admin = found
        if not admin and str(scope.get("path", "")).startswith(ADMIN_PATHS):
            body = _error_body("this API key is not an admin key: the console's operator data needs one "
                               "(auth.api_keys: {key, tenant, admin: true})", "permission_error", "admin_key_required")
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 403, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        scope[SCOPE_KEY] = tenant
        scope[SCOPE_ADMIN] = admin
        await self.app(scope, receive, send)
