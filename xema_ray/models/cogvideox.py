"""CogVideoX-5B: 5.6 B-parameter video DiT (42 blocks), causal 3D VAE, classifier-free guidance."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from xema_ray.models.base import BuildOptions, ModelSpec
from xema_ray.models.text_encoders import EncoderChoice
from xema_ray.models.cost import BYTES, BlockCost

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from xema_ray.parallel.plans import SPPlan

    from xema_ray.templates import RequestTemplate

# CogVideoXDDIMScheduler config published with CogVideoX-5b (used when a weights directory has no
# scheduler/scheduler_config.json: random weights, tiny checkpoints). DDIM keeps no state across
# steps, so every denoising step allocates the same pattern (the analyzer replicates one step).
SCHEDULER_CONFIG: dict[str, Any] = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "set_alpha_to_one": True,
    "snr_shift_scale": 1.0,
    "steps_offset": 0,
    "timestep_spacing": "trailing",
}


def unsplit_safe_convs(vae: nn.Module) -> int:
    """Run diffusers' ``CogVideoXSafeConv3d`` layers as the plain ``Conv3d`` they wrap.

    SafeConv3d splits an input above 2 GiB along time into ``int(GiB / 2) + 1`` pieces; the VAE
    decodes 2–3 latent frames at a time, so from 1080p up (and at 720p with batch 2) the pieces
    are shorter than the 3-frame kernel and the convolution fails, on GPUs as well. Below 2 GiB it
    never splits. So for every shape we serve it either does nothing or fails; the plain
    convolution computes the same output, and memory for large decodes is what VAE chunking is
    for. Patched per instance: other diffusers users in the process are unaffected.
    Returns how many layers were patched.
    """
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXSafeConv3d

    n = 0
    for module in vae.modules():
        if isinstance(module, CogVideoXSafeConv3d):
            module.forward = types.MethodType(nn.Conv3d.forward, module)  # type: ignore[method-assign]
            n += 1
    return n


class CogVideoXSpec(ModelSpec):
    family = "cogvideox"
    kind = "video"
    #: its causal 3D VAE's conv caches can move to the host (activation offload)
    offloadable_conv_caches = True

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config["block_out_channels"]) - 1)

    @property
    def spatial_multiple(self) -> int:
        # latent = pixels / 8, then 2x2 patches: the latent size must be even
        return self.vae_scale_factor * self.transformer_config["patch_size"]

    @property
    def temporal_compression(self) -> int:
        return int(self.vae_config["temporal_compression_ratio"])

    @property
    def text_tokens(self) -> int:
        return int(self.transformer_config["max_text_seq_length"])

    def latent_frames(self, t: RequestTemplate) -> int:
        return (t.frames - 1) // self.temporal_compression + 1

    def latent_shape(self, t: RequestTemplate) -> tuple[int, ...]:
        f = self.vae_scale_factor
        return (t.batch, self.latent_frames(t), self.transformer_config["in_channels"], t.height // f, t.width // f)

    def token_counts(self, t: RequestTemplate) -> dict[str, int]:
        m = self.spatial_multiple
        return {"video": self.latent_frames(t) * (t.height // m) * (t.width // m), "text": self.text_tokens}

    def transformer_class(self) -> type[nn.Module]:
        from diffusers import CogVideoXTransformer3DModel

        return CogVideoXTransformer3DModel

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLCogVideoX

        return AutoencoderKLCogVideoX

    def pipeline_class(self) -> type[DiffusionPipeline]:
        """The diffusers pipeline over this spec's components (image-to-video overrides it)."""
        from diffusers import CogVideoXPipeline

        return CogVideoXPipeline

    @property
    def hands_over_latents(self) -> bool:
        return True

    def decode_latents(self, pipe: Any, latents: torch.Tensor) -> Any:
        """The pipeline's own decode after its loop: bit-exact with ``output_type="np"`` (the 1.0
        models this spec builds pad no latent frames: no ``patch_size_t``)."""
        with torch.no_grad():
            video = pipe.decode_latents(latents)
            return pipe.video_processor.postprocess_video(video=video, output_type="np")

    def build_pipeline(self, opts: BuildOptions) -> DiffusionPipeline:
        from diffusers import CogVideoXDDIMScheduler

        text_encoder, tokenizer = self.build_text_encoder(opts)
        vae = self.build_vae(opts)
        unsplit_safe_convs(vae)
        pipe = self.pipeline_class()(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=vae,
            transformer=self.build_transformer(opts),
            scheduler=self.scheduler(CogVideoXDDIMScheduler, SCHEDULER_CONFIG, opts),
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def prompt_embeddings(
        self, prompts: list[str], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        shape = (1, self.text_tokens, self.transformer_config["text_embed_dim"])
        pos = torch.cat([self.seeded_embedding(p, shape, device, dtype) for p in prompts])
        # the negative prompt is the empty string, as in the pipeline's default
        neg = torch.cat([self.seeded_embedding("", shape, device, dtype, salt="negative")] * len(prompts))
        return {"prompt_embeds": pos, "negative_prompt_embeds": neg}

    def encode_prompts(self, pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """T5 embeddings of the prompts and of the empty negative prompt (the pipeline's default)."""
        pos, neg = pipe.encode_prompt(prompt=prompts, negative_prompt=None, do_classifier_free_guidance=True,
                                      max_sequence_length=self.text_tokens, device=device, dtype=dtype)
        return {"prompt_embeds": pos, "negative_prompt_embeds": neg}

    def prompt_token_count(self, tokenizer: Any, prompt: str) -> int:
        return len(tokenizer(prompt, add_special_tokens=True).input_ids)

    @property
    def default_guidance_scale(self) -> float:
        return 6.0

    def call_kwargs(self, t: RequestTemplate, guidance_scale: float | None = None) -> dict[str, Any]:
        return {
            "height": t.height,
            "width": t.width,
            "num_frames": t.frames,
            "num_inference_steps": t.steps,
            "guidance_scale": self.default_guidance_scale if guidance_scale is None else guidance_scale,
            "max_sequence_length": self.text_tokens,
        }

    def dit_blocks(self, transformer: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(f"transformer_blocks.{i}", b) for i, b in enumerate(transformer.transformer_blocks)]

    def sequence_parallel_split(self) -> type[SPPlan] | None:
        from xema_ray.parallel.plans import CogVideoXPlan

        return CogVideoXPlan

    def block_work(self, t: RequestTemplate, rows: int) -> list[BlockCost]:
        """Per block: attention and MLP over the joint video + text sequence (12 d^2), and two
        LayerNormZero modulations whose weights are read but do no per-token work."""
        cfg = self.transformer_config
        tokens = self.token_counts(t)
        d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        s = tokens["video"] + tokens["text"]
        params = 12 * d * d
        adaln = 2 * cfg["time_embed_dim"] * 6 * d  # two LayerNormZero modulations (weights only)
        return [BlockCost(f"block.{i}", 2 * params * s * rows, 4 * s * s * d * rows, (params + adaln) * BYTES, [(s, d)])
                for i in range(cfg["num_layers"])]


#: the registered models of this spec (``xema_ray.models.get_model_spec``)
VARIANTS: dict[str, Callable[[], ModelSpec]] = {
    "cogvideox-5b": functools.partial(CogVideoXSpec, "cogvideox-5b", "real", "cogvideox5b_transformer.json",
                                      "cogvideox5b_vae.json", encoder=EncoderChoice("t5", "cogvideox5b_text_encoder.json")),
    "tiny-cogvideox": functools.partial(CogVideoXSpec, "tiny-cogvideox", "tiny", "tiny_cogvideox_transformer.json",
                                        "tiny_cogvideox_vae.json",
                                        encoder=EncoderChoice("t5", "tiny_cogvideox_text_encoder.json")),
}
