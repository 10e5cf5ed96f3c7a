"""One validation path for the three generation endpoints (``/v1/images/generations``,
``/v1/videos``, ``/v1/videos/sync``), JSON or multipart alike: the same body gets the same
status everywhere.

- the body is read by ``read_body``: JSON (``application/json`` or ``+json``) or a form
  (``multipart/form-data``, ``application/x-www-form-urlencoded``); anything else is a 415; JSON
  that cannot be parsed — malformed, nested too deep for the parser (``RecursionError``), an
  integer beyond the interpreter's digit limit — or that is not an object is a 422; a file sent
  in a form field is a 422 naming the field (no field takes a file);
- ``parse_body`` then checks it against the endpoint's request model: an option the endpoint
  does not know is a 400 naming it and listing the accepted ones; a missing, malformed or
  out-of-range field is a 422 naming the field (``errors.validation_message``).

Form fields are text: a field the model types as a number is converted before the (strict)
model sees it, and a text that is not a number stays text, so the model refuses it.
"""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from xema_ray.serving.api.errors import BodyError, validation_message
from xema_ray.serving.api.uploads import Upload

M = TypeVar("M", bound=BaseModel)
_FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _field_types(model: type[BaseModel], name: str) -> tuple[Any, ...]:
    """The types ``name`` of ``model`` takes (a union's members; none for a field it lacks)."""
    field = model.model_fields.get(name)
    if field is None:
        return ()
    ann = field.annotation
    return typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union else (ann,)


def _number_kinds(model: type[BaseModel], name: str) -> tuple[type, ...]:
    args = _field_types(model, name)
    if str in args:
        return ()  # the field takes text as it is (e.g. seconds: '4')
    return tuple(k for k in (int, float) if k in args)


def _takes_list(model: type[BaseModel], name: str) -> bool:
    """``name`` is a list field of ``model`` (e.g. ``lora: list[LoraUse] | None``)."""
    return any(typing.get_origin(a) is list for a in _field_types(model, name))


def _takes_object(model: type[BaseModel], name: str) -> bool:
    """``name`` is an object field of ``model`` (e.g. ``experts: ExpertFiles | None``): a form sends it as JSON text."""
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in _field_types(model, name))


#: a form field of a list of objects as the OpenAI client writes one (``lora[][name]``, ``lora[][scale]``)
_LIST_ITEM = re.compile(r"^([A-Za-z_]+)\[\]\[([A-Za-z_]+)\]$")


class _FormRows(list):  # type: ignore[type-arg]
    """The items of a ``NAME[][FIELD]`` list field, as read from a form (told apart from JSON text)."""


def _list_item(out: dict[str, Any], model: type[BaseModel], key: str, value: str) -> bool:
    """Take ``key=value`` into a list field of ``out`` if it is one: ``NAME[][FIELD]`` (each item's
    fields in turn; a field seen again starts the next item) or ``NAME`` holding JSON text: the list,
    or one item per field when repeated. False: not a list field."""
    m = _LIST_ITEM.match(key)
    if m is not None and _takes_list(model, m.group(1)):
        name = m.group(1)
        rows = out.setdefault(name, _FormRows())
        if not isinstance(rows, _FormRows):
            raise BodyError(422, f"{name}: sent both as one JSON field and as {key} fields; send one of them",
                            param=name)
        if not rows or m.group(2) in rows[-1]:
            rows.append({})
        rows[-1][m.group(2)] = value
        return True
    if _takes_list(model, key):
        try:
            value_json = json.loads(value)
        except json.JSONDecodeError:
            raise BodyError(422, f"{key}: in a form, a JSON list or one JSON object per {key} field (e.g. "
                                 f"{key}={{\"name\": \"a\", \"scale\": 0.8}}) or {key}[][name]=... fields, as the "
                                 "OpenAI client sends them", param=key) from None
        rows = out.setdefault(key, [])
        if isinstance(rows, _FormRows):
            raise BodyError(422, f"{key}: sent both as JSON and as {key}[][...] fields; send one of them", param=key)
        if isinstance(value_json, list):  # the whole list in one field
            rows.extend(value_json)
        else:  # one item per field (a form's repeated parts)
            rows.append(value_json)
        return True
    return False


