"""Every error the HTTP API returns, in one JSON shape, and the exceptions behind each status.

The shape (OpenAI's): ``{"error": {"message", "type", "param", "code"}}`` plus, for a template
this deployment does not serve, ``supported_templates``. Status codes:

| status | type | when |
| --- | --- | --- |
| 400 | invalid_request_error | a well-formed request for a template this deployment does not serve, or with an option its model does not take (``code: unsupported_option``) |
| 404 / 405 | not_found_error | no such path / method (a 405 carries ``Allow``: the path's methods, RFC 9110 §15.5.6) |
| 413 | invalid_request_error | the body is larger than ``limits.max_body_bytes`` |
| 415 | invalid_request_error | the body is not ``application/json`` |
| 422 | invalid_request_error | a field is missing, malformed or out of range — the model's own range too (``param`` names it); a request that failed inside its batch for its own input (named by the worker, or failing alone with a ``ValueError`` / ``TypeError`` while its neighbours were served: ``serving/group/isolation.py``) |
| 503 | service_unavailable | an admission limit was hit (``limit`` names it), a group is starting, a group scaled to zero did not wake within its wake timeout (``code: waking``), a worker / replica / node died, or the batch ran out of device memory (``entry``, ``requested_bytes``, ``free_bytes`` say what); always with Retry-After |
| 500 | server_error | a bug (never for a client's input); ``code: request_failed``: a request that failed inside its batch and again alone, not for its input (its neighbours were served) |

Messages quote at most ``QUOTE_CHARS`` characters of an offending value: a 1 MB prompt is not
echoed back, and a NaN is quoted as text (JSON cannot carry it).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from ray.exceptions import RayActorError, RayTaskError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from xema_ray.serving.api.schemas import UnsupportedTemplate
from xema_ray.serving.api.wake import GroupWaking
from xema_ray.serving.messages import GroupUnavailable, InvalidRequest, QueueFull, RequestFailedAlone

if TYPE_CHECKING:
    from xema_ray.runtime.out_of_memory import DeviceOutOfMemory

logger = logging.getLogger("xema_ray.serving")

QUOTE_CHARS = 64
#: Retry-After for a replica, actor or node that died: Serve replaces a replica in ~10 s on 2 CPUs
DEATH_RETRY_AFTER_S = 5
#: Retry-After for a batch that ran out of device memory: the worker is fine, what filled the
#: device (a neighbouring batch, its paused state) is gone within a batch or so
OOM_RETRY_AFTER_S = 2


class ErrorDetail(BaseModel):
    message: str = Field(description="what went wrong and what is accepted")
    type: str = Field(description="invalid_request_error | not_found_error | service_unavailable | server_error")
    param: str | None = Field(default=None, description="the request field at fault, if one is")
    code: str | None = Field(default=None, description="a machine-readable reason, e.g. queue_full")
    limit: str | None = Field(default=None, description="503 for overload only: the admission limit that was hit "
                                                        "(limits.max_in_flight, models[].max_queue, "
                                                        "max_queued_requests, models[].autoscaling.wake_timeout_s)")
    supported_templates: list[str] | None = Field(default=None, description="400 only: the templates served")
    entry: str | None = Field(default=None, description="503 out of device memory only: the plan entry whose batch "
                                                        "failed (template, and its layout when it has one)")
    requested_bytes: int | None = Field(default=None, description="503 out of device memory only: bytes the refused "
                                                                  "allocation asked for")
    free_bytes: int | None = Field(default=None, description="503 out of device memory only: bytes the device's "
                                                             "allocator could still hand out then")


class ErrorResponse(BaseModel):
    """The body of every non-2xx response."""

    error: ErrorDetail


class BodyError(Exception):
    """A request body refused before it reaches an endpoint (rendered as the API's JSON error)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr`` of a value, cut to ``limit`` characters with the full length said."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str | bytes) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({size})"


def _is_device_oom(cause: BaseException) -> TypeGuard[DeviceOutOfMemory]:
    """Whether ``cause`` is a ``DeviceOutOfMemory``. Its class is a ``torch.OutOfMemoryError``, so
    the Router's process (which runs no model) imports it only when one arrives: unpickling one
    imports its module, and before that no such error can be here."""
    module = sys.modules.get("xema_ray.runtime.out_of_memory")
    return module is not None and isinstance(cause, module.DeviceOutOfMemory)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, retry_after_s: float | None = None,
                   supported_templates: list[str] | None = None, limit: str | None = None,
                   oom: DeviceOutOfMemory | None = None) -> JSONResponse:
    """The JSON error response; 503s always carry Retry-After (whole seconds, at least 1)."""
    headers = {}
    if status == 503 and retry_after_s is None:
        retry_after_s = DEATH_RETRY_AFTER_S
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    figures = ({"entry": oom.entry, "requested_bytes": oom.requested_bytes, "free_bytes": oom.free_bytes}
               if oom is not None else {})
    body = ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code, limit=limit,
                                           supported_templates=supported_templates, **figures))
    return JSONResponse(status_code=status, content=body.model_dump(exclude_none=True), headers=headers)


def cause_of(e: BaseException) -> BaseException:
    """The exception a replica raised (Ray wraps it in RayTaskError)."""
    while isinstance(e, RayTaskError) and e.cause is not None and e.cause is not e:
        e = e.cause
    return e


