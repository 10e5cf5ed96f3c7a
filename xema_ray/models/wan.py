"""Wan2.2: video DiTs; the A14B variants are two 14 B experts that take turns.

Three models: Wan2.2-T2V-A14B (two experts, the Wan2.1 VAE, 16 fps), Wan2.2-I2V-A14B (its
image-to-video twin: two experts over 36 input channels, ``WanI2VSpec``) and Wan2.2-TI2V-5B (one
5 B transformer, the Wan2.2 VAE with 16x spatial compression, 24 fps, a timestep per latent token;
an optional first frame). The image-to-video path: ``xema_ray.models.wan_i2v``.

Wan2.2-T2V-A14B denoises with two transformers of one architecture (40 blocks, width 5120): the
*high-noise* expert (``transformer``) for timesteps at or above ``boundary_ratio`` x 1000, the
*low-noise* expert (``transformer_2``) after that. Only one runs at a time, but diffusers'
``WanPipeline`` holds both: ~57 GB of bf16 weights for a model that uses ~28.6 GB per step. The
switch is a memory event a plan can meet only there (``expert_stages``): the analyzer labels
each step with the expert it runs (``xema_ray.analyzer.experts``) and the planner decides what
is on the device at the switch (``planner.expert_switch``).

Everything model-specific lives here and in the JSON configs (``wan22_a14b_transformer.json``,
``wan21_vae.json``, ``wan22_umt5_text_encoder.json`` and their ``tiny_`` versions); the registry
entry in ``xema_ray.models`` names them.

Scheduler: UniPC on flow sigmas (``UniPCMultistepScheduler``), as the published Diffusers
repositories configure it (``scheduler/scheduler_config.json``), at the Wan team's shift (12 for
A14B, 5 for TI2V-5B; a checkpoint's own ``scheduler_config.json`` wins). UniPC is a multistep
solver: it keeps each step's model output for the next two steps and its first two steps are of
lower order, so the analyzer traces two settling steps and replicates with a step lifetime of two
(``settling_steps``, ``step_lifetime``; ``xema_ray.analyzer.steps.expand_steps``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from xema_ray.models.base import BuildOptions, ExpertStage, ModelSize, ModelSpec
from xema_ray.models.options import OptionRules
from xema_ray.models.text_encoders import EncoderChoice
from xema_ray.models.cost import BlockCost
from xema_ray.models.references import ReferenceInputs

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from xema_ray.parallel.plans import SPPlan

    from xema_ray.templates import RequestTemplate


@dataclass(frozen=True)
class WanSampling:
    """How a Wan2.2 request is sampled (the Wan team's ``wan/configs/wan_t2v_A14B.py``).

    Attributes:
        boundary_ratio: the low-noise expert takes over below ``boundary_ratio x 1000``; None: one expert.
        flow_shift: the flow-matching schedule's shift.
        guidance_scale: CFG scale of the high-noise expert (the first stage).
        guidance_scale_2: CFG scale of the low-noise expert.
        frame_rate: frames per second of the generated video.
        text_tokens: UMT5 prompt length the pipeline pads to.
    """

    boundary_ratio: float | None = 0.875
    flow_shift: float = 12.0
    guidance_scale: float = 4.0
    guidance_scale_2: float = 3.0
    frame_rate: float = 16.0
    text_tokens: int = 512
    #: one timestep per latent token (TI2V-5B: ``WanPipeline(expand_timesteps=True)``)
    expand_timesteps: bool = False

    def __post_init__(self) -> None:
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio must be in (0, 1) or None, got {self.boundary_ratio}")
        if self.flow_shift <= 0 or self.frame_rate <= 0 or self.text_tokens < 1:
            raise ValueError(f"flow_shift, frame_rate and text_tokens must be positive: {self}")


#: Wan2.2-T2V-A14B as the Wan team samples it (boundary 0.875, shift 12, CFG 4.0 then 3.0, 16 fps)
A14B_SAMPLING = WanSampling()
#: the tiny model: the same schedule and switch, 8 prompt tokens
TINY_SAMPLING = WanSampling(text_tokens=8)
#: Wan2.2-TI2V-5B (``wan/configs/wan_ti2v_5B.py``): one transformer, shift 5, CFG 5.0, 24 fps
TI2V_5B_SAMPLING = WanSampling(boundary_ratio=None, flow_shift=5.0, guidance_scale=5.0, frame_rate=24.0,
                               expand_timesteps=True)
#: its tiny twin: the same schedule, 8 prompt tokens
TINY_TI2V_SAMPLING = WanSampling(boundary_ratio=None, flow_shift=5.0, guidance_scale=5.0, frame_rate=24.0,
                                 expand_timesteps=True, text_tokens=8)
#: Wan2.2-I2V-A14B (``wan/configs/wan_i2v_A14B.py``): boundary 0.900, shift 5, CFG 3.5 for both experts, 16 fps
I2V_A14B_SAMPLING = WanSampling(boundary_ratio=0.9, flow_shift=5.0, guidance_scale=3.5, guidance_scale_2=3.5)
#: its tiny twin: the same switch (4 steps: 0-1 high-noise, 2-3 low-noise), 8 prompt tokens
TINY_I2V_SAMPLING = WanSampling(boundary_ratio=0.9, flow_shift=5.0, guidance_scale=3.5, guidance_scale_2=3.5,
                                text_tokens=8)


class WanSpec(ModelSpec):
    """Wan2.2 text-to-video (``WanPipeline``); two experts when ``sampling.boundary_ratio`` is set.

    Example:
        >>> from xema_ray.models import get_model_spec
        >>> spec = get_model_spec("wan2.2-t2v-a14b")
        >>> spec.spatial_multiple, spec.temporal_compression, spec.frame_rate
        (16, 4, 16.0)
    """

    family = "wan"
    kind = "video"
    #: UniPC's first step is first order and its second corrects with order 1 (and the latents,
    #: created in fp32, come back from the scheduler in the transformer's dtype): steady from step 2
    settling_steps = 2
    #: UniPC (solver order 2) keeps each step's model output for the next two steps
    step_lifetime = 2

    def __init__(self, name: str, size: ModelSize, transformer_config: str, vae_config: str,
                 sampling: WanSampling = A14B_SAMPLING, encoder: EncoderChoice | None = None) -> None:
        super().__init__(name, size, transformer_config, vae_config, encoder)
        self.sampling = sampling
        self.frame_rate = sampling.frame_rate
        if size == "real" and not self.two_experts:  # TI2V-5B: 720p is 1280x704 (multiples of 32), 121 frames at 24 fps
            self.reference_sizes = ((1280, 704, 121),)
            self.reference_steps = 50
        elif size == "real":  # 480p and 720p at 81 frames (5 s at 16 fps), 40 steps: the Wan team's
            self.reference_sizes = ((832, 480, 81), (1280, 720, 81))
            self.reference_steps = 40
        else:
            self.reference_sizes = ((64, 64, 9), (128, 96, 17))
            self.reference_steps = 4

    # ------------------------------------------------------------------ shapes
    @property
    def published_layout(self) -> str:
        return "wan-a14b" if self.two_experts else "wan-ti2v-5b"

    @property
    def two_experts(self) -> bool:
        return self.sampling.boundary_ratio is not None

    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae_config.get("scale_factor_spatial", 2 ** (len(self.vae_config["dim_mult"]) - 1)))

    @property
    def spatial_multiple(self) -> int:
        return self.vae_scale_factor * int(self.transformer_config["patch_size"][1])

    @property
    def temporal_compression(self) -> int:
        return int(self.vae_config.get("scale_factor_temporal", 2 ** sum(self.vae_config["temperal_downsample"])))

    @property
    def text_tokens(self) -> int:
        return self.sampling.text_tokens

    @property
    def num_dit_blocks(self) -> int:
        return int(self.transformer_config["num_layers"])

    def latent_frames(self, t: RequestTemplate) -> int:
        return (t.frames - 1) // self.temporal_compression + 1

    def latent_shape(self, t: RequestTemplate) -> tuple[int, ...]:
        f = self.vae_scale_factor  # the noise latent (I2V-A14B's image latents and mask join it on channels)
        return (t.batch, int(self.transformer_config["out_channels"]), self.latent_frames(t), t.height // f, t.width // f)

    def token_counts(self, t: RequestTemplate) -> dict[str, int]:
        m = self.spatial_multiple
        return {"video": self.latent_frames(t) * (t.height // m) * (t.width // m), "text": self.text_tokens}

    # ------------------------------------------------------------------ the two experts
    @property
    def scheduler_config(self) -> dict[str, Any]:
        """UniPC on flow sigmas, as the published Diffusers repositories configure it
        (``scheduler/scheduler_config.json``: flow prediction, solver order 2, bh2, x0 prediction,
        final sigma zero), at the Wan team's shift."""
        return {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000,
                "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": self.sampling.flow_shift,
                "solver_order": 2, "solver_type": "bh2", "predict_x0": True, "lower_order_final": True,
                "final_sigmas_type": "zero", "timestep_spacing": "linspace", "beta_schedule": "linear",
                "beta_start": 0.0001, "beta_end": 0.02}

    def expert_stages(self, t: RequestTemplate, scheduler_config: Mapping[str, Any] | None = None
                      ) -> tuple[ExpertStage, ...]:
        """Which transformer runs which denoising steps: the pipeline's own rule (``t >= boundary``
        runs ``transformer``), on the schedule the scheduler makes for ``t.steps``: UniPC at
        ``scheduler_config``'s shift (the scheduler the pipeline loaded: a checkpoint's own
        ``scheduler_config.json`` wins, e.g. the published repository's ``flow_shift`` 3.0), else at
        the spec's. The worker's swap places its prefetch and switch on the loaded scheduler's split
        at the batch's step count (``xema_ray.mitigation.expert_swap.apply_expert_swap``)."""
        if not self.two_experts:
            return super().expert_stages(t)
        from diffusers import UniPCMultistepScheduler

        sched = UniPCMultistepScheduler.from_config(dict(scheduler_config or self.scheduler_config))
        sched.set_timesteps(t.steps, device="cpu")
        boundary = self.sampling.boundary_ratio * sched.config.num_train_timesteps  # type: ignore[operator]
        high = int(sum(1 for ts in sched.timesteps.tolist() if ts >= boundary))
        stages = []
        if high:
            stages.append(ExpertStage(component="transformer", first_step=0, last_step=high - 1))
        if high < t.steps:
            stages.append(ExpertStage(component="transformer_2", first_step=high, last_step=t.steps - 1))
        return tuple(stages)

    def one_expert_call(self, pipe: Any) -> contextlib.AbstractContextManager[None]:
        """The pipeline running only ``transformer`` (the analyzer traces three steps of one
        expert and labels the rest by ``expert_stages``: both experts allocate alike)."""
        return _without_boundary(pipe) if self.two_experts else contextlib.nullcontext()

    # ------------------------------------------------------------------ builders
    def transformer_class(self) -> type[nn.Module]:
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLWan

        return AutoencoderKLWan

    def component_names(self) -> tuple[str, ...]:
        return ("transformer", "transformer_2", "vae", "text_encoder") if self.two_experts else super().component_names()

    def build_transformer_2(self, opts: BuildOptions) -> nn.Module:
        """The low-noise expert: the same architecture, its own weights (``transformer_2/``)."""
        return self._build(self.transformer_class(), self.transformer_config, "transformer_2", opts)

    def pipeline_class(self) -> type[DiffusionPipeline]:
        """The diffusers pipeline over this spec's components (image-to-video-only models override it)."""
        from diffusers import WanPipeline

        return WanPipeline

    def reference_inputs(self) -> ReferenceInputs:
        # TI2V-5B is text-and-image-to-video: an optional first frame, which replaces latent
        # frame 0 through a mask (templates with references=1 run ``WanI2VPipeline``)
        return ReferenceInputs(self.name, self.spatial_multiple, max_references=1 if self.sampling.expand_timesteps else 0)

    def pipeline_for(self, pipe: Any, t: RequestTemplate) -> Any:
        """TI2V-5B's first-frame templates run ``WanI2VPipeline`` over the same modules."""
        from xema_ray.models.wan_i2v import WanI2VPipeline, image_to_video_pipeline

        return image_to_video_pipeline(pipe) if t.references and not isinstance(pipe, WanI2VPipeline) else pipe

    def build_pipeline(self, opts: BuildOptions) -> DiffusionPipeline:
        from diffusers import UniPCMultistepScheduler

        text_encoder, tokenizer = self.build_text_encoder(opts)
        pipe = self.pipeline_class()(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=self.build_vae(opts),
            scheduler=self.scheduler(UniPCMultistepScheduler, self.scheduler_config, opts),
            transformer=self.build_transformer(opts),
            transformer_2=self.build_transformer_2(opts) if self.two_experts else None,
            boundary_ratio=self.sampling.boundary_ratio,
            expand_timesteps=self.sampling.expand_timesteps,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ------------------------------------------------------------------ calling the pipeline
    def prompt_embeddings(
        self, prompts: list[str], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        shape = (1, self.text_tokens, int(self.transformer_config["text_dim"]))
        pos = torch.cat([self.seeded_embedding(p, shape, device, dtype) for p in prompts])
        neg = torch.cat([self.seeded_embedding("", shape, device, dtype, salt="negative")] * len(prompts))
        return {"prompt_embeds": pos, "negative_prompt_embeds": neg}

    def encode_prompts(self, pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """UMT5 embeddings of the prompts and of the empty negative prompt (the pipeline's default)."""
        pos, neg = pipe.encode_prompt(prompt=prompts, negative_prompt=None, do_classifier_free_guidance=True,
                                      max_sequence_length=self.text_tokens, device=device, dtype=dtype)
        return {"prompt_embeds": pos, "negative_prompt_embeds": neg}

    def prompt_token_count(self, tokenizer: Any, prompt: str) -> int:
        return len(tokenizer(prompt, add_special_tokens=True).input_ids)

    @property
    def default_guidance_scale(self) -> float:
        return self.sampling.guidance_scale

    def transformer_passes_per_step(self) -> tuple[int, ...]:
        """Two calls of the request's batch per step with classifier-free guidance, else one:
        WanPipeline runs the conditional and the unconditional pass as two calls (not one doubled
        batch), so there is no CFG pair to serialize."""
        return (1, 1) if self.sampling.guidance_scale > 1.0 else (1,)

    def call_kwargs(self, t: RequestTemplate, guidance_scale: float | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "height": t.height,
            "width": t.width,
            "num_frames": t.frames,
            "num_inference_steps": t.steps,
            "guidance_scale": self.default_guidance_scale if guidance_scale is None else guidance_scale,
            "max_sequence_length": self.text_tokens,
        }
        if self.two_experts:
            # the low-noise expert's: the Wan team's default, or the request's guidance_scale where it
            # gives one (diffusers' WanPipeline defaults guidance_scale_2 to guidance_scale); a
            # request's own guidance_scale_2 replaces it (``ExecutionEngine.run_pipeline``)
            kwargs["guidance_scale_2"] = self.sampling.guidance_scale_2 if guidance_scale is None else guidance_scale
        return kwargs

    def option_rules(self) -> OptionRules:
        """The base rules; a two-expert model (A14B) also takes ``guidance_scale_2``, the low-noise
        expert's guidance, in the same range."""
        return super().option_rules().model_copy(update={"guidance_scale_2": self.two_experts})

    def vae_decoder_levels(self) -> tuple[list[int], list[int]]:
        """The Wan VAE decoder: ``base_dim x dim_mult`` channels from the lowest resolution up,
        ``num_res_blocks + 1`` resnets per up level."""
        cfg = self.vae_config
        base = int(cfg.get("decoder_base_dim") or cfg["base_dim"])
        chans = [base * int(m) for m in reversed(cfg["dim_mult"])]
        return chans, [int(cfg["num_res_blocks"]) + 1] * len(chans)

    def dit_blocks(self, transformer: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(f"blocks.{i}", b) for i, b in enumerate(transformer.blocks)]

    def dit_block_paths(self) -> list[str]:
        return [f"blocks.{i}" for i in range(self.num_dit_blocks)]  # the paper's models say ``transformer_blocks``

    def sequence_parallel_split(self) -> type[SPPlan] | None:
        """Along the latent's height: the rotary table Wan computes inside forward is computed
        whole and cut to each rank's rows."""
        from xema_ray.parallel.plans import WanPlan

        return WanPlan

    def block_work(self, t: RequestTemplate, rows: int) -> list[BlockCost]:
        """Per block of one transformer pass over ``rows`` batch rows: (name, linear FLOPs,
        attention FLOPs, weight bytes at bf16, attended (tokens, width)): self-attention over the
        video tokens, cross-attention to the text, a GELU MLP of ``ffn_dim``."""
        cfg = self.transformer_config
        d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
        ffn = int(cfg["ffn_dim"])
        tokens = self.token_counts(t)
        sv, st = tokens["video"], tokens["text"]
        params = 4 * d * d + 4 * d * d + 2 * d * ffn  # self-attn q k v o, cross-attn q k v o, MLP in/out
        linear = 2 * ((4 * d * d + 2 * d * ffn + 2 * d * d) * sv + 2 * d * d * st) * rows
        attention = 4 * (sv * sv * d + sv * st * d) * rows
        return [BlockCost(f"block.{i}", float(linear), float(attention), float(params * 2), [(sv, d)])
                for i in range(self.num_dit_blocks)]


class WanI2VSpec(WanSpec):
    """Wan2.2-I2V-A14B: image-to-video only (``WanI2VPipeline``): every template takes the first
    frame, encoded at the output size as the first of ``frames`` pixel frames (the rest black)."""

    @property
    def published_layout(self) -> str:
        return "wan-i2v-a14b"  # its own repository: model_index.json names the image-to-video pipeline

    def reference_inputs(self) -> ReferenceInputs:
        # the whole video is encoded: diffusers encodes the first frame followed by ``frames - 1``
        # black ones (``WanImageToVideoPipeline.prepare_latents``; TI2V-5B encodes the image alone)
        return ReferenceInputs(self.name, self.spatial_multiple, max_references=1, required_references=1,
                               encodes_whole_video=True)

    def pipeline_class(self) -> type[DiffusionPipeline]:
        from xema_ray.models.wan_i2v import WanI2VPipeline

        return WanI2VPipeline


#: a boundary below every timestep the pipeline makes (the last is >= 1): ``transformer`` runs every
#: step and ``guidance_scale_2`` stays a valid argument (the pipeline refuses it without a boundary)
_BELOW_EVERY_TIMESTEP = 1e-6


@contextlib.contextmanager
def _without_boundary(pipe: Any) -> Iterator[None]:
    saved = pipe.config.boundary_ratio
    pipe.register_to_config(boundary_ratio=_BELOW_EVERY_TIMESTEP)
    try:
        yield
    finally:
        pipe.register_to_config(boundary_ratio=saved)


_UMT5 = EncoderChoice("umt5", "wan22_umt5_text_encoder.json")
_TINY_UMT5 = EncoderChoice("umt5", "tiny_wan22_umt5_text_encoder.json")
#: the registered models of these specs (``xema_ray.models.get_model_spec``)
VARIANTS: dict[str, Callable[[], ModelSpec]] = {
    "wan2.2-t2v-a14b": functools.partial(WanSpec, "wan2.2-t2v-a14b", "real", "wan22_a14b_transformer.json",
                                         "wan21_vae.json", A14B_SAMPLING, _UMT5),
    "tiny-wan2.2": functools.partial(WanSpec, "tiny-wan2.2", "tiny", "tiny_wan22_transformer.json", "tiny_wan21_vae.json",
                                     TINY_SAMPLING, _TINY_UMT5),
    "wan2.2-ti2v-5b": functools.partial(WanSpec, "wan2.2-ti2v-5b", "real", "wan22_ti2v5b_transformer.json",
                                        "wan22_vae.json", TI2V_5B_SAMPLING, _UMT5),
    "tiny-wan2.2-ti2v": functools.partial(WanSpec, "tiny-wan2.2-ti2v", "tiny", "tiny_wan22_ti2v_transformer.json",
                                          "tiny_wan22_vae.json", TINY_TI2V_SAMPLING, _TINY_UMT5),
    "wan2.2-i2v-a14b": functools.partial(WanI2VSpec, "wan2.2-i2v-a14b", "real", "wan22_i2v_a14b_transformer.json",
                                         "wan21_vae.json", I2V_A14B_SAMPLING, _UMT5),
    "tiny-wan2.2-i2v": functools.partial(WanI2VSpec, "tiny-wan2.2-i2v", "tiny", "tiny_wan22_i2v_transformer.json",
                                         "tiny_wan21_vae.json", TINY_I2V_SAMPLING, _TINY_UMT5),
}
