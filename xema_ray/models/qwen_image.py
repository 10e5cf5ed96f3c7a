"""Qwen-Image: a 20 B MMDiT image model (60 blocks) with a 7 B vision-language text encoder.

The text encoder is Qwen2.5-VL-7B (8.3 B parameters with its vision tower, 16.6 GB in bf16):
its last hidden state, without the system prompt's tokens, is the prompt embedding. The
pipeline runs true classifier-free guidance as two transformer calls per step (the prompt, then
the negative prompt), and decodes with a one-frame causal 3D VAE (8x spatial compression).

Prompt embeddings are as long as the prompt (the pipeline trims them to the real tokens), which
a template-static plan cannot take: this spec pads them to ``text_tokens`` (512, the pipeline's
``max_sequence_length``) with a zero mask, so every request of a template runs the same shapes;
the transformer masks the padding, so the image is the one the unpadded prompt gives.

Configs: ``qwen_image_transformer.json``, ``qwen_image_vae.json``, ``qwen_image_text_encoder.json``
(and ``tiny_`` versions); the scheduler is the published ``scheduler/scheduler_config.json``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from xema_ray.models.options import OptionRules
from xema_ray.models.base import BuildOptions, ModelSize, ModelSpec
from xema_ray.models.text_encoders import EncoderChoice
from xema_ray.models.cost import BlockCost

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from xema_ray.templates import RequestTemplate

#: Qwen/Qwen-Image scheduler/scheduler_config.json (resolution-dependent exponential shift)
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}

#: true CFG scale of the Qwen team's example (a negative prompt of one space enables it)
TRUE_CFG_SCALE = 4.0
NEGATIVE_PROMPT = " "


class QwenImageSpec(ModelSpec):
    """Qwen-Image text-to-image, real size or tiny.

    Example:
        >>> from xema_ray.models import get_model_spec
        >>> spec = get_model_spec("qwen-image")
        >>> spec.spatial_multiple, spec.kind, spec.text_tokens
        (16, 'image', 512)
    """

    family = "qwen-image"
    kind = "image"

    def __init__(self, name: str, size: ModelSize, transformer_config: str, vae_config: str, text_tokens: int,
                 encoder: EncoderChoice | None = None) -> None:
        super().__init__(name, size, transformer_config, vae_config, encoder)
        self.text_tokens = text_tokens
        if size == "real":  # the Qwen team's 16:9 and 1:1 sizes, 50 steps
            self.reference_sizes = ((1664, 928, 1), (1328, 1328, 1))
            self.reference_steps = 50
        else:
            self.reference_sizes = ((64, 64, 1), (128, 128, 1))
            self.reference_steps = 4

    # ------------------------------------------------------------------ shapes
    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.vae_config["temperal_downsample"])

    @property
    def spatial_multiple(self) -> int:
        return self.vae_scale_factor * int(self.transformer_config["patch_size"])

    def latent_shape(self, t: RequestTemplate) -> tuple[int, ...]:
        m = self.spatial_multiple
        return (t.batch, (t.height // m) * (t.width // m), int(self.transformer_config["in_channels"]))

    def token_counts(self, t: RequestTemplate) -> dict[str, int]:
        m = self.spatial_multiple
        return {"image": (t.height // m) * (t.width // m), "text": self.text_tokens}

    # ------------------------------------------------------------------ builders
    def transformer_class(self) -> type[nn.Module]:
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLQwenImage

        return AutoencoderKLQwenImage

    def build_pipeline(self, opts: BuildOptions) -> DiffusionPipeline:
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        text_encoder, tokenizer = self.build_text_encoder(opts)
        pipe = QwenImagePipeline(
            scheduler=self.scheduler(FlowMatchEulerDiscreteScheduler, SCHEDULER_CONFIG, opts),
            vae=self.build_vae(opts),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=self.build_transformer(opts),
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ------------------------------------------------------------------ calling the pipeline
    def _padded(self, embeds: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings and mask padded (or cut) to ``text_tokens``: one shape per template."""
        b, n, d = embeds.shape
        if mask is None:
            mask = torch.ones(b, n, dtype=torch.long, device=embeds.device)
        if n >= self.text_tokens:
            return embeds[:, :self.text_tokens], mask[:, :self.text_tokens]
        pad = self.text_tokens - n
        return (torch.cat([embeds, embeds.new_zeros(b, pad, d)], dim=1),
                torch.cat([mask, mask.new_zeros(b, pad)], dim=1))

    def prompt_embeddings(
        self, prompts: list[str], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        shape = (1, self.text_tokens, int(self.transformer_config["joint_attention_dim"]))
        pos = torch.cat([self.seeded_embedding(p, shape, device, dtype) for p in prompts])
        neg = torch.cat([self.seeded_embedding(NEGATIVE_PROMPT, shape, device, dtype, salt="negative")] * len(prompts))
        ones = torch.ones(len(prompts), self.text_tokens, dtype=torch.long, device=device)
        return {"prompt_embeds": pos, "prompt_embeds_mask": ones,
                "negative_prompt_embeds": neg, "negative_prompt_embeds_mask": ones.clone()}

    def encode_prompts(self, pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL embeddings of the prompts and of the one-space negative prompt, padded (on meta
        under the shims that read no values: the planner traces encoding on its own)."""
        with _meta_masks_all_ones() if torch.device(device).type == "meta" else contextlib.nullcontext():
            pos, pos_mask = pipe.encode_prompt(prompt=prompts, device=device, max_sequence_length=self.text_tokens)
            neg, neg_mask = pipe.encode_prompt(prompt=[NEGATIVE_PROMPT] * len(prompts), device=device,
                                               max_sequence_length=self.text_tokens)
        pos, pos_mask = self._padded(pos.to(dtype), pos_mask)
        neg, neg_mask = self._padded(neg.to(dtype), neg_mask)
        return {"prompt_embeds": pos, "prompt_embeds_mask": pos_mask,
                "negative_prompt_embeds": neg, "negative_prompt_embeds_mask": neg_mask}

    def prompt_token_count(self, tokenizer: Any, prompt: str) -> int:
        return len(tokenizer(prompt).input_ids)

    @property
    def default_guidance_scale(self) -> float:
        return TRUE_CFG_SCALE

    def transformer_passes_per_step(self) -> tuple[int, ...]:
        return (1, 1)  # true CFG runs the prompt and the negative prompt as two calls, not one doubled batch

    def option_rules(self) -> OptionRules:
        # QwenImagePipeline's true_cfg_scale: guidance_scale is the same value here (the base model
        # is not guidance-distilled; the pipeline ignores its own guidance_scale)
        return OptionRules(negative_prompt=True, true_cfg_scale=True,
                           guidance_note="the true classifier-free guidance scale; true CFG runs when > 1")

    def call_kwargs(self, t: RequestTemplate, guidance_scale: float | None = None) -> dict[str, Any]:
        return {
            "height": t.height,
            "width": t.width,
            "num_inference_steps": t.steps,
            "true_cfg_scale": self.default_guidance_scale if guidance_scale is None else guidance_scale,
            "max_sequence_length": self.text_tokens,
        }

    def tracing_shims(self, t: RequestTemplate) -> contextlib.AbstractContextManager[None]:
        """``encode_prompt`` drops a mask that is all ones (``mask.all()``, a value meta tensors
        cannot give): on meta a mask is taken to be the stand-in embeddings' all-ones mask, and
        dropped as the pipeline drops it (a real encoder's padded prompt keeps its mask)."""
        return _meta_masks_all_ones()

    def dit_blocks(self, transformer: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(f"transformer_blocks.{i}", b) for i, b in enumerate(transformer.transformer_blocks)]

    def vae_decoder_levels(self) -> tuple[list[int], list[int]]:
        cfg = self.vae_config
        chans = [int(cfg["base_dim"]) * int(m) for m in reversed(cfg["dim_mult"])]
        return chans, [int(cfg["num_res_blocks"]) + 1] * len(chans)

    def block_work(self, t: RequestTemplate, rows: int) -> list[BlockCost]:
        """Per MMDiT block of one pass over ``rows`` rows: image and text streams, each with
        q k v o and a 4x GELU MLP (12 d^2) and a 6-way modulation (6 d^2), joint attention."""
        cfg = self.transformer_config
        d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
        tokens = self.token_counts(t)
        s = tokens["image"] + tokens["text"]
        params = 2 * (12 * d * d + 6 * d * d)
        linear = 2 * 12 * d * d * s * rows
        attention = 4 * s * s * d * rows
        return [BlockCost(f"block.{i}", float(linear), float(attention), float(params * 2), [(s, d)])
                for i in range(self.num_dit_blocks)]


@contextlib.contextmanager
def _meta_masks_all_ones() -> Iterator[None]:
    from diffusers import QwenImagePipeline

    original = QwenImagePipeline.encode_prompt

    def encode_prompt(self: Any, *args: Any, prompt_embeds_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if prompt_embeds_mask is not None and prompt_embeds_mask.device.type == "meta":
            prompt_embeds_mask = None  # what the pipeline makes of an all-ones mask
        return original(self, *args, prompt_embeds_mask=prompt_embeds_mask, **kwargs)

    original_extract = QwenImagePipeline._extract_masked_hidden

    def extract(self: Any, hidden_states: torch.Tensor, mask: torch.Tensor) -> Any:
        if hidden_states.device.type != "meta":
            return original_extract(self, hidden_states, mask)
        # ``hidden_states[mask]`` needs the mask's values: a prompt padded to the longest of its
        # batch has none for one prompt, so the selection copies every row, as this does
        selected = hidden_states.reshape(-1, hidden_states.shape[-1]).clone()
        return torch.split(selected, [hidden_states.shape[1]] * hidden_states.shape[0], dim=0)

    original_embeds = QwenImagePipeline._get_qwen_prompt_embeds

    def embeds(self: Any, *args: Any, **kwargs: Any) -> Any:
        out, mask = original_embeds(self, *args, **kwargs)
        return (out, None) if out.device.type == "meta" else (out, mask)  # one unpadded prompt: all ones

    saved = {"encode_prompt": original, "_extract_masked_hidden": original_extract, "_get_qwen_prompt_embeds": original_embeds}
    for name, f in (("encode_prompt", encode_prompt), ("_extract_masked_hidden", extract), ("_get_qwen_prompt_embeds", embeds)):
        setattr(QwenImagePipeline, name, f)
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(QwenImagePipeline, name, f)


#: the registered models of this spec (``xema_ray.models.get_model_spec``); no sequence-parallel
#: split of its transformer yet (``sequence_parallel_split``): one GPU per request
VARIANTS: dict[str, Callable[[], ModelSpec]] = {
    "qwen-image": functools.partial(QwenImageSpec, "qwen-image", "real", "qwen_image_transformer.json",
                                    "qwen_image_vae.json", text_tokens=512,
                                    encoder=EncoderChoice("qwen2_5_vl", "qwen_image_text_encoder.json")),
    "tiny-qwen-image": functools.partial(QwenImageSpec, "tiny-qwen-image", "tiny", "tiny_qwen_image_transformer.json",
                                         "tiny_qwen_image_vae.json", text_tokens=8,
                                         encoder=EncoderChoice("qwen2_5_vl", "tiny_qwen_image_text_encoder.json")),
}
