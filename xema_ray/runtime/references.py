"""A request's reference images as they travel to the worker: PNG bytes at the template's
reference size (the API checked and resized the upload: ``xema_ray.serving.api.uploads``), decoded
here into the PIL images the pipeline's own preprocessing takes."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from PIL import Image


def encode_reference(image: Image.Image) -> bytes:
    """``image`` as lossless PNG bytes (what crosses to the worker: no quality lost on the way)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def decode_references(blobs: Sequence[bytes]) -> list[Image.Image]:
    """One request's references, in order, as RGB images."""
    out = []
    for blob in blobs:
        with Image.open(io.BytesIO(blob)) as im:
            out.append(im.convert("RGB"))
    return out


def batch_references(count: int, requests: Sequence[Any], shape_only: bool) -> list[list[Image.Image]] | None:
    """Each request's own images (``GenerationRequest.references``) for a template taking ``count``;
    None without references, or for a shape-only run (``xema verify``, layout solving) whose
    requests bring none: the pipeline then gets placeholders of the template's size, which
    allocate what real images do."""
    if not count or (shape_only and not any(r.references for r in requests)):
        return None
    return [decode_references(r.references) for r in requests]