def _is_death(e: BaseException) -> bool:
    """A replica, worker actor or node went away (or Serve has none to route to)."""
    from ray.exceptions import ActorUnavailableError, NodeDiedError, OwnerDiedError, WorkerCrashedError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    return isinstance(e, RayActorError | ActorUnavailableError | NodeDiedError | OwnerDiedError | WorkerCrashedError
                      | BackPressureError | DeploymentUnavailableError)


def exception_response(e: BaseException) -> JSONResponse | None:
    """The HTTP answer for an exception a request raised, or None for a bug (a 500)."""
    cause = cause_of(e)
    if isinstance(cause, UnsupportedTemplate):
        return error_response(400, str(cause), param=cause.param, code="unsupported_template",
                              supported_templates=cause.supported)
    if isinstance(cause, InvalidRequest):
        return error_response(cause.status, str(cause), "not_found_error" if cause.status == 404 else
                              "invalid_request_error", param=cause.param,
                              code="not_found" if cause.status == 404 else "invalid_value")
    if isinstance(cause, QueueFull):
        return error_response(503, str(cause), "service_unavailable", code="queue_full",
                              retry_after_s=cause.retry_after_s, limit="models[].max_queue")
    if isinstance(cause, GroupWaking):  # held past its group's wake timeout (api/wake.py)
        return error_response(503, str(cause), "service_unavailable", code="waking",
                              retry_after_s=cause.retry_after_s, limit="models[].autoscaling.wake_timeout_s")
    if isinstance(cause, GroupUnavailable):
        return error_response(503, str(cause), "service_unavailable", code="group_unavailable")
    if _is_device_oom(cause):  # one batch failed; the worker serves the next
        return error_response(503, str(cause), "service_unavailable", code="device_out_of_memory",
                              retry_after_s=OOM_RETRY_AFTER_S, oom=cause)
    if isinstance(cause, RequestFailedAlone):  # a bug one request hit alone; its neighbours were served
        return error_response(500, str(cause), "server_error", code="request_failed")
    if _is_death(cause) or _is_death(e):
        from ray.serve.exceptions import BackPressureError

        if isinstance(cause, BackPressureError):
            return error_response(503, f"server busy: {cause}", "service_unavailable", code="busy",
                                  retry_after_s=cause._retry_after_s or DEATH_RETRY_AFTER_S,
                                  limit="max_ongoing_requests")
        return error_response(503, f"a serving process failed while handling the request ({type(cause).__name__}); "
                              "it is being replaced, retry later", "service_unavailable", code="replica_died")
    return None


def _json_content_type(request: Request) -> bool:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return ctype == "application/json" or ctype.endswith("+json")


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The 422 message and ``param`` for pydantic's errors: the first bad field (a prefix of its
    value only) and how many more there are."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        message = f"the body is not valid JSON: {msg}"
    else:
        message = f"{param}: {msg}" if param else msg
        if "input" in first and first.get("type") not in ("missing",):
            message += f" (got {quote(first['input'])})"
    if len(errors) > 1:
        message += f"; and {len(errors) - 1} more error(s)"
    return message, param


def validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming the first bad field (a prefix of its value only), or 415 for a non-JSON body."""
    errors = exc.errors()
    body_is_not_an_object = any(tuple(e.get("loc", ())) == ("body",) for e in errors)
    if body_is_not_an_object and request.method in ("POST", "PUT", "PATCH") and not _json_content_type(request):
        got = request.headers.get("content-type") or "none"
        return error_response(415, f"the request body must be JSON (Content-Type: application/json), got "
                                   f"Content-Type {quote(got)}", param=None, code="unsupported_media_type")
    message, param = validation_message(errors)
    return error_response(422, message, param=param, code="invalid_value")


#: the methods a 405's ``Allow`` may name
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT")


def _flat(routes: Any) -> Any:
    """``routes`` with each included router's own routes in its place (FastAPI includes lazily)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None and not getattr(included, "prefix", ""):
            yield from _flat(included.routes)
        else:
            yield route


def allowed_methods(app: Any, scope: Any) -> list[str]:
    """The methods ``app`` serves at ``scope``'s path (the ``Allow`` of a 405), asked of the routes
    themselves (included routers too): Starlette's own 405 names only the first matching route's
    methods, and FastAPI makes one route per method. A path that is a route of its own
    (``/v1/videos/sync``) names that route's methods, not those of a template it also fits
    (``/v1/videos/{video_id}``)."""
    matched: dict[str, bool] = {}  # method -> matched by a path without parameters
    routes = list(_flat(app.routes))
    for m in _METHODS:
        for route in routes:
            match, child = route.matches({**scope, "method": m, "path_params": {}})  # none from the 405 route
            if match == Match.FULL:
                matched[m] = matched.get(m, False) or not child.get("path_params")
    static = [m for m, exact in matched.items() if exact]
    return static or list(matched)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception of ``app`` into the JSON shape (call once per app)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(request, exc)

    @app.exception_handler(BodyError)
    async def _body(request: Request, exc: BodyError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code in (404, 405) else (
            "invalid_request_error" if exc.status_code < 500 else "server_error")
        if exc.status_code == 405:
            allowed = allowed_methods(request.app, request.scope)  # the app serving it (Serve copies ours)
            response = error_response(405, f"{request.method} is not allowed on {request.url.path}; allowed: "
                                           f"{', '.join(allowed)}", type_, code="method_not_allowed")
            response.headers["Allow"] = ", ".join(allowed)
            return response
        return error_response(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        mapped = exception_response(exc)
        if mapped is not None:
            return mapped
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); this is a bug, please report it",
                              "server_error")
