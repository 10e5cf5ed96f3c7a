"""What an emulated worker returns: valid PNG / MP4 files of the requested size and frame count,
visibly marked as emulated (a banner and a stripe pattern, never mistaken for a model's output).

The pictures depend only on the template, so a worker renders each template once and reuses the
bytes (``EmulatedMedia``); the MP4 is encoded with x264's fastest preset because its cost is the
worker's own overhead, not part of the emulated GPU time.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading

import numpy as np

BANNER = "EMULATED - no model ran"


def _frame(width: int, height: int, title: str, fraction: float | None = None) -> np.ndarray:
    """One ``[H, W, 3]`` uint8 frame: diagonal stripes, the banner, and (videos) a frame bar."""
    from PIL import Image, ImageDraw

    y, x = np.mgrid[0:height, 0:width]
    stripes = ((x + y) // 32) % 2
    img = np.where(stripes[..., None] == 1, np.uint8(200), np.uint8(90)).astype(np.uint8).repeat(3, axis=2)
    img[..., 0] = np.where(stripes == 1, 230, 120)  # an orange-grey pattern no model produces
    pil = Image.fromarray(img, mode="RGB")
    draw = ImageDraw.Draw(pil)
    band = max(12, height // 8)
    top = (height - band) // 2
    draw.rectangle([0, top, width, top + band], fill=(0, 0, 0))
    draw.text((8, top + band // 4), f"{BANNER} | {title}", fill=(255, 255, 0))
    if fraction is not None:
        draw.rectangle([0, height - max(2, height // 40), int(width * fraction), height], fill=(255, 255, 0))
    return np.asarray(pil)


def render_png(width: int, height: int, title: str) -> bytes:
    """An emulated image as PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(_frame(width, height, title), mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def render_mp4(width: int, height: int, frames: int, fps: float, title: str) -> bytes:
    """An emulated video as H.264 MP4 bytes (yuv420p: ``width`` and ``height`` must be even)."""
    if width % 2 or height % 2:
        raise ValueError(f"H.264 yuv420p needs even sizes, got {width}x{height}")
    import imageio_ffmpeg

    base = _frame(width, height, title, 0.0)
    bar = max(2, height // 40)
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = imageio_ffmpeg.write_frames(path, (width, height), fps=fps, codec="libx264", pix_fmt_out="yuv420p",
                                             macro_block_size=2, ffmpeg_log_level="error",
                                             output_params=["-preset", "ultrafast", "-threads", "1"])
        writer.send(None)
        for i in range(frames):
            f = base.copy()
            f[height - bar:, : int(width * (i + 1) / frames)] = (255, 255, 0)  # the frame counter bar
            writer.send(np.ascontiguousarray(f))
        writer.close()
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)


class EmulatedMedia:
    """Rendered outputs per template, made once (thread-safe: batches run on threads of their own)."""

    def __init__(self) -> None:
        self._done: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str, width: int, height: int, frames: int, fps: float, video: bool) -> bytes:
        with self._lock:
            if key not in self._done:
                self._done[key] = (render_mp4(width, height, frames, fps, key) if video
                                   else render_png(width, height, key))
            return self._done[key]
