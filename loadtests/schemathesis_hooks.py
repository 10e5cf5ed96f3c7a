"""Generators of real images for schemathesis, loaded by the repository's ``schemathesis.toml``.

The API's OpenAPI document names its image inputs (``format: binary`` file parts and
``format: image-data-url`` JSON strings, PNG, JPEG or WebP), but a JSON Schema cannot say "bytes
that decode as an image": a fuzzer left to itself sends random bytes, which the server rightly
refuses (422 naming the field). These hooks draw small decodable images instead, so that the
fuzz's valid requests are valid (``st run`` from the repository root reads them; so does
``tests/serving/api/test_openapi_contract.py``).
"""

from __future__ import annotations

import base64
import io

import schemathesis
from hypothesis import strategies as st
from PIL import Image

#: (format, media type) of each image a generated request may carry
_FORMATS = (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"))
_SIZES = ((8, 8), (16, 12), (12, 20))


def _image(fmt: str, size: tuple[int, int], colour: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (colour, 255 - colour, 128)).save(buf, fmt)
    return buf.getvalue()


IMAGES: list[tuple[str, bytes]] = [(media, _image(fmt, size, 40 * i))
                                   for i, ((fmt, media), size) in enumerate((f, s) for f in _FORMATS for s in _SIZES)]

schemathesis.openapi.format("binary", st.sampled_from([data for _, data in IMAGES]))
schemathesis.openapi.format("image-data-url", st.sampled_from(
    [f"data:{media};base64,{base64.b64encode(data).decode()}" for media, data in IMAGES]))
