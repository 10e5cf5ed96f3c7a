"""LTX-2: 19 B-parameter joint audio-video DiT (48 blocks), Gemma-3 text features, video + audio VAEs.

LTX-2 generates a video and its sound track together: every transformer block runs video and
audio self-attention, text cross-attention for both, and audio<->video cross-attention. The
diffusers ``LTX2Pipeline`` always denoises both streams and always decodes both (video VAE, then
audio VAE + vocoder), so the audio branch is part of every request's memory and latency and we
run it: the pipeline is the real one, not a video-only fork.

Every component's config is a JSON file of ``xema_ray/configs``: the transformer and the video
VAE (``ltx2_transformer.json``, ``ltx2_vae.json``) and, beside them, the scheduler, audio VAE, text
connectors and vocoder (``ltx2_scheduler.json``, ``ltx2_audio_vae.json``, ``ltx2_connectors.json``,
``ltx2_vocoder.json``), which are those that diffusers' conversion script
(``scripts/convert_ltx2_to_diffusers.py``, version "2.0") writes for the published
``Lightricks/LTX-2`` checkpoint (``ltx-2-19b-dev.safetensors``); each file's ``_source`` says where
it comes from. The tiny variants (``tiny_ltx2_*.json``) scale them down consistently with
``tiny_ltx2_transformer.json``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from xema_ray.models.options import OptionRules
from xema_ray.models.base import BuildOptions, ModelSize, ModelSpec, load_config
from xema_ray.models.text_encoders import EncoderChoice
from xema_ray.models.cost import BYTES, BlockCost

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from xema_ray.models.ltx2_i2v import FirstFrameReferences
    from xema_ray.parallel.plans import SPPlan
    from xema_ray.templates import RequestTemplate


def component_config(name: str) -> dict[str, Any]:
    """A component config of ``xema_ray/configs`` as its class takes it: without the ``_source`` note."""
    return {k: v for k, v in load_config(name).items() if not k.startswith("_")}


#: Gemma prompt length the pipeline pads to (``max_sequence_length`` default; a multiple of the
#: connectors' 128 registers, which the connector requires).
REAL_TEXT_TOKENS = 1024
TINY_TEXT_TOKENS = 16

#: diffusers' ``LATENT_DOWNSAMPLE_FACTOR`` of the audio VAE: latent audio frames per mel frame and
#: latent mel bins per mel bin (fixed in the class, not in its config).
AUDIO_LATENT_DOWNSAMPLE = 4

#: LTX-2 reference pipelines generate at 24 fps; the frame rate sets the audio length.
DEFAULT_FRAME_RATE = 24.0

#: The reference STG block of the 48-block LTX-2.0 model (diffusers recommends [29] for LTX-2.0 and
#: [28] for LTX-2.3).
REAL_STG_BLOCK = 29


@dataclass(frozen=True)
class LTX2Guidance:
    """How an LTX-2 request is guided; it decides how many transformer passes a denoising step makes.

    The defaults are Lightricks' reference (``ltx_pipelines`` DEFAULT_VIDEO_GUIDER_PARAMS and
    DEFAULT_AUDIO_GUIDER_PARAMS, also ``LTX2Pipeline.__call__``'s defaults): each step runs a CFG
    pass over [negative, positive] (batch 2), then a spatio-temporal-guidance (STG) pass and a
    modality-isolation pass (batch 1 each), i.e. four batch rows of transformer work per step,
    about 2x the latency of CFG alone. Peak activation memory is normally set by the batch-2 CFG pass; the
    two later passes add only their x0 predictions. ``CFG_ONLY`` is the cheaper alternative.

    Note: with LTX-2.0's ``perturbed_attn: false`` diffusers does not perturb the STG blocks, so the
    STG pass costs a full forward (as in production) but returns the conditional prediction again.

    Attributes:
        guidance_scale: video CFG scale (> 1 enables CFG).
        audio_guidance_scale: audio CFG scale; the pipeline runs CFG if either scale is > 1.
        stg_scale: video STG scale (> 0 adds the STG pass).
        audio_stg_scale: audio STG scale (> 0 adds the STG pass). Like every ``audio_*`` value,
            ``LTX2Pipeline`` replaces a falsy one (0) by the video value.
        stg_blocks: transformer blocks STG perturbs, for the 48-block model (scaled for tiny models).
        modality_scale: video modality-isolation scale (> 1 adds the isolation pass).
        audio_modality_scale: audio modality-isolation scale (> 1 adds the isolation pass).
        guidance_rescale: video CFG rescale factor in [0, 1].
        audio_guidance_rescale: audio CFG rescale factor in [0, 1].
    """

    guidance_scale: float = 3.0
    audio_guidance_scale: float = 7.0
    stg_scale: float = 1.0
    audio_stg_scale: float = 1.0
    stg_blocks: tuple[int, ...] = (REAL_STG_BLOCK,)
    modality_scale: float = 3.0
    audio_modality_scale: float = 3.0
    guidance_rescale: float = 0.7
    audio_guidance_rescale: float = 0.7

    def __post_init__(self) -> None:
        for name in ("guidance_scale", "audio_guidance_scale", "modality_scale", "audio_modality_scale"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be >= 1 (1 disables it), got {getattr(self, name)}")
        for name in ("stg_scale", "audio_stg_scale"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"{name} must be >= 0 (0 disables it), got {getattr(self, name)}")
        for name in ("guidance_rescale", "audio_guidance_rescale"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.uses_stg and not self.stg_blocks:
            raise ValueError(
                f"STG is on (stg_scale={self.stg_scale}, audio_stg_scale={self.audio_stg_scale}) "
                "but stg_blocks is empty"
            )

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale > 1.0 or self.audio_guidance_scale > 1.0

    @property
    def uses_stg(self) -> bool:
        return self.stg_scale > 0.0 or self.audio_stg_scale > 0.0

    @property
    def uses_modality(self) -> bool:
        return self.modality_scale > 1.0 or self.audio_modality_scale > 1.0

    def pass_batch_multipliers(self) -> tuple[int, ...]:
        """Batch size of each transformer pass per step, per request (e.g. (2, 1, 1))."""
        first = 2 if self.uses_cfg else 1
        return (first,) + (1,) * (int(self.uses_stg) + int(self.uses_modality))


#: Lightricks' reference guidance: CFG + STG + modality isolation (3 passes, 4 batch rows per step).
PRODUCTION_GUIDANCE = LTX2Guidance()
#: Classifier-free guidance only (1 pass of batch 2 per step).
CFG_ONLY = LTX2Guidance(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)


class LTX2Spec(ModelSpec):
    """LTX-2 text-to-audio+video, real size (19 B transformer) or tiny (CPU tests).

    Example:
        >>> from xema_ray.models import get_model_spec
        >>> spec = get_model_spec("ltx2")
        >>> spec.spatial_multiple, spec.temporal_compression
        (32, 8)
    """

    family = "ltx2"
    kind = "video"

    def __init__(
        self,
        name: str,
        size: ModelSize,
        transformer_config: str,
        vae_config: str,
        guidance: LTX2Guidance = PRODUCTION_GUIDANCE,
        frame_rate: float = DEFAULT_FRAME_RATE,
        encoder: EncoderChoice | None = None,
    ) -> None:
        super().__init__(name, size, transformer_config, vae_config, encoder)
        if frame_rate <= 0:
            raise ValueError(f"{name}: frame_rate must be positive, got {frame_rate}")
        real = size == "real"
        prefix = "ltx2" if real else "tiny_ltx2"
        self.audio_vae_config: dict[str, Any] = component_config(f"{prefix}_audio_vae.json")
        self.connectors_config: dict[str, Any] = component_config(f"{prefix}_connectors.json")
        self.vocoder_config: dict[str, Any] = component_config(f"{prefix}_vocoder.json")
        self.text_tokens = REAL_TEXT_TOKENS if real else TINY_TEXT_TOKENS
        self.frame_rate = frame_rate
        self.guidance = self._scale_stg_blocks(guidance)
        self._check_consistency()

    # ------------------------------------------------------------------ config plumbing
    @property
    def num_layers(self) -> int:
        return int(self.transformer_config.get("num_layers", 48))

    def _scale_stg_blocks(self, guidance: LTX2Guidance) -> LTX2Guidance:
        """STG block indices are given for the 48-block model; a shallower model perturbs the block
        at the same relative depth, so the tiny model's STG pass still names an existing block."""
        layers = self.num_layers
        if layers == 48:
            blocks = guidance.stg_blocks
        else:
            blocks = tuple(sorted({min(layers - 1, b * layers // 48) for b in guidance.stg_blocks}))
        bad = [b for b in blocks if not 0 <= b < layers]
        if bad:
            raise ValueError(f"{self.name}: stg_blocks {bad} out of range for {layers} transformer blocks")
        return replace(guidance, stg_blocks=blocks)

    def _check_consistency(self) -> None:
        """Fail at construction, not mid-pipeline, if the component configs disagree."""
        t, a, c, v = self.transformer_config, self.audio_vae_config, self.connectors_config, self.vocoder_config
        caption = int(t.get("caption_channels", 3840))
        checks = {
            "connectors caption_channels == transformer caption_channels": (c["caption_channels"], caption),
            "video connector width (heads x head_dim) == caption_channels": (
                c["video_connector_num_attention_heads"] * c["video_connector_attention_head_dim"],
                caption,
            ),
            "audio connector width (heads x head_dim) == caption_channels": (
                c["audio_connector_num_attention_heads"] * c["audio_connector_attention_head_dim"],
                caption,
            ),
            "audio latent features (latent_channels x mel_bins/4) == transformer audio_in_channels": (
                a["latent_channels"] * a["mel_bins"] // AUDIO_LATENT_DOWNSAMPLE,
                int(t.get("audio_in_channels", 128)),
            ),
            "audio VAE base_channels (size of its latent statistics) == audio latent features": (
                a["base_channels"],
                a["latent_channels"] * a["mel_bins"] // AUDIO_LATENT_DOWNSAMPLE,
            ),
            "vocoder in_channels == audio VAE output_channels x mel_bins": (
                v["in_channels"],
                a["output_channels"] * a["mel_bins"],
            ),
            "audio VAE sample_rate == transformer audio_sampling_rate": (
                a["sample_rate"],
                int(t.get("audio_sampling_rate", 16000)),
            ),
            "audio VAE mel_hop_length == transformer audio_hop_length": (
                a["mel_hop_length"],
                int(t.get("audio_hop_length", 160)),
            ),
        }
        for what, (got, want) in checks.items():
            if got != want:
                raise ValueError(f"{self.name}: inconsistent configs: {what} (got {got}, expected {want})")
        registers = c["video_connector_num_learnable_registers"]
        if registers and self.text_tokens % registers:
            raise ValueError(
                f"{self.name}: text length {self.text_tokens} must be a multiple of the connector's "
                f"{registers} registers"
            )
        if a["mel_bins"] % AUDIO_LATENT_DOWNSAMPLE:
            raise ValueError(
                f"{self.name}: audio mel_bins {a['mel_bins']} must be a multiple of {AUDIO_LATENT_DOWNSAMPLE}"
            )

    # ------------------------------------------------------------------ shapes
    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae_config["spatial_compression_ratio"])

    @property
    def spatial_multiple(self) -> int:
        # 32x spatial VAE compression (patch 4 x three 2x stages), transformer patch 1
        return self.vae_scale_factor * int(self.transformer_config.get("patch_size", 1))

    @property
    def temporal_compression(self) -> int:
        return int(self.vae_config["temporal_compression_ratio"])

    def latent_frames(self, t: RequestTemplate) -> int:
        return (t.frames - 1) // self.temporal_compression + 1

    def audio_latent_frames(self, t: RequestTemplate) -> int:
        """Audio tokens per request, as ``LTX2Pipeline.__call__`` computes them: the clip's duration
        at ``frame_rate`` times 16000 / 160 / 4 = 25 latent audio frames per second."""
        per_second = self.audio_vae_config["sample_rate"] / self.audio_vae_config["mel_hop_length"]
        return round(t.frames / self.frame_rate * per_second / float(AUDIO_LATENT_DOWNSAMPLE))

    def video_tokens(self, t: RequestTemplate) -> int:
        m = self.spatial_multiple
        return self.latent_frames(t) * (t.height // m) * (t.width // m)

    def latent_shape(self, t: RequestTemplate) -> tuple[int, ...]:
        # prepare_latents returns the packed [B, F*H*W, C] token sequence (patch size 1)
        return (t.batch, self.video_tokens(t), int(self.transformer_config["in_channels"]))

    def token_counts(self, t: RequestTemplate) -> dict[str, int]:
        return {"video": self.video_tokens(t), "audio": self.audio_latent_frames(t), "text": self.text_tokens}

    # ------------------------------------------------------------------ builders
    def transformer_class(self) -> type[nn.Module]:
        from diffusers import LTX2VideoTransformer3DModel

        return LTX2VideoTransformer3DModel

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLLTX2Video

        return AutoencoderKLLTX2Video

    def component_names(self) -> tuple[str, ...]:
        return ("transformer", "vae", "audio_vae", "connectors", "vocoder", "text_encoder")

    def decode_components(self) -> tuple[str, ...]:
        """The video VAE, and the audio VAE with the vocoder for the sound track."""
        return ("vae", "audio_vae", "vocoder")

    def build_audio_vae(self, opts: BuildOptions) -> nn.Module:
        """The audio VAE (its decoder turns audio latents into a stereo mel spectrogram)."""
        from diffusers import AutoencoderKLLTX2Audio

        return self._build(AutoencoderKLLTX2Audio, self.audio_vae_config, "audio_vae", opts)

    def build_connectors(self, opts: BuildOptions) -> nn.Module:
        """The text connectors (stacked Gemma features -> video and audio text embeddings)."""
        from diffusers.pipelines.ltx2 import LTX2TextConnectors

        return self._build(LTX2TextConnectors, self.connectors_config, "connectors", opts)

    def build_vocoder(self, opts: BuildOptions) -> nn.Module:
        """The vocoder (mel spectrogram -> 24 kHz waveform)."""
        from diffusers.pipelines.ltx2 import LTX2Vocoder

        return self._build(LTX2Vocoder, self.vocoder_config, "vocoder", opts)

    def build_pipeline(self, opts: BuildOptions) -> DiffusionPipeline:
        from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

        if opts.weights_dir is not None and opts.device == "meta":
            # checked here too: the text encoder would otherwise start loading before _build refuses
            raise ValueError(f"{self.name}: weights_dir is for real execution; analysis on meta needs no weights")
        text_encoder, tokenizer = self.build_text_encoder(opts)
        pipe = LTX2Pipeline(
            scheduler=self.scheduler(FlowMatchEulerDiscreteScheduler, component_config("ltx2_scheduler.json"), opts),
            vae=self.build_vae(opts),
            audio_vae=self.build_audio_vae(opts),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            connectors=self.build_connectors(opts),
            transformer=self.build_transformer(opts),
            vocoder=self.build_vocoder(opts),
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ------------------------------------------------------------------ calling the pipeline
    @property
    def text_feature_dim(self) -> int:
        """Width of ``prompt_embeds``: the text encoder's hidden states of every layer, flattened."""
        return int(self.connectors_config["caption_channels"] * self.connectors_config["text_proj_in_factor"])

    def _valid_tokens(self, prompt: str) -> int:
        """Unpadded length of a prompt: BOS plus one token per word, a proxy for Gemma's count.
        It only decides which positions the connectors replace by their learned registers."""
        return min(self.text_tokens, 1 + len(prompt.split()))

    def _embedding(
        self, prompt: str, device: torch.device | str, dtype: torch.dtype, salt: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.text_tokens, self.text_feature_dim)
        if torch.device(device).type == "meta":
            # Only shapes exist on meta; skip drawing 193 M random numbers per real-size prompt.
            embeds = torch.empty(shape, device=device, dtype=dtype)
        else:
            embeds = self.seeded_embedding(prompt, shape, device, dtype, salt=salt)
        # Gemma pads on the left: the real tokens are the last ones
        mask = torch.zeros((1, self.text_tokens), dtype=torch.long)
        mask[:, self.text_tokens - self._valid_tokens(prompt) :] = 1
        return embeds, mask.to(device)

    def prompt_embeddings(
        self, prompts: list[str], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` of shape [B, text_tokens, caption_channels x layers] with left-padded
        attention masks, as ``LTX2Pipeline.encode_prompt`` returns them; plus the negative prompt
        (the empty string, the pipeline's default) when the guidance runs CFG."""
        if not prompts:
            raise ValueError(f"{self.name}: prompt_embeddings needs at least one prompt, got []")
        pos = [self._embedding(p, device, dtype, salt="") for p in prompts]
        out = {
            "prompt_embeds": torch.cat([e for e, _ in pos]),
            "prompt_attention_mask": torch.cat([m for _, m in pos]),
        }
        if self.guidance.uses_cfg:
            neg_embeds, neg_mask = self._embedding("", device, dtype, salt="negative")
            out["negative_prompt_embeds"] = neg_embeds.expand(len(prompts), -1, -1).contiguous()
            out["negative_prompt_attention_mask"] = neg_mask.expand(len(prompts), -1).contiguous()
        return out

    def encode_prompts(self, pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Gemma-3's hidden states of every layer (and the empty negative prompt's under CFG)."""
        pe, pm, ne, nm = pipe.encode_prompt(prompt=prompts, negative_prompt=None,
                                            do_classifier_free_guidance=self.guidance.uses_cfg,
                                            max_sequence_length=self.text_tokens, device=device, dtype=dtype)
        out = {"prompt_embeds": pe, "prompt_attention_mask": pm}
        if self.guidance.uses_cfg:
            out |= {"negative_prompt_embeds": ne, "negative_prompt_attention_mask": nm}
        return out

    def prompt_token_count(self, tokenizer: Any, prompt: str) -> int:
        return len(tokenizer(prompt.strip(), add_special_tokens=True).input_ids)

    @property
    def default_guidance_scale(self) -> float:
        return self.guidance.guidance_scale

    def transformer_passes_per_step(self) -> tuple[int, ...]:
        """Batch multiplier of each transformer forward a denoising step runs, per request
        (production: (2, 1, 1) = CFG, STG, modality isolation)."""
        return self.guidance.pass_batch_multipliers()

    def option_rules(self) -> OptionRules:
        # ``call_kwargs`` refuses a video CFG scale below 1: checked before admission instead
        return OptionRules(guidance_min=1.0, negative_prompt=self.guidance.uses_cfg,
                           guidance_note="1 disables video classifier-free guidance")

    def call_kwargs(self, t: RequestTemplate, guidance_scale: float | None = None) -> dict[str, Any]:
        """Kwargs for ``LTX2Pipeline.__call__``; ``guidance_scale`` overrides the video CFG scale only
        (audio CFG keeps its own scale, and the pipeline runs CFG while either is above 1)."""
        g = self.guidance
        video_cfg = g.guidance_scale if guidance_scale is None else guidance_scale
        if video_cfg < 1.0:
            raise ValueError(f"{self.name}: guidance_scale must be >= 1 (1 disables video CFG), got {video_cfg}")
        return {
            "height": t.height,
            "width": t.width,
            "num_frames": t.frames,
            "frame_rate": self.frame_rate,
            "num_inference_steps": t.steps,
            "guidance_scale": video_cfg,
            "audio_guidance_scale": g.audio_guidance_scale,
            "stg_scale": g.stg_scale,
            "audio_stg_scale": g.audio_stg_scale,
            "spatio_temporal_guidance_blocks": list(g.stg_blocks),
            "modality_scale": g.modality_scale,
            "audio_modality_scale": g.audio_modality_scale,
            "guidance_rescale": g.guidance_rescale,
            "audio_guidance_rescale": g.audio_guidance_rescale,
            # LTX-2.0 modulates audio<->video cross-attention with each stream's own timestep
            # (True is the LTX-2.3 behaviour the pipeline defaults to)
            "use_cross_timestep": False,
            "max_sequence_length": self.text_tokens,
        }

    def dit_blocks(self, transformer: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(f"transformer_blocks.{i}", b) for i, b in enumerate(transformer.transformer_blocks)]

    def sequence_parallel_split(self) -> type[SPPlan] | None:
        from xema_ray.parallel.plans import LTX2Plan

        return LTX2Plan

    def block_work(self, t: RequestTemplate, rows: int) -> list[BlockCost]:
        """Per block: the video stream (self- and text cross-attention, MLP), the audio stream at
        its own width, and the audio-video cross-attention both ways at the audio width."""
        cfg = self.transformer_config
        tokens = self.token_counts(t)
        d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        da = cfg["audio_num_attention_heads"] * cfg["audio_attention_head_dim"]
        sv, sa, st = tokens["video"], tokens["audio"], tokens["text"]
        video = 12 * d * d * sv + 2 * d * d * sv + 2 * d * cfg.get("cross_attention_dim", d) * st
        audio = 12 * da * da * sa + 2 * da * da * sa + 2 * da * cfg.get("audio_cross_attention_dim", da) * st
        cross = (2 * d * da + 2 * da * da) * (sv + sa)  # a2v and v2a projections at the audio width
        attn = 4 * (sv * sv * d + sv * st * d + sa * sa * da + sa * st * da + 2 * sv * sa * da)
        params = 16 * d * d + 16 * da * da + 4 * d * da + 4 * da * da
        return [BlockCost(f"block.{i}", 2 * (video + audio + cross) * rows, attn * rows, params * BYTES, [(sv, d), (sa, da)])
                for i in range(cfg["num_layers"])]

    def reference_inputs(self) -> FirstFrameReferences:
        # image-to-video: the first frame, encoded by the video VAE at the output size and kept clean
        # by the conditioning mask (diffusers' ``LTX2ImageToVideoPipeline``: ``xema_ray.models.ltx2_i2v``)
        from xema_ray.models.ltx2_i2v import FirstFrameReferences

        return FirstFrameReferences(self.name, self.spatial_multiple, max_references=1)

    def sequence_parallel_for(self, t: RequestTemplate) -> bool:
        # image-to-video hands the transformer a timestep per video token (the conditioning mask):
        # the SP split does not shard it yet, so these templates run one GPU per request
        return self.sequence_parallel and not t.references

    def settling_steps_for(self, t: RequestTemplate) -> int:
        # image-to-video: a step-1 buffer of the conditioning path lives one step longer than in
        # the steady state (the third step is the first that repeats)
        return 1 if t.references else self.settling_steps

    def pipeline_for(self, pipe: Any, t: RequestTemplate) -> Any:
        from xema_ray.models.ltx2_i2v import image_to_video_pipeline

        return image_to_video_pipeline(pipe) if t.references else pipe

    def tracing_shims(self, t: RequestTemplate) -> contextlib.AbstractContextManager[None]:
        from xema_ray.models.ltx2_i2v import host_operands_on_meta

        return host_operands_on_meta() if t.references else contextlib.nullcontext()


def audio_samples(spec: LTX2Spec, t: RequestTemplate) -> int:
    """Waveform samples per channel the vocoder returns for a template: the audio VAE decodes each
    latent frame into 4 mel frames, less 3 at the start when it is causal (``LTX2AudioDecoder``),
    and the vocoder upsamples each mel frame by the product of its upsample factors."""
    mel_frames = spec.audio_latent_frames(t) * AUDIO_LATENT_DOWNSAMPLE
    if spec.audio_vae_config["causality_axis"] is not None:
        mel_frames = max(mel_frames - (AUDIO_LATENT_DOWNSAMPLE - 1), 1)
    return mel_frames * math.prod(spec.vocoder_config["upsample_factors"])


#: the registered models of this spec (``xema_ray.models.get_model_spec``)
VARIANTS: dict[str, Callable[[], ModelSpec]] = {
    "ltx2": functools.partial(LTX2Spec, "ltx2", "real", "ltx2_transformer.json", "ltx2_vae.json",
                              encoder=EncoderChoice("gemma3", "ltx2_text_encoder.json")),
    "tiny-ltx2": functools.partial(LTX2Spec, "tiny-ltx2", "tiny", "tiny_ltx2_transformer.json", "tiny_ltx2_vae.json",
                                   encoder=EncoderChoice("gemma3", "tiny_ltx2_text_encoder.json")),
}
