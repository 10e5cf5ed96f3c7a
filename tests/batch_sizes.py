"""One request's output at two batch sizes, as the tests compare it (docs/tenancy.md, "Seeds and
batching"). At one batch size a request's bytes are fixed, whoever shares its batch: tests assert
that with ``==``. Across batch sizes they are not: the CPU's matrix kernels (MKL, oneDNN; cuBLAS
on a GPU) block a batch of 2 otherwise than a batch of 1, so sums add in another order, and by
how much depends on the CPU's instruction set (AVX2, AVX-512). Tests compare such outputs as
pictures, within ``MEAN_ABS_BOUND``, never as bytes."""

from __future__ import annotations

import io
import os
import tempfile

import imageio.v2 as imageio
import numpy as np
from PIL import Image

#: the documented bound (docs/tenancy.md, "Seeds and batching"): mean absolute difference, in
#: 8-bit levels over every channel, pixel and frame, between one request's decoded outputs at two
#: batch sizes, at the tests' tiny-model shapes. Measured at most 0.10 on an AVX2 CPU
#: (tiny-cogvideox-i2v, whose random weights amplify rounding most; ATen's scalar kernels moved
#: it, not past that); another reference image or seed differs by 1.4 or more (tiny-flux2's
#: second image), so the bound still tells another picture from the same one.
MEAN_ABS_BOUND = 0.5


def decode_mp4(data: bytes) -> np.ndarray:
    """An MP4's frames as ``(frames, height, width, 3)`` uint8."""
    fd, path = tempfile.mkstemp(suffix=".mp4")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        with imageio.get_reader(path, format="ffmpeg") as reader:
            return np.stack([np.asarray(fr) for fr in reader])
    finally:
        os.unlink(path)


def pixels(data: bytes) -> np.ndarray:
    """A PNG's or an MP4's pixels as float64 (8-bit levels), to compare two outputs."""
    if data[4:8] == b"ftyp":
        return decode_mp4(data).astype(np.float64)
    return np.asarray(Image.open(io.BytesIO(data)), dtype=np.float64)


def mean_abs_difference(a: bytes, b: bytes) -> float:
    """Mean absolute difference of two outputs' pixels, in 8-bit levels."""
    pa, pb = pixels(a), pixels(b)
    if pa.shape != pb.shape:
        raise ValueError(f"outputs of different shapes: {pa.shape} vs {pb.shape}")
    return float(np.abs(pa - pb).mean())


def assert_same_picture_across_batch_sizes(a: bytes, b: bytes) -> float:
    """``a`` and ``b``, one request's outputs at two batch sizes, are the same picture within
    ``MEAN_ABS_BOUND``; returns their mean absolute difference."""
    diff = mean_abs_difference(a, b)
    assert diff <= MEAN_ABS_BOUND, f"mean absolute difference {diff:.3f} > {MEAN_ABS_BOUND} (8-bit levels)"
    return diff
