"""ASGI middlewares: request limits in the Router, JSON errors in Ray Serve's HTTP proxy.

``RequestGuard`` wraps the Router's FastAPI app: it refuses a body over ``max_body_bytes`` (413)
before anything parses it, and a generation request beyond ``max_in_flight`` requests held by
this Router replica (503 with Retry-After) — so that overload is answered by the app, in JSON,
before Ray Serve's own backpressure (plain text) would fire.

``ProxyErrorsAsJson`` wraps Ray Serve's HTTP proxy (it runs in the proxy process, installed by
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=xema_ray.serving.api.middleware:proxy_middlewares``): the
proxy's own answers — backpressure 503, "no replica" 503, and the bare 500 it gives when the
Router replica dies mid-request — become the API's JSON error shape, 503s with Retry-After. It
also stamps each answer with ``X-Xema-Proxy-Seconds``: seconds from the proxy taking the request
to its response headers, the server's own response time, without the client's side of it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.middleware import Middleware

from xema_ray.serving.api.refusals import count_refusal, refusal_reason
from xema_ray.serving.api.schemas import current_limits

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: the environment variable Ray Serve reads, in the proxy process, for proxy middlewares
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "xema_ray.serving.api.middleware:proxy_middlewares"
_GENERATION_METHODS = ("POST",)
_DEFAULT_RETRY_AFTER_S = 5
#: the response header with the server's response time (seconds, from the proxy's view)
PROXY_SECONDS_HEADER = b"x-xema-proxy-seconds"


def _error_body(message: str, type_: str, code: str, param: str | None = None, limit: str | None = None) -> bytes:
    detail: dict[str, str] = {"message": message, "type": type_, "code": code}
    if param is not None:
        detail["param"] = param
    if limit is not None:
        detail["limit"] = limit
    return json.dumps({"error": detail}).encode()


async def _send_json(send: Send, status: int, body: bytes, retry_after_s: int | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestGuard:
    """Body-size and in-flight limits of one Router replica (``api.RequestLimits``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _GENERATION_METHODS:
            await self.app(scope, receive, send)
            return
        limits = current_limits()
        too_big = _error_body(f"the request body exceeds {limits.max_body_bytes} bytes (limits.max_body_bytes)",
                              "invalid_request_error", "body_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            await _send_json(send, 413, too_big)
            return
        # read the body here (the proxy has it in memory already) so that a body without a
        # Content-Length is held to the same limit, then hand it on unchanged
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limits.max_body_bytes:
                await _send_json(send, 413, too_big)
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if self.in_flight >= limits.max_in_flight:
            await _send_json(send, 503, _error_body(
                f"server busy: {self.in_flight} generation requests in flight on this router replica "
                f"(limits.max_in_flight {limits.max_in_flight}); retry later", "service_unavailable", "busy",
                limit="limits.max_in_flight"),
                retry_after_s=limits.busy_retry_after_s)
            return
        self.in_flight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1


class ProxyErrorsAsJson:
    """Rewrites Ray Serve proxy's non-JSON error responses into the API's JSON shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        held: Message | None = None  # a non-JSON error's start message, held until its body is in
        body = bytearray()
        t0 = time.perf_counter()

        async def guarded_send(msg: Message) -> None:
            nonlocal started, held
            if msg["type"] == "http.response.start":
                headers = {k.lower(): v for k, v in msg.get("headers", [])}
                ctype = headers.get(b"content-type", b"").split(b";")[0].strip()
                if msg["status"] >= 400 and ctype != b"application/json":
                    held = msg
                    return
                started = True
                stamp = (PROXY_SECONDS_HEADER, f"{time.perf_counter() - t0:.4f}".encode())
                await send({**msg, "headers": [*msg.get("headers", []), stamp]})
                return
            if held is not None and msg["type"] == "http.response.body":
                body.extend(msg.get("body", b""))
                if not msg.get("more_body", False):
                    start, held = held, None
                    started = True
                    await self._rewrite(send, start, bytes(body))
                return
            await send(msg)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception:
            if started:
                raise
            await self._replica_died(send)
            return
        if not started:
            # the proxy gave up without answering (its replica died): uvicorn would send a bare 500
            await self._replica_died(send)

    @staticmethod
    async def _replica_died(send: Send) -> None:
        count_refusal("unavailable")  # the proxy's own answer: the Router never saw the request end
        await _send_json(send, 503, _error_body(
            "the serving replica handling this request failed; it is being replaced, retry later",
            "service_unavailable", "replica_died"), retry_after_s=_DEFAULT_RETRY_AFTER_S)

    @staticmethod
    async def _rewrite(send: Send, start: Message, body: bytes) -> None:
        status = int(start["status"])
        headers = {k.lower(): v for k, v in start.get("headers", [])}
        text = body.decode(errors="replace").strip()[:500] or "error"
        if status >= 500:
            retry = headers.get(b"retry-after", b"").decode()
            retry_s = int(retry) if retry.isdigit() else _DEFAULT_RETRY_AFTER_S
            busy = "backpressure" in text.lower()
            count_refusal("busy" if busy else "unavailable")
            await _send_json(send, 503, _error_body(f"{text}; retry later", "service_unavailable",
                                                    "busy" if busy else "replica_unavailable",
                                                    limit="max_queued_requests" if busy else None),
                             retry_after_s=retry_s)
            return
        type_ = "not_found_error" if status in (404, 405) else "invalid_request_error"
        count_refusal(refusal_reason(status, None))
        await _send_json(send, status, _error_body(text, type_, f"http_{status}"))


def proxy_middlewares() -> list[Middleware]:
    """Ray Serve's proxy callback: the middlewares of the HTTP proxy (and its read timeouts,
    ``slow_clients``)."""
    from xema_ray.serving.api.slow_clients import BodyTimeout, install_header_timeout

    install_header_timeout()
    return [Middleware(ProxyErrorsAsJson), Middleware(BodyTimeout)]
