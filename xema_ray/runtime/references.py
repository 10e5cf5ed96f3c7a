"""A request's reference images as they travel to the worker: PNG bytes at the template's
reference size (the API checked and resized the upload: ``xema_ray.serving.api.uploads``), decoded
here into the PIL images the pipeline's own preprocessing takes."""

from __future__ import annotations

import io
from collections.abc import Sequence

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
