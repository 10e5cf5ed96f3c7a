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

from xema_ray.lora_pool import AdapterSource
from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.serving.api.schemas import ImageRequest, RequestLimits, VideoRequest
from xema_ray.serving.api.auth import key_required
from xema_ray.serving.api.errors import ErrorResponse
from xema_ray.serving.api.options import document_options
from xema_ray.serving.api.videos import VideoCreate
from xema_ray.serving.api.edits import ImageEditRequest
from xema_ray.serving.api.served_schemas import narrow
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
    "404": "lora names an adapter the model has not loaded (error.param: lora[i].name)",
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
        nullable = {"type": "null"} in props[name].get("anyOf", [])  # null stays accepted (not given)
        props[name] = {**{k: v for k, v in props[name].items() if k not in ("anyOf", "pattern", "maxLength")},
                       "enum": values + [None] * nullable}
        if nullable:
            return
        if all(isinstance(v, str) for v in values):
            props[name]["type"] = "string"
        elif all(isinstance(v, int) for v in values):
            props[name]["type"] = "integer"


def build_openapi(app: FastAPI, served: dict[str, RequestTemplate], limits: RequestLimits,
                  batches: dict[str, int] | None = None, pools: dict[str, LoraPoolConfig] | None = None,
                  url_images: bool = True) -> dict[str, Any]:
    """The document for ``app`` serving ``served`` under ``limits`` (``batches``: each template's
    planned batch, default 1; ``pools``: the adapter pools by model; ``url_images``: whether the job
    store serves ``response_format: url``); the request bodies narrowed by ``served_schemas.narrow``."""
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
        if "prompt" in props:  # some text that is not only whitespace
            props["prompt"].update(maxLength=limits.max_prompt_chars, pattern=NOT_ONLY_SPACE)
        for text in ("user", "style", "moderation", "input_fidelity"):
            if text in props:
                props[text] = {"anyOf": [{"type": "string", "maxLength": limits.max_text_chars}, {"type": "null"}],
                               **{k: v for k, v in props[text].items() if k not in ("anyOf", "type")}}
    document_options(components, served, _REQUEST_KINDS)
    narrow(components, served, batches or {k: 1 for k in served}, pools or {}, url_images)
    _describe_parameters(schema, served)
    schema["info"]["x-limits"] = limits.model_dump()
    return schema


#: a character Python's ``str.strip`` keeps (the server refuses a prompt of whitespace alone);
#: ECMA's ``\S`` differs from it on \x1c-\x1f, \x85 and \ufeff
NOT_ONLY_SPACE = "[^\\t-\\r \\x1c-\\x1f\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]"

#: where each path parameter's values come from (a client, or a fuzzer, reads how ids are made)
_ID_SOURCES = {"video_id": "the id POST /v1/videos answered with (GET /v1/videos lists them)",
               "name": "an adapter's name (POST /v1/adapters, GET /v1/adapters) or, under /v1/images/files, the file "
                       "name of a url a response_format='url' image answered with",
               "template": "a template's shape key (GET /v1/templates)"}


def _describe_parameters(schema: dict[str, Any], served: dict[str, RequestTemplate]) -> None:
    """Path parameters say where their ids come from; ``?model=`` names a served model, and
    ``?after=`` a video id (never empty)."""
    models = sorted({t.model for t in served.values()})
    for path_item in schema.get("paths", {}).values():
        for op in path_item.values():
            for param in op.get("parameters", []):
                name, where = param.get("name"), param.get("in")
                if where == "path" and name in _ID_SOURCES:
                    param.setdefault("description", _ID_SOURCES[name])
                    param["schema"]["minLength"] = 1
                elif where == "query" and name == "model" and models:
                    param["schema"] = {"type": "string", "enum": models}
                    param.setdefault("description", "a served model (GET /v1/models)")
                elif where == "query" and name == "after":
                    param["schema"] = {"type": "string", "minLength": 1}
                    param.setdefault("description", "the id of the last video of the previous page")


def install_openapi(app: FastAPI, served: dict[str, RequestTemplate], limits: RequestLimits,
                    batches: dict[str, int] | None = None, pools: dict[str, LoraPoolConfig] | None = None,
                    url_images: bool = True) -> None:
    """Serve ``build_openapi``'s document at ``/openapi.json`` (built once, on first request, from
    the deployment this Router replica was started with)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, served, limits, batches, pools, url_images)
        return app.openapi_schema

    app.openapi_schema = None
    app.openapi = openapi  # type: ignore[method-assign]
