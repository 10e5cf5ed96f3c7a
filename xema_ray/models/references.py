"""What a model says about reference images (``RequestTemplate.references``): how many a request
may bring, at what size they are encoded, how they reach its pipeline. A spec returns its
``ReferenceInputs`` (``ModelSpec.reference_inputs``); a model that takes none returns the
defaults (``max_references = 0``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xema_ray.templates import RequestTemplate


@dataclass(frozen=True)
class ReferenceInputs:
    """A model's reference-image handling: its limits, the check of a template against them, the
    frames its VAE encodes per reference and the pipeline kwargs that carry them."""

    #: the model's registry name (for messages)
    model: str
    #: the model's height and width multiple (``ModelSpec.spatial_multiple``): a reference's too
    spatial_multiple: int
    #: most reference images one request may condition on (0: the model takes none; Flux.2
    #: appends each reference's tokens to the sequence, an image-to-video model takes one: the
    #: first frame, encoded by the VAE)
    max_references: int = 0
    #: whether references are encoded at the output size (image-to-video: the first frame) or
    #: at a size of the template's own (Flux.2 edits)
    references_at_output_size: bool = True
    #: largest reference the pipeline encodes as given (pixels; Flux.2's pipeline shrinks a
    #: larger one to 1024², so a template's reference size stays within it)
    max_reference_pixels: int = 1024 * 1024
    #: references every template of the model takes (an image-to-video-only model: 1)
    required_references: int = 0
    #: the VAE encodes a reference as the first of the template's frames, the rest black (Wan2.2
    #: A14B image-to-video); else as one frame
    encodes_whole_video: bool = False

    def validate(self, t: RequestTemplate) -> None:
        """Raise ValueError naming what is wrong with ``t``'s reference images and what is accepted."""
        if t.references < self.required_references:
            raise ValueError(f"{self.model} is image-to-video: its templates take references={self.required_references} "
                             f"(the first frame), got {t.references}")
        if not t.references:
            return
        if not self.max_references:
            raise ValueError(f"{self.model} takes no reference images (references must be 0, got {t.references})")
        if t.references > self.max_references:
            raise ValueError(f"{self.model} takes at most {self.max_references} reference image(s), got {t.references}")
        rw, rh = t.reference_width, t.reference_height
        if self.references_at_output_size and (rw, rh) != (t.width, t.height):
            raise ValueError(f"{self.model} encodes its reference at the output size {t.width}x{t.height}, "
                             f"got {rw}x{rh}")
        m = self.spatial_multiple
        if rw % m or rh % m:
            raise ValueError(f"{self.model}: reference width and height must be multiples of {m}, got {rw}x{rh}")
        if rw * rh > self.max_reference_pixels:
            raise ValueError(f"{self.model}: a reference may have at most {self.max_reference_pixels} pixels "
                             f"({rw}x{rh} has {rw * rh})")

    def encode_frames(self, t: RequestTemplate) -> int:
        """Frames the VAE encodes per reference (the cost model's encode): 1, an image — a video
        VAE encodes an image-to-video first frame as a one-frame video — or, where the pipeline
        pads the first frame to the whole video, ``t.frames``."""
        return t.frames if self.encodes_whole_video else 1

    def kwargs(self, t: RequestTemplate, images: Sequence[Sequence[Any]] | None = None,
               rows: int | None = None) -> dict[str, Any]:
        """Pipeline kwargs carrying each request's reference images: ``images[b]`` are request
        b's PIL images, already at the template's reference size; None: mid-grey placeholders
        of that size for ``rows`` requests (default ``t.batch``; the analyzer and ``xema verify``:
        only shapes count). Empty for a template without references.

        Raises:
            ValueError: a request brings another number of references, or another size."""
        if not t.references:
            return {}
        from PIL import Image

        size = (t.reference_width, t.reference_height)
        if images is None:
            images = [[Image.new("RGB", size, (128, 128, 128)) for _ in range(t.references)] for _ in range(rows or t.batch)]
        for refs in images:
            if len(refs) != t.references or any(im.size != size for im in refs):
                raise ValueError(f"template {t.shape_key} takes {t.references} reference(s) of {size[0]}x{size[1]}, "
                                 f"got {[im.size for im in refs]}")
        # one flat list, request by request: the pipeline's batch rows take theirs in order
        return {"image": [im for refs in images for im in refs]}
