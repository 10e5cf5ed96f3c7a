"""CogVideoX-5B-I2V: CogVideoX-5B's image-to-video checkpoint (its own transformer, the same VAE and T5).

What differs from the text-to-video model (``THUDM/CogVideoX-5b-I2V``'s transformer config):

- the input image is encoded by the VAE (one latent frame, zero-padded over the clip) and
  concatenated with the noise on channels: ``in_channels`` 32 = 16 + 16, the output stays 16;
- learned positional embeddings, sized for its published shape (``sample_width`` 90 x
  ``sample_height`` 60 latents = 720x480, ``sample_frames`` 49): diffusers refuses any other
  resolution (``CogVideoXPatchEmbed``: "not possible to generate videos at a different
  resolution"), so this model serves 720x480 at up to 49 frames only, and says so for anything else.

Every template takes one reference (the first frame), encoded at the output size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from xema_ray.models.base import ModelSpec
from xema_ray.models.cogvideox import CogVideoXSpec
from xema_ray.models.references import ReferenceInputs
from xema_ray.models.text_encoders import EncoderChoice

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from xema_ray.parallel.plans import SPPlan

    from xema_ray.templates import RequestTemplate


class CogVideoXI2VSpec(CogVideoXSpec):
    """CogVideoX with the image-to-video transformer and pipeline."""

    def reference_inputs(self) -> ReferenceInputs:
        # the pipeline conditions every request on its first frame: a template without one is not servable
        return ReferenceInputs(self.name, self.spatial_multiple, max_references=1, required_references=1)
    def sequence_parallel_split(self) -> type[SPPlan] | None:
        return None  # untried: the SP split has not been checked with learned positional embeddings

    @property
    def published_layout(self) -> str:
        return "cogvideox-i2v"  # its own repository: model_index.json names the image-to-video pipeline

    @property
    def reference_sizes(self) -> tuple[tuple[int, int, int], ...]:  # type: ignore[override]
        w, h = self.published_size
        return ((w, h, int(self.transformer_config["sample_frames"])),)

    @property
    def published_size(self) -> tuple[int, int]:
        """(width, height) its learned positional embeddings are sized for."""
        cfg = self.transformer_config
        return cfg["sample_width"] * self.vae_scale_factor, cfg["sample_height"] * self.vae_scale_factor

    def validate_shape(self, height: int, width: int, frames: int) -> None:
        super().validate_shape(height, width, frames)
        w, h = self.published_size
        if (width, height) != (w, h):
            raise ValueError(f"{self.name} generates {w}x{h} only (its learned positional embeddings are sized for it), "
                             f"got {width}x{height}")
        most = int(self.transformer_config["sample_frames"])
        if frames > most:
            raise ValueError(f"{self.name} generates at most {most} frames (its positional embeddings), got {frames}")

    def latent_shape(self, t: RequestTemplate) -> tuple[int, ...]:
        f = self.vae_scale_factor  # the noise latent: the image latents join it on channels inside the pipeline
        return (t.batch, self.latent_frames(t), self.transformer_config["out_channels"], t.height // f, t.width // f)

    def pipeline_class(self) -> type[DiffusionPipeline]:
        from diffusers import CogVideoXImageToVideoPipeline

        return CogVideoXImageToVideoPipeline


#: the registered models of this spec (``xema_ray.models.get_model_spec``): T2V's VAE and T5
VARIANTS: dict[str, Callable[[], ModelSpec]] = {
    "cogvideox-5b-i2v": functools.partial(CogVideoXI2VSpec, "cogvideox-5b-i2v", "real", "cogvideox5b_i2v_transformer.json",
                                          "cogvideox5b_vae.json",
                                          encoder=EncoderChoice("t5", "cogvideox5b_text_encoder.json")),
    "tiny-cogvideox-i2v": functools.partial(CogVideoXI2VSpec, "tiny-cogvideox-i2v", "tiny",
                                            "tiny_cogvideox_i2v_transformer.json", "tiny_cogvideox_vae.json",
                                            encoder=EncoderChoice("t5", "tiny_cogvideox_text_encoder.json")),
}
