"""Flux.2-dev: 32 B-parameter image DiT (8 double-stream + 48 single-stream blocks)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from xema_ray.models.options import OptionRules
from xema_ray.models.base import BuildOptions, ModelSpec
from xema_ray.models.references import ReferenceInputs
from xema_ray.models.text_encoders import EncoderChoice
from xema_ray.models.cost import BYTES, BlockCost
from xema_ray.models.weight_formats import QuantRule

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from xema_ray.parallel.plans import SPPlan

    from xema_ray.templates import RequestTemplate

# FlowMatchEulerDiscreteScheduler config published with FLUX.2-dev (used when a weights directory has
# no scheduler/scheduler_config.json).
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}


@functools.cache
def edit_pipeline_class() -> type[Any]:
    """``Flux2Pipeline`` whose reference images are each request's own.

    diffusers' pipeline encodes one list of references and repeats it over the batch; a batch
    here holds requests of one template (the same number of references, the same size), each
    with its own images. ``image`` is then one flat list, request by request, and each batch
    row's reference tokens are encoded from its request's images, with the same position ids
    (the ids depend only on the count and the size, which the template fixes)."""
    from diffusers import Flux2Pipeline

    class Flux2EditPipeline(Flux2Pipeline):  # type: ignore[misc]
        def prepare_image_latents(self, images: list[torch.Tensor], batch_size: int, generator: Any, device: Any,
                                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            per, rest = divmod(len(images), batch_size)
            if rest or not per:
                raise ValueError(f"{len(images)} reference images do not split evenly over a batch of {batch_size}")
            rows, ids = [], None
            for b in range(batch_size):
                latents, ids = super().prepare_image_latents(images[b * per:(b + 1) * per], 1, generator, device, dtype)
                rows.append(latents)
            assert ids is not None
            return torch.cat(rows), ids.repeat(batch_size, 1, 1)

    return Flux2EditPipeline


class Flux2Spec(ModelSpec):
    family = "flux2"
    kind = "image"
    #: the DiT blocks' linear layers stored quantized; the embedders, the modulation and the output
    #: layers kept in the model's dtype
    weight_quant = QuantRule(
        kept=(r"^x_embedder$", r"^context_embedder$", r"^time_guidance_embed\.", r"_modulation", r"^norm_out\.",
              r"^proj_out$"),
        source="chosen after the usual weight-only practice for DiTs (the blocks' linear layers quantized; the "
               "input, conditioning and output layers, a small share of the bytes, kept in 16 bits); not measured "
               "on trained Flux.2 weights yet (random weights carry no trained sensitivity)")

    def __init__(self, name: str, size: str, transformer_config: str, vae_config: str, text_tokens: int,
                 encoder: EncoderChoice | None = None) -> None:
        super().__init__(name, size, transformer_config, vae_config, encoder)  # type: ignore[arg-type]
        # Mistral-3 prompt length the pipeline pads to (tokenizer_max_length = 512).
        self.text_tokens = text_tokens
        #: the system message the pipeline puts before every prompt (diffusers' own for the real
        #: model; none for the tiny one, whose 8 tokens would otherwise all go to it)
        self.system_message: str | None = None if size == "real" else ""

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config["block_out_channels"]) - 1)

    @property
    def spatial_multiple(self) -> int:
        # the VAE downsamples by 8 and the pipeline packs 2x2 latent patches
        return self.vae_scale_factor * 2

    def reference_inputs(self) -> ReferenceInputs:
        # FLUX.2 [dev] conditions on up to 10 reference images (Black Forest Labs' model card),
        # each at a size of the template's own; each adds its latent tokens to the sequence the
        # DiT attends over
        return ReferenceInputs(self.name, self.spatial_multiple, max_references=10, references_at_output_size=False)

    def latent_shape(self, t: RequestTemplate) -> tuple[int, ...]:
        tokens = (t.height // self.spatial_multiple) * (t.width // self.spatial_multiple)
        return (t.batch, tokens, self.transformer_config["in_channels"])

    def token_counts(self, t: RequestTemplate) -> dict[str, int]:
        counts = {
            "image": (t.height // self.spatial_multiple) * (t.width // self.spatial_multiple),
            "text": self.text_tokens,
        }
        if t.references:  # each reference's latent tokens join the sequence (not denoised, attended)
            m = self.spatial_multiple
            counts["reference"] = t.references * (t.reference_height // m) * (t.reference_width // m)
        return counts

    def transformer_class(self) -> type[nn.Module]:
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2

    def build_pipeline(self, opts: BuildOptions) -> DiffusionPipeline:
        from diffusers import FlowMatchEulerDiscreteScheduler

        text_encoder, tokenizer = self.build_text_encoder(opts)
        pipe = edit_pipeline_class()(
            scheduler=self.scheduler(FlowMatchEulerDiscreteScheduler, SCHEDULER_CONFIG, opts),
            vae=self.build_vae(opts),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=self.build_transformer(opts),
        )
        if self.system_message is not None:
            pipe.system_message = self.system_message
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def prompt_embeddings(
        self, prompts: list[str], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        dim = self.transformer_config["joint_attention_dim"]
        embeds = torch.cat(
            [self.seeded_embedding(p, (1, self.text_tokens, dim), device, dtype) for p in prompts]
        )
        return {"prompt_embeds": embeds}

    def encode_prompts(self, pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The model's own Mistral-3 encoding (the hidden states of ``out_layers``, stacked)."""
        embeds, _ = pipe.encode_prompt(prompt=prompts, device=device, max_sequence_length=self.text_tokens,
                                       text_encoder_out_layers=self.text_encoder.out_layers)
        return {"prompt_embeds": embeds.to(dtype)}

    def prompt_token_count(self, tokenizer: Any, prompt: str) -> int:
        """Tokens the chat-formatted prompt takes before truncation to ``text_tokens``."""
        from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

        system = SYSTEM_MESSAGE if self.system_message is None else self.system_message
        ids = tokenizer.apply_chat_template(format_input(prompts=[prompt], system_message=system),
                                            add_generation_prompt=False, tokenize=True, return_dict=True)["input_ids"]
        return len(ids[0]) if ids and isinstance(ids[0], list) else len(ids)

    @property
    def default_guidance_scale(self) -> float:
        return 4.0

    def transformer_passes_per_step(self) -> tuple[int, ...]:
        return (1,)  # guidance-distilled: guidance is an embedding input, not a second pass

    def option_rules(self) -> OptionRules:
        return OptionRules(guidance_note="guidance-distilled: an embedding input, no classifier-free guidance pass")

    def call_kwargs(self, t: RequestTemplate, guidance_scale: float | None = None) -> dict[str, Any]:
        # Flux.2-dev is guidance-distilled: guidance is an embedding input, not a second CFG pass.
        return {
            "height": t.height,
            "width": t.width,
            "num_inference_steps": t.steps,
            "guidance_scale": self.default_guidance_scale if guidance_scale is None else guidance_scale,
            "max_sequence_length": self.text_tokens,
        }

    @contextlib.contextmanager
    def tracing_shims(self, t: RequestTemplate) -> Iterator[None]:
        """``Flux2Pipeline._unpack_latents_with_ids`` reads the latent grid size from the position
        ids (``torch.max(h_ids) + 1``); on meta the value comes from the template instead, with
        the same allocations in the same order."""
        from diffusers import Flux2Pipeline

        H = t.height // self.spatial_multiple  # noqa: N806
        W = t.width // self.spatial_multiple  # noqa: N806

        def unpack(x: torch.Tensor, x_ids: torch.Tensor) -> torch.Tensor:
            # same statements, names and order as diffusers' version, so temporaries are freed
            # at the same points; only the grid size comes from the template (H, W)
            outs = []
            for data, pos in zip(x, x_ids, strict=True):
                _, ch = data.shape
                h_ids = pos[:, 1].to(torch.int64)
                w_ids = pos[:, 2].to(torch.int64)
                h = torch.max(h_ids) + 1
                w = torch.max(w_ids) + 1
                flat_ids = h_ids * w + w_ids
                hw = h * w  # diffusers computes h * w as a tensor inside torch.zeros((h * w, ch))
                out = torch.zeros((H * W, ch), device=data.device, dtype=data.dtype)
                del hw
                out.scatter_(0, flat_ids.unsqueeze(1).expand(-1, ch), data)
                out = out.view(H, W, ch).permute(2, 0, 1)
                outs.append(out)
            return torch.stack(outs, dim=0)

        original = Flux2Pipeline.__dict__["_unpack_latents_with_ids"]
        Flux2Pipeline._unpack_latents_with_ids = staticmethod(unpack)
        try:
            yield
        finally:
            Flux2Pipeline._unpack_latents_with_ids = original

    def dit_blocks(self, transformer: nn.Module) -> list[tuple[str, nn.Module]]:
        double = [(f"transformer_blocks.{i}", b) for i, b in enumerate(transformer.transformer_blocks)]
        single = [(f"single_transformer_blocks.{i}", b) for i, b in enumerate(transformer.single_transformer_blocks)]
        return double + single

    def dit_block_paths(self) -> list[str]:
        cfg = self.transformer_config
        return [f"transformer_blocks.{i}" for i in range(cfg["num_layers"])] + [
            f"single_transformer_blocks.{i}" for i in range(cfg["num_single_layers"])
        ]

    def sequence_parallel_split(self) -> type[SPPlan]:
        from xema_ray.parallel.plans import Flux2Plan

        return Flux2Plan

    def block_work(self, t: RequestTemplate, rows: int) -> list[BlockCost]:
        """Double-stream blocks (q k v o and a SwiGLU MLP per stream) then single-stream blocks
        (fused qkv + MLP in, fused out), all attending over the image, reference and text tokens."""
        cfg = self.transformer_config
        tokens = self.token_counts(t)
        d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        m = cfg.get("mlp_ratio", 3.0)
        s_img, s_txt = tokens["image"] + tokens.get("reference", 0), tokens["text"]  # references join the sequence
        s = s_img + s_txt
        stream = (4 + 3 * m) * d * d  # q, k, v, out + SwiGLU (2 x m d in, m d out)
        single = (3 + 2 * m + 1 + m) * d * d  # fused qkv + mlp-in, fused out over [attn, mlp]
        blocks: list[BlockCost] = []
        for i in range(cfg["num_layers"]):
            blocks.append(BlockCost(f"double.{i}", 2 * stream * s * rows, 4 * s * s * d * rows, 2 * stream * BYTES, [(s, d)]))
        for i in range(cfg.get("num_single_layers", 0)):
            blocks.append(BlockCost(f"single.{i}", 2 * single * s * rows, 4 * s * s * d * rows, single * BYTES, [(s, d)]))
        return blocks


#: the registered models of this spec (``xema_ray.models.get_model_spec``)
VARIANTS: dict[str, Callable[[], ModelSpec]] = {
    "flux2": functools.partial(Flux2Spec, "flux2", "real", "flux2dev_transformer.json", "flux2dev_vae.json", text_tokens=512,
                               encoder=EncoderChoice("mistral3", "flux2dev_text_encoder.json", out_layers=(10, 20, 30))),
    "tiny-flux2": functools.partial(Flux2Spec, "tiny-flux2", "tiny", "tiny_flux2_transformer.json", "tiny_flux2_vae.json",
                                    text_tokens=8,
                                    encoder=EncoderChoice("mistral3", "tiny_flux2_text_encoder.json", out_layers=(1,))),
}
