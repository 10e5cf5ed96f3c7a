"""LTX-2 image-to-video: diffusers' ``LTX2ImageToVideoPipeline`` over the text-to-video pipeline's
own components (one model loaded, two pipelines), each request's first frame prepared as LTX-2
was trained (H.264 at CRF 33), and the shim that lets the conditioning path run on meta.

The image is encoded by the video VAE at the output size into the first latent frame, which the
conditioning mask keeps clean while the rest is denoised; a request's image is its own (the
pipeline encodes one per batch row with that row's generator).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xema_ray.models.references import ReferenceInputs

if TYPE_CHECKING:
    from xema_ray.templates import RequestTemplate

#: where ``image_to_video_pipeline`` keeps a pipeline's image-to-video twin
_I2V_ATTR = "_xema_image_to_video"


def image_to_video_pipeline(pipe: Any) -> Any:
    """``LTX2ImageToVideoPipeline`` over ``pipe``'s own components (made once per ``pipe``; its
    ``__call__`` takes every kwarg ``LTX2Pipeline``'s does, plus ``image`` and ``image_crf``)."""
    i2v = pipe.__dict__.get(_I2V_ATTR)
    if i2v is None:
        from diffusers import LTX2ImageToVideoPipeline

        i2v = LTX2ImageToVideoPipeline(scheduler=pipe.scheduler, vae=pipe.vae, audio_vae=pipe.audio_vae,
                                       text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer,
                                       connectors=pipe.connectors, transformer=pipe.transformer, vocoder=pipe.vocoder)
        i2v.set_progress_bar_config(disable=True)
        pipe.__dict__[_I2V_ATTR] = i2v  # a plain attribute: not a pipeline component
    return i2v


class FirstFrameReferences(ReferenceInputs):
    """LTX-2's reference: the first frame, handed to its image-to-video pipeline as that pipeline
    takes it (``first_frames``)."""

    def kwargs(self, t: RequestTemplate, images: Any = None, rows: int | None = None) -> dict[str, Any]:
        return first_frames(super().kwargs(t, images, rows), images is not None)


def first_frames(kwargs: dict[str, Any], real: bool) -> dict[str, Any]:
    """The pipeline kwargs of each request's first frame: recompressed at the CRF LTX-2 was trained
    with when they are real images (the pipeline does this only for a single PIL image; done here
    per request, ``image_crf=0`` then skips the pipeline's own). Placeholders (the analyzer's)
    are passed as they are: the recompression happens on the host and allocates nothing on the device."""
    if not kwargs:
        return kwargs
    if real:
        from diffusers.pipelines.ltx2.utils import DEFAULT_IMAGE_CRF

        kwargs = {**kwargs, "image": [recompress_h264(im, DEFAULT_IMAGE_CRF) for im in kwargs["image"]]}
    return {**kwargs, "image_crf": 0}


def recompress_h264(image: Any, crf: int) -> Any:
    """``image`` (PIL) through one H.264 frame at ``crf`` and back: diffusers'
    ``apply_image_conditioning_crf``, through imageio-ffmpeg (a dependency already) instead of PyAV."""
    import imageio_ffmpeg
    import numpy as np
    from PIL import Image

    rgb = np.asarray(image.convert("RGB"))
    h, w = rgb.shape[0] // 2 * 2, rgb.shape[1] // 2 * 2
    rgb = np.ascontiguousarray(rgb[:h, :w])
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = imageio_ffmpeg.write_frames(path, (w, h), fps=1, codec="libx264", pix_fmt_out="yuv420p",
                                             macro_block_size=2, ffmpeg_log_level="error",
                                             output_params=["-crf", str(crf), "-preset", "veryfast", "-threads", "1"])
        writer.send(None)
        writer.send(rgb)
        writer.close()
        reader = imageio_ffmpeg.read_frames(path, output_params=["-threads", "1"])
        meta = next(reader)
        frame = next(reader)
        reader.close()
        fw, fh = meta["size"]
        return Image.fromarray(np.frombuffer(frame, dtype=np.uint8).reshape(fh, fw, 3).copy())
    finally:
        os.unlink(path)


class _HostOperandsOnMeta(TorchDispatchMode):
    """Ops mixing meta tensors with (non-scalar) host tensors run with the host ones on meta."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(a.device.type == "meta" for a in tensors) and any(a.device.type == "cpu" and a.dim() for a in tensors):
            args = tuple(a.to("meta") if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() else a
                         for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_operands_on_meta() -> Iterator[None]:
    """Image-to-video scales the timestep by the conditioning mask in the pipeline itself
    (``timestep.unsqueeze(-1) * (1 - conditioning_mask)``): on a GPU both are on the device, on
    meta the timestep stays on the host (the analyzer keeps the scheduler there), so the host
    operand of such an op moves to meta first (below the tracer: the move is not counted, as on
    the GPU where it never happens); the op allocates what it allocates."""
    with _HostOperandsOnMeta():
        yield
