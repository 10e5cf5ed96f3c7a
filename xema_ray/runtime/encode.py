"""Pixels to bytes: PNG for images, MP4 (H.264 via imageio-ffmpeg) for videos, WAV for LTX-2's
sound track. Every encoder is deterministic: the same frames give the same bytes (no encoder
timestamps or metadata, single-threaded x264), which is what makes a seeded request reproducible
end to end."""

from __future__ import annotations

import io
import os
import tempfile
import wave

import numpy as np

#: x264/muxer flags that keep the output byte-identical across runs: no version string or
#: creation time in the container, no metadata copied, one thread (frame-threaded x264 is
#: deterministic too, but one thread removes the question for tiny test videos).
_BITEXACT = ["-fflags", "+bitexact", "-flags:v", "+bitexact", "-map_metadata", "-1", "-threads", "1"]


def to_uint8(x: np.ndarray) -> np.ndarray:
    """Float pixels in [0, 1] to uint8 (round half up, clipped)."""
    if x.dtype == np.uint8:
        return x
    return np.clip(np.floor(x.astype(np.float64) * 255.0 + 0.5), 0, 255).astype(np.uint8)


def encode_png(image: np.ndarray) -> bytes:
    """One ``[H, W, 3]`` image (float in [0, 1] or uint8) as PNG bytes."""
    from PIL import Image

    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"encode_png expects [H, W, 3], got shape {image.shape}")
    buf = io.BytesIO()
    Image.fromarray(to_uint8(image), mode="RGB").save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """``[F, H, W, 3]`` frames as an H.264 MP4 (yuv420p, so H and W must be even).

    imageio-ffmpeg writes to a path, so the video goes through a temporary file."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"encode_mp4 expects [F, H, W, 3], got shape {frames.shape}")
    _, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"H.264 yuv420p needs even sizes, got {w}x{h}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    import imageio_ffmpeg

    data = to_uint8(frames)
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = imageio_ffmpeg.write_frames(
            path,
            (w, h),
            fps=fps,
            codec="libx264",
            pix_fmt_out="yuv420p",
            macro_block_size=2,  # keep the requested size; only evenness is required
            ffmpeg_log_level="error",
            output_params=_BITEXACT,
        )
        writer.send(None)  # start the generator
        for frame in data:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def encode_wav(audio: np.ndarray, sample_rate: int) -> bytes:
    """``[channels, samples]`` float audio in [-1, 1] as 16-bit PCM WAV."""
    if audio.ndim != 2:
        raise ValueError(f"encode_wav expects [channels, samples], got shape {audio.shape}")
    pcm = np.clip(np.round(audio.astype(np.float64) * 32767.0), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(audio.shape[0])
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(np.ascontiguousarray(pcm.T).tobytes())
    return buf.getvalue()
