"""``POST /v1/images/edits`` and the reference images of ``POST /v1/videos``: the request schema,
the choice of template, and each upload checked and brought to the template's reference size.

``openai.images.edit`` sends a multipart body: ``image`` once (one file) or ``image[]`` per file
(a list), ``prompt``, ``model``, ``size``, ``n``, ``response_format``, ``output_format``, ... We take
those plus the extras ``/v1/images/generations`` takes (``seed``, ``guidance_scale``, ...).

Which template serves an edit (docs/api.md "Image inputs"):

- the model's served templates with as many references as the request brings; none: a 400 naming
  ``image`` with the counts served (and the model's own limit);
- ``size`` one of their output sizes; ``auto`` (the default): the one whose aspect ratio is
  nearest the first image's (then the nearest area); any other size: a 400 naming ``size`` with
  the sizes served;
- each image is then scaled to cover the template's reference size and centre-cropped
  (``uploads.fit_reference``); the response's ``size`` and the ``X-Xema-Template`` header say what
  was used.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator

from xema_ray.runtime.references import encode_reference
from xema_ray.serving.api.schemas import ImageRequest, UnsupportedTemplate, _check_text, current_limits, parse_size
from xema_ray.serving.api.uploads import ImageRefused, Upload, fit_reference, open_image
from xema_ray.templates import RequestTemplate


class ImageEditRequest(ImageRequest):
    """``POST /v1/images/edits`` (OpenAI's ``ImageEditParams`` plus the generation extras). The
    images arrive as files (``image`` / ``image[]``), not in these fields."""

    #: form fields that carry files (``image[]`` counts as ``image``)
    file_fields: ClassVar[tuple[str, ...]] = ("image",)

    size: str = Field(default="auto", max_length=11, description="WIDTHxHEIGHT of the output, or 'auto': the "
                      "served size nearest the first image's aspect ratio")
    input_fidelity: str | None = Field(default=None, description="accepted for OpenAI-client compatibility; ignored")

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str:
        if v != "auto":
            parse_size(v)
        return v

    @field_validator("style", "moderation", "user", "input_fidelity")
    @classmethod
    def _text(cls, v: str | None, info: ValidationInfo) -> str | None:
        return _check_text(v, info, current_limits().max_text_chars)


def _served_with(model: str, served: dict[str, RequestTemplate], kind: str) -> list[RequestTemplate]:
    ours = [t for t in served.values() if t.model == model]
    if not ours:
        models = sorted({t.model for t in served.values() if t.spec.kind == kind and t.references})
        raise UnsupportedTemplate(f"model {model!r} is not served with reference images; models that are: "
                                  f"{', '.join(models) or 'none'}", sorted(served), "model")
    return ours


def edit_template(model: str, size: str, count: int, first: tuple[int, int], served: dict[str, RequestTemplate],
                  kind: str = "image") -> RequestTemplate:
    """The served template for an edit of ``count`` images (the first ``first`` = (w, h)) at
    ``size`` ('auto' or WIDTHxHEIGHT), or UnsupportedTemplate naming the field (see the module)."""
    ours = _served_with(model, served, kind)
    spec = ours[0].spec
    if spec.kind != kind:
        raise UnsupportedTemplate(f"{model} is a{'n' if spec.kind == 'image' else ''} {spec.kind} model", sorted(served),
                                  "model")
    counts = sorted({t.references for t in ours if t.references})
    if not counts:
        raise UnsupportedTemplate(f"{model} is not served with reference images (templates: "
                                  f"{', '.join(sorted(t.shape_key for t in ours))})", sorted(t.shape_key for t in ours),
                                  "image")
    matching = [t for t in ours if t.references == count]
    if not matching:
        most = spec.reference_inputs().max_references
        limit = f"; the model takes at most {most}" if count > most else ""
        raise UnsupportedTemplate(f"{model} is served with {' or '.join(map(str, counts))} reference image(s), got "
                                  f"{count}{limit}", sorted(t.shape_key for t in ours), "image")
    keys = sorted(t.shape_key for t in matching)
    if size == "auto":
        aspect = math.log(first[0] / first[1])
        area = first[0] * first[1]
        return min(matching, key=lambda t: (round(abs(math.log(t.width / t.height) - aspect), 6),
                                            abs(math.log(t.width * t.height / area)), t.shape_key))
    w, h = parse_size(size)
    sized = [t for t in matching if (t.width, t.height) == (w, h)]
    if not sized:
        sizes = ", ".join(sorted({f"{t.width}x{t.height}" for t in matching}))
        raise UnsupportedTemplate(f"{model} with {count} reference image(s) does not serve {size}; served sizes: {sizes} "
                                  "(or 'auto')", keys, "size")
    return min(sized, key=lambda t: t.shape_key)


def reference_images(uploads: list[Upload], t: RequestTemplate) -> tuple[bytes, ...]:
    """Each upload checked (``uploads.open_image``) and brought to ``t``'s reference size, as the
    PNG bytes the worker decodes (``xema_ray.runtime.references``)."""
    several = len(uploads) > 1
    return tuple(encode_reference(fit_reference(open_image(u, i if several else None), t.reference_width,
                                                t.reference_height)) for i, u in enumerate(uploads))


def data_url_upload(field: str, value: object) -> Upload:
    """A JSON body's image: a ``data:image/...;base64,...`` URL (a file in a multipart body is the
    usual way). Raises ImageRefused naming the field."""
    if isinstance(value, dict):  # OpenAI's newer shape: {"image_url": "data:..."}
        value = value.get("image_url")
    if not isinstance(value, str) or not value.startswith("data:") or ";base64," not in value:
        raise ImageRefused(f"{field}: send the image as a file (multipart/form-data) or as a "
                           "'data:image/png;base64,...' URL", field)
    try:
        data = base64.b64decode(value.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused(f"{field}: the data URL's base64 does not decode", field) from None
    return Upload(field, "", data)


async def edit_inputs(req: ImageRequest, uploads: list[Upload], served: dict[str, RequestTemplate]
                      ) -> tuple[RequestTemplate, tuple[bytes, ...]]:
    """The template an edit maps to and its checked reference images (decoding and resizing run
    off the event loop; the request's options are checked by the caller, as for any request).
    Raises ImageRefused or UnsupportedTemplate naming the field."""
    if not uploads:
        raise ImageRefused("image: required; send one image file as 'image' or several as 'image[]' "
                           "(multipart/form-data)", "image")
    # the first image is opened once here (its size picks the template for size='auto'), all in a thread
    first = await asyncio.to_thread(open_image, uploads[0], 0 if len(uploads) > 1 else None)
    t = edit_template(req.model, req.size, len(uploads), first.size, served)
    return t, await asyncio.to_thread(reference_images, uploads, t)


def edit_body_doc() -> dict[str, Any]:
    """The ``openapi_extra`` of ``/v1/images/edits``: a multipart body (``ImageEditRequestForm``:
    ``ImageEditRequest``'s fields and the ``image`` file parts, ``served_schemas.narrow``)."""
    ref = {"$ref": "#/components/schemas/ImageEditRequestForm"}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": ref}}}}
