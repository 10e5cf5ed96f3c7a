"""Output formats the API offers on top of the engine's PNG / MP4: JPEG and WebP images at a
chosen compression, and a video's first frame as a PNG thumbnail."""

from __future__ import annotations

import io
from typing import Literal

ImageFormat = Literal["png", "jpeg", "webp"]
MEDIA_TYPES: dict[str, str] = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def transcode_image(png: bytes, fmt: ImageFormat, compression: int | None = None) -> bytes:
    """The engine's PNG as ``fmt``. ``compression`` (0-100, OpenAI's ``output_compression``) is
    100 - quality for JPEG and WebP and the zlib level (scaled to 0-9) for PNG, which stays lossless.

    Example:
        >>> import numpy as np
        >>> from xema_ray.runtime.encode import encode_png
        >>> transcode_image(encode_png(np.zeros((8, 8, 3), np.uint8)), "jpeg", 20)[:3]
        b'\\xff\\xd8\\xff'
    """
    if fmt == "png" and compression is None:
        return png
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    buf = io.BytesIO()
    if fmt == "png":
        img.save(buf, format="PNG", compress_level=round((compression or 0) * 9 / 100))
    else:
        quality = 100 - (compression if compression is not None else 25)  # PIL's default quality is 75
        img.save(buf, format="JPEG" if fmt == "jpeg" else "WEBP", quality=max(1, quality))
    return buf.getvalue()


def first_frame_png(mp4: bytes) -> bytes:
    """The first frame of an MP4 as PNG bytes (the ``thumbnail`` variant)."""
    import imageio.v3 as iio

    from xema_ray.runtime.encode import encode_png

    frame = iio.imread(mp4, index=0, extension=".mp4")
    return encode_png(frame[..., :3])
