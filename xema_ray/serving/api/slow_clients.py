"""Read timeouts at the HTTP front door (Ray Serve's proxy): a connection that does not finish
its request headers within ``XEMA_HEADER_TIMEOUT_S`` (default 10 s) is answered 408 and closed,
and a request body that stalls for ``XEMA_BODY_TIMEOUT_S`` (default 30 s) between two chunks is
answered with a JSON 408.

Why here and this way: Ray Serve 2.60 starts the proxy's uvicorn with only
``timeout_keep_alive`` configurable (``http_options.keep_alive_timeout_s``, idle connections
*between* requests), and uvicorn 0.54 has no header-read timeout at all — a client that sends
half a request line and then nothing holds its connection for ever. The header timeout has to
live in the HTTP protocol object (an ASGI middleware only sees a request once its headers are
complete), so ``install_header_timeout`` registers subclasses of uvicorn's two protocol
classes under uvicorn's own protocol names (``uvicorn.config.HTTP_PROTOCOLS``, the table its
``Config.load`` reads) in the proxy process before the proxy's server starts. The body timeout
is an ordinary ASGI middleware (``BodyTimeout``). Both are installed by the proxy callback
(``middleware.proxy_middlewares``), so they apply wherever the app's Ray environment is in
effect (``ray_env``). Set either variable to ``0`` to turn that timeout off.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from xema_ray.serving.api.middleware import ASGIApp, Message, Receive, Scope, Send, _error_body, _send_json

HEADER_TIMEOUT_ENV = "XEMA_HEADER_TIMEOUT_S"
BODY_TIMEOUT_ENV = "XEMA_BODY_TIMEOUT_S"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "")
    try:
        return max(0.0, float(raw)) if raw else default
    except ValueError:
        raise ValueError(f"{env} must be a number of seconds, got {raw!r}") from None


def header_timeout_s() -> float:
    return _seconds(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S)


def body_timeout_s() -> float:
    return _seconds(BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT_S)


class _HeaderTimeout:
    """Mixed into a uvicorn HTTP protocol: from the connection's start, and again after every
    response, the next request's headers must be complete within the timeout."""

    _header_timer: asyncio.TimerHandle | None = None

    def _arm_header_timer(self) -> None:
        timeout = header_timeout_s()
        if timeout <= 0:
            return
        if self._header_timer is not None:
            self._header_timer.cancel()
        proto: Any = self
        self._header_timer = proto.loop.call_later(timeout, self._header_timed_out, proto.cycle)

    def _header_timed_out(self, cycle_then: Any) -> None:
        proto: Any = self
        if proto.cycle is cycle_then and not proto.transport.is_closing():  # no new request began
            proto.transport.write(_TIMEOUT_RESPONSE)
            proto.transport.close()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]


def _protocol_classes() -> dict[str, type]:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    out: dict[str, type] = {"h11": type("H11HeaderTimeoutProtocol", (_HeaderTimeout, H11Protocol), {})}
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools absent: uvicorn's "auto" is h11
        out["auto"] = out["h11"]
    else:
        out["httptools"] = type("HttpToolsHeaderTimeoutProtocol", (_HeaderTimeout, HttpToolsProtocol), {})
        out["auto"] = out["httptools"]
    return out


H11HeaderTimeoutProtocol: type | None = None
HttpToolsHeaderTimeoutProtocol: type | None = None
AutoHeaderTimeoutProtocol: type | None = None


def install_header_timeout() -> None:
    """Make uvicorn servers started from now on in this process use the header timeout."""
    global H11HeaderTimeoutProtocol, HttpToolsHeaderTimeoutProtocol, AutoHeaderTimeoutProtocol
    from uvicorn import config

    classes = _protocol_classes()
    H11HeaderTimeoutProtocol = classes["h11"]
    HttpToolsHeaderTimeoutProtocol = classes.get("httptools")
    AutoHeaderTimeoutProtocol = classes["auto"]
    config.HTTP_PROTOCOLS["auto"] = f"{__name__}:AutoHeaderTimeoutProtocol"
    config.HTTP_PROTOCOLS["h11"] = f"{__name__}:H11HeaderTimeoutProtocol"
    if HttpToolsHeaderTimeoutProtocol is not None:
        config.HTTP_PROTOCOLS["httptools"] = f"{__name__}:HttpToolsHeaderTimeoutProtocol"


class BodyTimeout:
    """A request body that stalls longer than ``XEMA_BODY_TIMEOUT_S`` between chunks: JSON 408.

    The body is read here, under the timeout, and handed on whole (the proxy holds a request's
    body in memory to forward it anyway)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = body_timeout_s()
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH") or timeout <= 0:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        while True:
            try:
                msg = await asyncio.wait_for(receive(), timeout=timeout)
            except TimeoutError:
                await _send_json(send, 408, _error_body(
                    f"the request body stalled for {timeout:g} s ({BODY_TIMEOUT_ENV}); send it whole",
                    "invalid_request_error", "body_timeout"))
                return
            messages.append(msg)
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                break

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)
