"""Wan2.2 image-to-video: Wan2.2-I2V-A14B (two experts over 36 input channels) and the first-frame
path of Wan2.2-TI2V-5B, both through diffusers' ``WanImageToVideoPipeline``.

The two ways the pipeline conditions on the first frame (``prepare_latents``):

- **I2V-A14B** (``expand_timesteps=False``): the image followed by ``frames - 1`` black frames is
  encoded by the Wan2.1 VAE at the output size (a whole video's encode), and its 16 latent channels
  join the 16 noise channels with 4 mask channels (1 where a pixel frame is given: latent frame 0's
  four) on the channel axis: the transformer's ``in_channels`` is 36. No CLIP image encoder in 2.2
  (``image_encoder=None``, the transformer's ``image_dim`` is None).
- **TI2V-5B** (``expand_timesteps=True``): only the image is encoded (one latent frame), and it
  replaces latent frame 0 before every transformer call through a mask, which also zeroes that
  frame's per-token timesteps. The transformer is the text-to-video one: the same weights serve
  both, so TI2V-5B's image-to-video runs a twin pipeline over the text-to-video pipeline's own
  modules (``image_to_video_pipeline``; LTX-2 does the same).

diffusers' ``prepare_latents`` serves one image repeated over the batch: given a batch of images it
encodes all of them once per generator (or once, repeated ``batch`` times), which makes ``batch²``
rows. ``WanI2VPipeline`` encodes each request's first frame for its own row, one at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from diffusers import WanImageToVideoPipeline

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

#: where ``image_to_video_pipeline`` keeps a text-to-video pipeline's image-to-video twin
_I2V_ATTR = "_xema_image_to_video"


class WanI2VPipeline(WanImageToVideoPipeline):
    """``WanImageToVideoPipeline`` whose first frames are each request's own (one per batch row)."""

    def check_inputs(self, prompt: Any, negative_prompt: Any, image: Any, *args: Any, **kwargs: Any) -> None:
        # one first frame per request: a list of PIL images, which the pipeline's preprocessing
        # takes as a batch (its check accepts one image or a tensor only)
        if isinstance(image, list) and image:
            image = image[0]
        super().check_inputs(prompt, negative_prompt, image, *args, **kwargs)

    def _get_t5_prompt_embeds(self, *args: Any, max_sequence_length: int = 512, **kwargs: Any) -> torch.Tensor:
        # diffusers' image-to-video module cleans prompts with ftfy whether or not it is installed
        # (a NameError without it; it is not a dependency here); the text-to-video module's own
        # function is the same code with that guarded, so the prompt is cleaned alike in both
        from diffusers import WanPipeline

        return WanPipeline._get_t5_prompt_embeds(self, *args, max_sequence_length=max_sequence_length,  # type: ignore[arg-type]
                                                 **kwargs)

    def prepare_latents(  # type: ignore[override]
        self, image: torch.Tensor, batch_size: int, num_channels_latents: int = 16, height: int = 480,
        width: int = 832, num_frames: int = 81, dtype: torch.dtype | None = None, device: torch.device | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None, latents: torch.Tensor | None = None,
        last_image: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """diffusers' own, row by row: row ``b`` takes image ``b`` (encoded alone: the VAE's peak is
        one request's whatever the batch) and generator ``b``; one image is repeated over the batch
        as diffusers does. The noise is what diffusers draws for a list of generators."""
        if image.shape[0] == 1:
            return super().prepare_latents(image, batch_size, num_channels_latents, height, width, num_frames, dtype,
                                           device, generator, latents, last_image)
        if image.shape[0] != batch_size:
            raise ValueError(f"{image.shape[0]} first frames for a batch of {batch_size}: one per request")
        rows = [super(WanI2VPipeline, self).prepare_latents(
            image[b:b + 1], 1, num_channels_latents, height, width, num_frames, dtype, device,
            [generator[b]] if isinstance(generator, list) else generator,
            None if latents is None else latents[b:b + 1], None if last_image is None else last_image[b:b + 1])
            for b in range(batch_size)]
        out = [torch.cat([r[i] for r in rows]) for i in (0, 1)]  # latents; the condition (with its mask)
        if self.config.expand_timesteps:  # the first-frame mask is the same for every row
            out.append(rows[0][2])
        del rows
        return tuple(out)


def image_to_video_pipeline(pipe: DiffusionPipeline) -> WanI2VPipeline:
    """``WanI2VPipeline`` over a text-to-video ``WanPipeline``'s own modules and configuration (made
    once per ``pipe``; no weight is loaded twice): TI2V-5B's first-frame path."""
    i2v = pipe.__dict__.get(_I2V_ATTR)
    if i2v is None:
        i2v = WanI2VPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                             scheduler=pipe.scheduler, transformer=pipe.transformer,
                             transformer_2=pipe.transformer_2, boundary_ratio=pipe.config.boundary_ratio,
                             expand_timesteps=pipe.config.expand_timesteps)
        i2v.set_progress_bar_config(disable=True)
        pipe.__dict__[_I2V_ATTR] = i2v  # a plain attribute: not a pipeline component
    return i2v