def _from_form(value: str, kinds: tuple[type, ...]) -> Any:
    for kind in kinds:
        try:
            return kind(value.strip())
        except ValueError:
            continue
    return value


async def read_body(request: Request, model: type[BaseModel], uploads: list[Upload] | None = None) -> dict[str, Any]:
    """The body as a dict (JSON object or form), or BodyError (415 / 422). A form's files in the
    fields ``model.file_fields`` names (``image`` or ``image[]`` for ``image``) go to ``uploads``
    in order, when the caller gives that list."""
    ctype = content_type(request)
    if ctype in _FORMS:
        try:
            form = await request.form()
        except Exception as e:  # a malformed form is the client's error, never a 500
            raise BodyError(422, f"the form body could not be parsed ({type(e).__name__}: {e})") from None
        out: dict[str, Any] = {}
        takes_files: tuple[str, ...] = getattr(model, "file_fields", ())
        for k, v in form.multi_items():
            if not isinstance(v, str) and uploads is not None and k.removesuffix("[]") in takes_files:
                uploads.append(Upload(k.removesuffix("[]"), getattr(v, "filename", None) or "", await v.read()))
                continue
            if not isinstance(v, str):
                raise BodyError(422, f"{k}: a file was sent where text is expected "
                                     f"(file {getattr(v, 'filename', '')!r}); no field of this endpoint takes a file",
                                param=k)
            if _list_item(out, model, k, v):
                continue
            if _takes_object(model, k):
                try:
                    out[k] = json.loads(v)
                except json.JSONDecodeError:
                    raise BodyError(422, f"{k}: in a form, a JSON object (e.g. {k}={{\"low_noise\": \"...\"}})",
                                    param=k) from None
                continue
            kinds = _number_kinds(model, k)
            out[k] = _from_form(v, kinds) if kinds else v
        return out
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise BodyError(415, f"the request body must be JSON (application/json) or a form (multipart/form-data, "
                        f"application/x-www-form-urlencoded), got Content-Type {ctype!r}",
                        code="unsupported_media_type")
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8") if raw else "null")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BodyError(422, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise BodyError(422, "the body is not valid JSON: it nests arrays or objects too deeply") from None
    except ValueError as e:  # e.g. an integer with more digits than the interpreter converts
        raise BodyError(422, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BodyError(422, "the body must be a JSON object with at least 'model' and 'prompt'")
    return body


def parse_body(model: type[M], body: dict[str, Any]) -> M:
    """``body`` as ``model``, or BodyError: 400 for an unknown option, 422 for a bad field."""
    unknown = sorted(set(body) - set(model.model_fields))
    if unknown:
        raise BodyError(400, f"unknown option {unknown[0]!r}; accepted: {', '.join(model.model_fields)}",
                        param=unknown[0], code="unknown_option")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise BodyError(422, message, param=param) from None
    except RecursionError:  # a value nested too deeply for the validator
        raise BodyError(422, "a field nests arrays or objects too deeply") from None


async def parse_request(request: Request, model: type[M], uploads: list[Upload] | None = None) -> M:
    """``read_body`` then ``parse_body``: what every generation endpoint calls first (``uploads``:
    see ``read_body``)."""
    return parse_body(model, await read_body(request, model, uploads))


def request_body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of an endpoint that takes ``model`` as JSON or a form (the form's
    schema is ``<Name>Form``, made by ``served_schemas.narrow``: no nulls, files as parts)."""
    name = model.__name__
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}},
        "multipart/form-data": {"schema": {"$ref": f"#/components/schemas/{name}Form"}}}}}
