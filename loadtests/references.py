"""The reference images the load test sends with templates that take them (image edits,
image-to-video): seeded noise of the template's reference size, one PNG per size (a module of its
own: the locustfile imports gevent's monkey-patching with locust)."""

from __future__ import annotations

import functools
import io


def reference_size(t: dict) -> tuple[int, int]:
    """(width, height) a template's references are encoded at (``/v1/templates``' ``reference_size``,
    else the output size: image-to-video's first frame)."""
    if t.get("reference_size"):
        w, h = str(t["reference_size"]).split("x")
        return int(w), int(h)
    return int(t["width"]), int(t["height"])


@functools.cache
def reference_png(width: int, height: int) -> bytes:
    """A seeded-noise PNG of ``width`` x ``height`` (one per size, reused by every request)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(width * 100003 + height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
