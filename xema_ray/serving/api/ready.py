"""Waiting for the app from outside: poll ``/healthz`` (readiness) until it answers 200.

Every script that starts the app and then sends it work (``make loadtest``, the benches, the
test fixtures) waits here, so none sends a request to a group that is still loading its model,
and none crashes on the 503 a starting app answers: connection refused (the proxy is not up
yet), 404 (the application is not deployed yet), 503 (a group is starting or degraded) all mean
"not yet". Standard library only (no HTTP client dependency).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from pydantic import BaseModel, Field


class ReadyPoll(BaseModel):
    """One look at ``/healthz``."""

    t_s: float = Field(description="seconds since waiting began")
    status: int | None = Field(description="HTTP status; None: no answer (refused, reset, timed out)")
    state: str | None = Field(default=None, description="the body's status: starting | degraded | ok")


class NotReady(TimeoutError):
    """The app did not become ready in time (the last answer is in the message)."""


def poll_health(url: str, timeout_s: float = 5.0) -> tuple[int | None, str | None]:
    """``(HTTP status, body status)`` of ``url/healthz``; ``(None, None)`` when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/healthz", timeout=timeout_s) as r:
            return r.status, _state(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _state(e.read())
    except (OSError, ValueError):  # refused, reset, timed out
        return None, None


def _state(body: bytes) -> str | None:
    try:
        got = json.loads(body)
    except ValueError:
        return None
    return got.get("status") if isinstance(got, dict) and isinstance(got.get("status"), str) else None


def wait_ready(url: str, timeout_s: float, poll_s: float = 1.0, alive: Callable[[], bool] | None = None,
               log: list[ReadyPoll] | None = None) -> float:
    """Seconds until ``url/healthz`` answered 200. Raises ``NotReady`` after ``timeout_s``, or
    ``RuntimeError`` as soon as ``alive()`` says the process serving the app has exited.

    Args:
        url: the app's base URL.
        timeout_s: longest wait.
        poll_s: pause between looks.
        alive: whether the app's process still runs (None: not checked).
        log: every look is appended here (the readiness timeline), if given.
    """
    start = time.monotonic()
    last: tuple[int | None, str | None] = (None, None)
    while True:
        last = poll_health(url)
        now = time.monotonic() - start
        if log is not None:
            log.append(ReadyPoll(t_s=round(now, 2), status=last[0], state=last[1]))
        if last[0] == 200:
            return now
        if alive is not None and not alive():
            raise RuntimeError(f"the app's process exited before {url} was ready (last /healthz: {last})")
        if now > timeout_s:
            raise NotReady(f"{url} not ready within {timeout_s:.0f} s (last /healthz: HTTP {last[0]}, {last[1]})")
        time.sleep(poll_s)
