"""Read timeouts at the front door, on a real uvicorn server in this process (the protocol
classes and the middleware Ray Serve's proxy gets from ``middleware.proxy_middlewares``): a
connection that never finishes its headers is closed after the header timeout, one that sends
its headers in time is served, and a stalled body gets a JSON 408."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from xema_ray.net import free_port
from xema_ray.serving.api.slow_clients import BODY_TIMEOUT_ENV, HEADER_TIMEOUT_ENV, BodyTimeout, install_header_timeout


async def _echo(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body) + 2).encode())]})
    await send({"type": "http.response.body", "body": b"ok" + body})


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setenv(HEADER_TIMEOUT_ENV, "0.5")
    monkeypatch.setenv(BODY_TIMEOUT_ENV, "0.5")
    from uvicorn import config

    saved = dict(config.HTTP_PROTOCOLS)
    install_header_timeout()
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(BodyTimeout(_echo), host="127.0.0.1", port=port, log_level="warning",
                                        lifespan="off", timeout_keep_alive=30))
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started:
        assert time.time() < deadline
        time.sleep(0.02)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        config.HTTP_PROTOCOLS.clear()
        config.HTTP_PROTOCOLS.update(saved)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    sock.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return True, got
            got += chunk
    except TimeoutError:
        return False, got


def test_error_raised_if_headers_never_finish(server: int) -> None:
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server))
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the rest
        socks.append(s)
    t0 = time.monotonic()
    for s in socks:
        closed, got = _closed_within(s, 5)
        assert closed and got.startswith(b"HTTP/1.1 408")
        s.close()
    assert time.monotonic() - t0 < 3  # all of them, at about the 0.5 s timeout


def test_a_prompt_client_is_served_and_kept_alive(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as s:
        for _ in range(2):  # a second request on the same connection, well after the first timer
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(5)
            got = b""
            while not got.endswith(b"ok"):
                got += s.recv(4096)
            assert got.startswith(b"HTTP/1.1 200")
            time.sleep(0.3)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # then a slow third one is cut off
        closed, got = _closed_within(s, 5)
        assert closed and b"408" in got


def test_error_raised_if_the_body_stalls(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\"")
        closed, got = _closed_within(s, 5)
        assert b" 408 " in got.split(b"\r\n")[0] and b"body_timeout" in got
