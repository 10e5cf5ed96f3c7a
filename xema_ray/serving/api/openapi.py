"""The OpenAPI document of the deployment: every status the API returns, the served models and
sizes as enums, and the configured limits — so that a client or a fuzzer can build a valid
request from the document alone.

FastAPI derives the request schemas from the pydantic models; ``install_openapi`` post-processes
that document with what only the deployment knows (its templates and limits). Endpoints are not
touched: statuses are added to every operation by method.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from xema_ray.lora.adapter import AdapterSource
from xema_ray.serving.api.schemas import ImageRequest, RequestLimits, VideoRequest
from xema_ray.serving.api.auth import key_required
from xema_ray.serving.api.errors import ErrorResponse
from xema_ray.serving.api.options import document_options
from xema_ray.serving.api.videos import VideoCreate
from xema_ray.serving.api.edits import ImageEditRequest
from xema_ray.templates import RequestTemplate

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}

#: statuses every operation may return, and those only a request with a body may return
_ANY_STATUS = {
    "408": "the request headers did not arrive within XEMA_HEADER_TIMEOUT_S (answered with no body, connection "
           "closed), its body stalled longer than XEMA_BODY_TIMEOUT_S, or it ran past the proxy's request timeout",
    "500": "a bug (never a client's input)",
    "503": "a queue is full, the server is busy, or a serving process died (with Retry-After)",
}
#: the status of every ``/v1/`` operation that needs a key (``auth.key_required``)
_KEY_STATUS = {"401": "the deployment lists API keys (auth.api_keys) and the request has none or a wrong one "
                      "(Authorization: Bearer <key>)"}
_BODY_STATUS = {
    "400": "a template this deployment does not serve (lists the served ones)",
    "413": "the request body exceeds limits.max_body_bytes",
    "415": "the body is not application/json",
    "422": "a field is missing, malformed or out of range (error.param names it)",
}
#: request schema -> the model kind it is for
_REQUEST_KINDS = {"ImageRequest": "image", "VideoRequest": "video", "VideoCreate": "video", "ImageEditRequest": "image"}
#: operations whose 200 may carry a media type FastAPI cannot see (the endpoint builds the
#: Response itself); added next to what FastAPI documents, never replacing it
_EXTRA_200_MEDIA = {("post", "/v1/videos/sync"): {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}}


def _error_response(description: str, retry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}
    if retry:
        out["headers"] = _RETRY_AFTER
    return out


def _enum(props: dict[str, Any], name: str, values: list[Any]) -> None:
    if name in props and values:
        props[name] = {**{k: v for k, v in props[name].items() if k not in ("anyOf", "pattern", "maxLength")},
                       "enum": values}
        if all(isinstance(v, str) for v in values):
            props[name]["type"] = "string"
        elif all(isinstance(v, int) for v in values):
            props[name]["type"] = "integer"


def build_openapi(app: FastAPI, served: dict[str, RequestTemplate], limits: RequestLimits) -> dict[str, Any]:
    """The document for ``app`` serving ``served`` under ``limits``."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")["$defs"])
    components["ErrorResponse"] = {k: v for k, v in ErrorResponse.model_json_schema(
        ref_template="#/components/schemas/{model}").items() if k != "$defs"}
    # the generation endpoints read their bodies themselves (``validation``: JSON or a form) and
    # refer to these by name
    for model in (ImageRequest, VideoRequest, VideoCreate, ImageEditRequest, AdapterSource):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(js.pop("$defs", {}))
        components.setdefault(model.__name__, js)
    for path, path_item in schema.get("paths", {}).items():
        for method, op in path_item.items():
            responses = op.setdefault("responses", {})
            statuses = dict(_ANY_STATUS)
            if method in ("post", "put", "patch") and "requestBody" in op:
                statuses.update(_BODY_STATUS)
            if key_required(path):
                statuses.update(_KEY_STATUS)
            for status, description in statuses.items():
                responses[status] = _error_response(description, retry=status == "503")
            extra = _EXTRA_200_MEDIA.get((method, path))
            if extra and "200" in responses:
                responses["200"].setdefault("content", {}).update(extra)
    for name, kind in _REQUEST_KINDS.items():
        props = components.get(name, {}).get("properties")
        if props is None:
            continue
        ours = [t for t in served.values() if t.spec.kind == kind]
        if name in ("ImageRequest", "VideoRequest"):  # no input images there: the templates without
            ours = [t for t in ours if not t.references]
        elif name == "ImageEditRequest":  # the templates with reference images (and size 'auto')
            ours = [t for t in ours if t.references]
        _enum(props, "model", sorted({t.model for t in ours}))
        _enum(props, "size", sorted({f"{t.width}x{t.height}" for t in ours}) + (["auto"] if name == "ImageEditRequest"
                                                                                   and ours else []))
        if kind == "video":
            _enum(props, "num_frames", sorted({t.frames for t in ours}))
        if "prompt" in props:
            props["prompt"]["maxLength"] = limits.max_prompt_chars
        for text in ("user", "quality", "style"):
            if text in props:
                props[text] = {"anyOf": [{"type": "string", "maxLength": limits.max_text_chars}, {"type": "null"}],
                               **{k: v for k, v in props[text].items() if k not in ("anyOf", "type")}}
    document_options(components, served, _REQUEST_KINDS)
    schema["info"]["x-limits"] = limits.model_dump()
    return schema


def install_openapi(app: FastAPI, served: dict[str, RequestTemplate], limits: RequestLimits) -> None:
    """Serve ``build_openapi``'s document at ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, served, limits)
        return app.openapi_schema

    app.openapi_schema = None
    app.openapi = openapi  # type: ignore[method-assign]
