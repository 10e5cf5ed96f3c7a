"""Uploaded images (``/v1/images/edits``' ``image``, ``/v1/videos``' ``input_reference``): read,
checked and brought to the template's reference size before the request is admitted, so that a bad
image fails alone with a 4xx naming its field and the rule, never in the batch it would join.

The rules (docs/api.md "Image inputs"):

- an upload is a PNG, JPEG or WebP file; anything else is a 422 (``not an image``);
- it decodes completely: a truncated or corrupt file is a 422;
- it has at most ``MAX_IMAGE_PIXELS`` pixels (read from its header, before decoding: a
  decompression bomb is refused without decoding it), a 422;
- a request brings at most the model's ``max_references`` images, and the served templates say
  which counts are served: a 400 naming ``image`` and the counts;
- the whole body stays within ``limits.max_body_bytes`` (413, from the request guard).

An accepted image of any size is brought to the template's reference size by the documented rule
``fit_reference``: scaled to cover it, then centre-cropped (the aspect ratio is kept; what is cut
is the overflow of one dimension), as diffusers' ``resize_mode="crop"`` does.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from xema_ray.serving.api.errors import BodyError

#: the most pixels an uploaded image may have (its header's width x height): 36 MP covers a
#: 6000 x 6000 photo; anything larger is refused before it is decoded (a decompression bomb's
#: file is small, its pixels are not)
MAX_IMAGE_PIXELS = 36_000_000
#: the formats accepted (what the OpenAI API documents for image inputs)
FORMATS = ("PNG", "JPEG", "WEBP")


@dataclass(frozen=True)
class Upload:
    """One uploaded file: the form field it came in (``image``, ``image[]``, ``input_reference``),
    its file name and bytes."""

    field: str
    filename: str
    data: bytes


class ImageRefused(BodyError):
    """An upload the API refuses (``status``, naming ``param`` and the rule in the message; the
    app's error handlers render it as any refused body)."""

    def __init__(self, message: str, param: str, status: int = 422) -> None:
        super().__init__(status, message, param, code="invalid_image")

    def __str__(self) -> str:
        return self.message


def open_image(upload: Upload, index: int | None = None) -> Image.Image:
    """The upload decoded as an RGB image, or ``ImageRefused`` (422) saying which rule it broke.

    Args:
        upload: the file.
        index: its position among the request's images (named in the message when several).

    Example:
        >>> import io
        >>> buf = io.BytesIO(); Image.new("RGB", (8, 8)).save(buf, "PNG")
        >>> open_image(Upload("image", "a.png", buf.getvalue())).size
        (8, 8)
    """
    where = upload.field if index is None else f"{upload.field}[{index}]"
    name = f" ({upload.filename!r})" if upload.filename else ""
    if not upload.data:
        raise ImageRefused(f"{where}{name}: the file is empty; a PNG, JPEG or WebP image is expected", upload.field)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(upload.data))
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning, OSError,
            SyntaxError, ValueError) as e:
        if isinstance(e, Image.DecompressionBombError | Image.DecompressionBombWarning):
            found = re.search(r"\((\d+) pixels\)", str(e))
            size = f"{int(found.group(1))} pixels" if found else "more pixels than the decoder's own limit"
            raise ImageRefused(f"{where}{name}: {size}; an uploaded image may have at most {MAX_IMAGE_PIXELS} "
                               "(a decompression bomb is refused before it is decoded)", upload.field) from None
        known = _magic_format(upload.data)
        if known is not None:  # it starts like one of ours: the rest is missing or broken
            raise ImageRefused(f"{where}{name}: the {known} file is truncated or corrupt ({e}); send the whole file",
                               upload.field) from None
        raise ImageRefused(f"{where}{name}: not an image (a PNG, JPEG or WebP file is expected)", upload.field) from None
    if im.format not in FORMATS:
        raise ImageRefused(f"{where}{name}: {im.format} images are not accepted; send PNG, JPEG or WebP", upload.field)
    w, h = im.size
    if w * h > MAX_IMAGE_PIXELS:  # read from the header: refused before decoding a single pixel
        raise ImageRefused(f"{where}{name}: {w}x{h} is {w * h} pixels; an uploaded image may have at most "
                           f"{MAX_IMAGE_PIXELS}", upload.field)
    if w < 1 or h < 1:
        raise ImageRefused(f"{where}{name}: {w}x{h} has no pixels", upload.field)
    try:
        im.load()  # the whole file: a truncated one fails here (ImageFile.LOAD_TRUNCATED_IMAGES stays off)
        if getattr(im, "n_frames", 1) > 1:
            im.seek(0)
        rgb = im.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageRefused(f"{where}{name}: the {im.format} file is truncated or corrupt ({e}); send the whole file",
                           upload.field) from None
    return rgb


def _magic_format(data: bytes) -> str | None:
    """The accepted format ``data`` starts like (its signature), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def fit_reference(image: Image.Image, width: int, height: int) -> Image.Image:
    """``image`` at ``width`` x ``height``: scaled to cover it (aspect kept, Lanczos), then centre-cropped.

    Example:
        >>> fit_reference(Image.new("RGB", (200, 100)), 64, 64).size
        (64, 64)
    """
    w, h = image.size
    if (w, h) == (width, height):
        return image
    scale = max(width / w, height / h)
    sw, sh = max(width, round(w * scale)), max(height, round(h * scale))
    scaled = image.resize((sw, sh), Image.Resampling.LANCZOS)
    left, top = (sw - width) // 2, (sh - height) // 2
    return scaled.crop((left, top, left + width, top + height))
