"""Requests refused, by reason: ``xema_requests_refused{reason}`` on Ray Serve's Prometheus endpoint.

Counted where the answer leaves the app, so that every refusal counts once, wherever it was made:
``RefusalMeter`` wraps the Router's FastAPI app outermost and reads each error answer's status
and JSON ``code`` — refusals of the Router itself (no API key, a body too large, a bad field, a
template not served, ``limits.max_in_flight``) and those a model group made (its queue full, a
batch out of device memory) that the Router turned into HTTP; the HTTP proxy counts the answers
it makes itself (``ProxyErrorsAsJson``: Serve's backpressure, a Router replica gone), which
never reach the Router. ``reason`` is one of ``REASONS``: the tag's values are fixed, whatever
clients send.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.util.metrics import Counter

    from xema_ray.serving.api.middleware import ASGIApp, Message, Receive, Scope, Send

#: the API's error ``code`` -> the refusal's reason (docs/metrics.md)
CODE_REASONS: dict[str, str] = {
    "invalid_api_key": "unauthorized",
    "body_too_large": "body_too_large",
    "unsupported_media_type": "bad_request",
    "invalid_value": "bad_request_field",
    "unknown_option": "bad_request_field",
    "unsupported_option": "bad_request_field",  # an option the model does not take (400, param named)
    "out_of_range": "bad_request_field",
    "unsupported_template": "unknown_template",
    "queue_full": "queue_full",
    "busy": "busy",
    "too_many_jobs": "tenant_jobs_limit",
    "device_out_of_memory": "out_of_memory",
    "group_unavailable": "unavailable",
    "waking": "waking",  # a group scaled to zero did not wake within its wake timeout
    "replica_died": "unavailable",
    "replica_unavailable": "unavailable",
    "store_unavailable": "store_unavailable",
    "job_store_lost": "store_unavailable",
}
#: every value the ``reason`` tag takes
REASONS: tuple[str, ...] = (*sorted(set(CODE_REASONS.values())), "not_found", "timeout", "internal_error", "other")
#: the largest error body read for its code (the API's are a few hundred bytes)
MAX_ERROR_BODY = 64 * 1024

_counter: Counter | None = None


def refusal_reason(status: int, code: str | None) -> str:
    """The ``reason`` of an error answer.

    Example:
        >>> refusal_reason(503, "queue_full"), refusal_reason(422, None), refusal_reason(404, "http_404")
        ('queue_full', 'bad_request_field', 'not_found')
    """
    if code in CODE_REASONS:
        return CODE_REASONS[code]
    if status in (404, 405):
        return "not_found"
    if status in (400, 422):
        return "bad_request_field"  # the API names the field (``param``) of every such answer
    if status == 401:
        return "unauthorized"
    if status == 413:
        return "body_too_large"
    if status == 408:  # the proxy's request timeout, or a client too slow to send its body (slow_clients)
        return "timeout"
    if status >= 500 and status != 503:
        return "internal_error"
    return "other"


def count_refusal(reason: str) -> None:
    """Add one to ``xema_requests_refused{reason}`` (the counter is made on first use, in the
    process that counts: the Router replica or the HTTP proxy)."""
    global _counter
    if reason not in REASONS:
        raise ValueError(f"unknown refusal reason {reason!r}; one of {REASONS}")
    if _counter is None:
        from ray.serve import metrics  # Serve's tags (deployment, replica) inside a replica; none in the proxy

        _counter = metrics.Counter("xema_requests_refused", "requests answered with a refusal, by reason",
                                   tag_keys=("reason",))
    _counter.inc(tags={"reason": reason})


def error_code(body: bytes) -> str | None:
    """``error.code`` of an API error body (None: not one)."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


class RefusalMeter:
    """Counts the Router app's error answers (status >= 400) by reason; passes everything on unchanged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()
        counted = False

        async def metered(msg: Message) -> None:
            nonlocal status, counted
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif msg["type"] == "http.response.body" and status >= 400 and not counted:
                if len(body) < MAX_ERROR_BODY:
                    body.extend(msg.get("body", b"")[: MAX_ERROR_BODY - len(body)])
                if not msg.get("more_body", False):
                    counted = True
                    count_refusal(refusal_reason(status, error_code(bytes(body))))
            await send(msg)

        try:
            await self.app(scope, receive, metered)
        except Exception as e:
            # the app's handler for any other exception (``errors.install_error_handlers``) runs in
            # Starlette's outermost middleware, outside this one: its answer is counted from here
            if not counted:
                from xema_ray.serving.api.errors import exception_response

                mapped = exception_response(e)
                count_refusal("internal_error" if mapped is None else
                              refusal_reason(mapped.status_code, error_code(bytes(mapped.body))))
            raise
