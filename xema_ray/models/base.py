"""What every model spec provides: configs, builders, the pipeline, and the DiT block list.

A ``ModelSpec`` is the only place that knows a model's architecture-specific facts: which
diffusers classes it uses, what shapes a template implies, how to call its pipeline with
prompt embeddings we provide, and which modules are the DiT blocks that mitigation addresses.
Everything else (tracer, engine, planner) is model-agnostic and goes through this interface.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from xema_ray.models.build_options import BuildOptions, TextEncoderPlacement  # noqa: F401  (its users import both from here)
from xema_ray.models.cost import BlockCost
from xema_ray.models.references import ReferenceInputs
from xema_ray.models.options import OptionRules
from xema_ray.models.weight_formats import QuantRule
from xema_ray.models.dtypes import DTYPES, DTypeName, cast_inputs_to_own_dtype, log_cast, model_dtypes  # noqa: F401

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from xema_ray.models.text_encoders import EncoderChoice, TextEncoderSpec
    from xema_ray.parallel.plans import SPPlan
    from xema_ray.templates import RequestTemplate

logger = logging.getLogger(__name__)

ModelSize = Literal["real", "tiny"]
ModelKind = Literal["image", "video"]


def load_config(name: str) -> dict[str, Any]:
    """A model config shipped in ``xema_ray/configs`` (a model's published ``config.json``, or a tiny one for CI)."""
    text = resources.files("xema_ray.configs").joinpath(name).read_text()
    return json.loads(text)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Construct modules directly in ``dtype``: building a 32 B model in fp32 then casting would
    need twice the memory on the device."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


#: where a diffusers directory keeps its scheduler's config
SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"


def checkpoint_scheduler_config(weights_dir: str | Path) -> dict[str, Any] | None:
    """The scheduler config of the checkpoint in ``weights_dir`` (``scheduler/scheduler_config.json``,
    what a worker loading it runs: ``ModelSpec.scheduler``); None where it has none (the worker
    then runs the spec's).

    Raises:
        ValueError: the file is not a JSON object.
    """
    path = Path(weights_dir) / SCHEDULER_CONFIG
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a scheduler config is a JSON object")
    return config


@dataclass(frozen=True)
class ExpertStage:
    """The denoising steps one transformer component runs (a two-expert model has two stages)."""

    #: pipeline component, e.g. "transformer" (high-noise expert) or "transformer_2" (low-noise)
    component: str
    first_step: int
    #: inclusive
    last_step: int

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1


class ModelSpec(ABC):
    """One servable model (real size or tiny), as the registry hands it out."""

    #: registry name, e.g. "cogvideox-5b" or "tiny-cogvideox"
    name: str
    #: model family shared by real and tiny variants ("flux2", "cogvideox", "ltx2")
    family: str
    kind: ModelKind
    size: ModelSize

    @property
    def published_layout(self) -> str:
        """The key of its published repository's layout in ``models.published.PUBLISHED`` (its family's)."""
        return self.family

    def __init__(self, name: str, size: ModelSize, transformer_config: str, vae_config: str,
                 encoder: EncoderChoice | None = None) -> None:
        self.name = name
        self.size = size
        self.encoder = encoder
        self.transformer_config: dict[str, Any] = load_config(transformer_config)
        self.vae_config: dict[str, Any] = load_config(vae_config)

    @functools.cached_property
    def text_encoder(self) -> TextEncoderSpec | None:
        """The model's text encoder (configs and builder) at the spec's prompt length; None: it has none."""
        if self.encoder is None:
            return None
        from xema_ray.models.text_encoders import TextEncoderSpec

        return TextEncoderSpec(self.encoder.family, self.encoder.config_file, self.text_tokens,
                               out_layers=self.encoder.out_layers)

    def reference_inputs(self) -> ReferenceInputs:
        """What the model takes as reference images (``xema_ray.models.references``): none here;
        a model that conditions on images returns its own."""
        return ReferenceInputs(self.name, self.spatial_multiple)

    def pipeline_for(self, pipe: Any, t: RequestTemplate) -> Any:
        """The pipeline object that runs ``t``: ``pipe``, or for a model whose image-to-video runs
        through another diffusers pipeline over the same components (LTX-2), that one (made once
        per ``pipe``, sharing every module: no weight is loaded twice)."""
        return pipe

    def shares_measurements_with(self, other: ModelSpec) -> bool:
        """Whether measured latencies of ``other`` calibrate this model's cost model (one
        architecture: its real and tiny variants, its image-to-video sibling)."""
        return self.family == other.family

    # ------------------------------------------------------------------ shapes
    @property
    @abstractmethod
    def spatial_multiple(self) -> int:
        """Height and width must be multiples of this (VAE factor × patch size)."""

    @property
    def temporal_compression(self) -> int:
        """Frames per latent frame after the first (1 for image models)."""
        return 1

    def validate_shape(self, height: int, width: int, frames: int) -> None:
        """Raise ValueError naming what is wrong and what is accepted."""
        m = self.spatial_multiple
        if height % m or width % m:
            raise ValueError(
                f"{self.name}: height and width must be multiples of {m}, got {width}x{height} "
                f"(nearest valid: {round(width / m) * m}x{round(height / m) * m})"
            )
        if self.kind == "image":
            if frames != 1:
                raise ValueError(f"{self.name} is an image model: frames must be 1, got {frames}")
        else:
            r = self.temporal_compression
            if frames < 1 or (frames - 1) % r:
                raise ValueError(
                    f"{self.name}: frames must be 1 + a multiple of {r} (the VAE's temporal compression), "
                    f"got {frames} (nearest valid: {1 + round((frames - 1) / r) * r})"
                )

    @property
    def attention_heads(self) -> int:
        """Heads of the DiT's attention: Ulysses SP splits them, so its degree must divide this."""
        return int(self.transformer_config["num_attention_heads"])

    @property
    def num_dit_blocks(self) -> int:
        """Number of DiT blocks (``dit_blocks`` without building the model)."""
        cfg = self.transformer_config
        return int(cfg["num_layers"]) + int(cfg.get("num_single_layers", 0))

    @abstractmethod
    def latent_shape(self, t: RequestTemplate) -> tuple[int, ...]:
        """Latent tensor shape for the whole batch, as the pipeline's prepare_latents builds it."""

    @abstractmethod
    def token_counts(self, t: RequestTemplate) -> dict[str, int]:
        """Per-request sequence lengths by stream."""

    # ------------------------------------------------------------------ builders
    @abstractmethod
    def transformer_class(self) -> type[nn.Module]: ...

    @abstractmethod
    def vae_class(self) -> type[nn.Module]: ...

    def _build(self, cls: type[Any], config: dict[str, Any], subfolder: str, opts: BuildOptions) -> nn.Module:
        """Build one component module by module at its home (never whole on the device, then
        moved): meta tree from the config, then each module's tensors from the checkpoint or the
        seeded generator, on the device or the host as ``opts.host_modules`` says."""
        from xema_ray.models.loading import (
            CheckpointWeights,
            HostShare,
            SeededWeights,
            WeightSource,
            build_on_meta,
            checkpoint_dtype,
            materialize,
        )
        from xema_ray.placement import WeightHome, PLACEMENT_ATTR

        dtype = opts.dtype_for(subfolder)
        source: WeightSource
        if opts.weights_dir is not None:
            if opts.device == "meta":
                raise ValueError("weights_dir is for real execution; analysis on meta needs no weights")
            directory = Path(opts.weights_dir) / subfolder
            config_file = directory / "config.json"
            if not config_file.is_file():
                from xema_ray.models.loading import CheckpointError

                raise CheckpointError(f"{config_file}: missing (expected the {subfolder} component's config.json, "
                                      f"as save_pretrained writes it)")
            config = json.loads(config_file.read_text())
            log_cast(self.name, subfolder, checkpoint_dtype(directory), dtype)
            source = CheckpointWeights(directory)
        else:
            source = SeededWeights(opts.seed, subfolder)
        prefixes = tuple(p.removeprefix(subfolder + ".") for p in opts.host_modules if p.startswith(subfolder + "."))
        if opts.device == "meta" and not prefixes and not opts.place_on_meta:
            model = build_on_meta(cls, config, dtype, real_buffers=False)  # analysis: the meta tree is the model
        else:
            model = build_on_meta(cls, config, dtype)

            def home_of(path: str) -> WeightHome:
                host = any(path == p or path.startswith(p + ".") for p in prefixes)
                return WeightHome.HOST if host else WeightHome.DEVICE

            share = HostShare(f"{self.name}|{subfolder}", opts.app) if opts.share_host or opts.host_copy else None
            told = opts.placed
            report = materialize(model, torch.device(opts.device), dtype, source, home_of, share=share,
                                 host_copy=opts.host_copy, holder=opts.host_holder,
                                 placed=None if told is None else lambda path, m: told(subfolder, path, m))
            setattr(model, PLACEMENT_ATTR, report)
        if opts.component_dtypes and subfolder != "transformer":
            # components of two dtypes meet: each takes its inputs in its own (the transformer is
            # in the pipeline's dtype, which its inputs are made in; its children keep theirs)
            cast_inputs_to_own_dtype(model)
        return model

    def build_text_encoder(self, opts: BuildOptions) -> tuple[nn.Module | None, Any]:
        """(text encoder, tokenizer) placed as ``opts`` says, or (None, None) without one.

        A checkpoint's encoder is read tensor by tensor from its memory-mapped safetensors files
        (its stored names mapped to the model's by transformers' renaming rules), never whole on
        the CPU first, and placed module by module: on the device, or in an exact-size (pinned)
        host buffer for the parts that stream, or in a host buffer to run on the CPU. A
        random-weight encoder is built at the real config with seeded values the same way."""
        from xema_ray.placement import PLACEMENT_ATTR, WeightHome
        from xema_ray.models.loading import CheckpointWeights, HostShare, SeededWeights, WeightSource, materialize
        from xema_ray.models.text_encoders import (
            build_encoder_on_meta,
            build_tokenizer,
            checkpoint_keys,
            load_tokenizer,
            tied_keys,
        )

        placement = opts.encoder_placement()
        spec = self.text_encoder
        if placement is None or spec is None:
            return None, None
        dtype = opts.dtype_for("text_encoder")
        directory = Path(opts.weights_dir) / "text_encoder" if opts.weights_dir is not None else None
        tok_dir = Path(opts.weights_dir) / "tokenizer" if opts.weights_dir is not None else None
        tokenizer = load_tokenizer(tok_dir) if tok_dir is not None and tok_dir.is_dir() else build_tokenizer(spec)
        source: WeightSource
        model = build_encoder_on_meta(spec, dtype)
        if directory is not None and directory.is_dir():
            if opts.device == "meta":
                raise ValueError("weights_dir is for real execution; analysis on meta needs no weights")
            from xema_ray.models.loading import checkpoint_dtype

            log_cast(self.name, "text_encoder", checkpoint_dtype(directory), dtype)
            source = CheckpointWeights(directory, tied=tied_keys(model))
            source.keys = checkpoint_keys(model, source.files)
        else:
            source = SeededWeights(opts.seed, "text_encoder")
        device = torch.device("cpu") if placement == "cpu" and opts.device != "meta" else torch.device(opts.device)
        prefixes: tuple[str, ...] = spec.streamed_host_modules() if placement == "streamed" else ()
        if placement == "cpu":
            prefixes = ("",)  # all of it on the host: nothing on the device

        def home_of(path: str) -> WeightHome:
            host = any(p == "" or path == p or path.startswith(p + ".") for p in prefixes)
            return WeightHome.HOST if host else WeightHome.DEVICE

        share = (HostShare(f"{self.name}|text_encoder|{placement}", opts.app)
                 if opts.share_host or opts.host_copy else None)
        report = materialize(model, device, dtype, source, home_of, share=share, pinned=placement != "cpu",
                             host_copy=opts.host_copy, holder=opts.host_holder)
        setattr(model, PLACEMENT_ATTR, report)
        if placement == "streamed":
            from xema_ray.placement import WEIGHT_HOME_ATTR

            for _, unit in spec.units(model):
                setattr(unit, WEIGHT_HOME_ATTR, WeightHome.HOST.value)  # streamed by block offload's hooks
        return model, tokenizer

    def component_names(self) -> tuple[str, ...]:
        """The pipeline's weight-holding components, as ``model_index.json`` and the repository's
        folders name them (what ``BuildOptions.component_dtypes`` may address)."""
        return ("transformer", "vae", "text_encoder")

    def decode_components(self) -> tuple[str, ...]:
        """The components a decode stage of its own holds (``ExecutionConfig.decode``): what turns
        the denoised latents into the output. A video model's VAE; an image model's decode is too
        short to be worth a hand-over, so it offers none (empty: always decoded in place)."""
        return ("vae",) if self.kind == "video" else ()

    @property
    def hands_over_latents(self) -> bool:
        """Whether a serving group may decode this model's latents on a decode pool of its own
        (``decode_latents``); False: it decodes in place only."""
        return False

    def decode_latents(self, pipe: Any, latents: torch.Tensor) -> Any:
        """The frames a decode worker makes of one batch of denoised latents (the pipeline's own
        output with ``output_type="latent"``): a float array [B, F, H, W, 3] in [0, 1], what the
        pipeline itself returns with ``output_type="np"``."""
        raise NotImplementedError(f"{self.name} decodes in place only (no hand-over of its latents)")

    def scheduler(self, cls: type[Any], default_config: dict[str, Any], opts: BuildOptions) -> Any:
        """The pipeline's scheduler: the repository's ``scheduler/scheduler_config.json`` when
        ``opts.weights_dir`` has one, else ``default_config`` (the published repository's values).

        Raises:
            CheckpointError: the repository names another scheduler class (the analyzer traced
                this one: another may keep state across steps and allocate differently).
        """
        if opts.weights_dir is not None:
            path = Path(opts.weights_dir) / SCHEDULER_CONFIG
            config = checkpoint_scheduler_config(opts.weights_dir)
            if config is not None:
                named = config.get("_class_name", cls.__name__)
                if named != cls.__name__:
                    from xema_ray.models.loading import CheckpointError

                    raise CheckpointError(f"{path}: _class_name is {named!r}; {self.name} runs {cls.__name__} (its "
                                          "plans were traced with it)")
                return cls.from_config(config)
        return cls.from_config(default_config)

    def build_transformer(self, opts: BuildOptions) -> nn.Module:
        """The DiT denoiser (real weights, random weights or meta, per ``opts``)."""
        return self._build(self.transformer_class(), self.transformer_config, "transformer", opts)

    def build_vae(self, opts: BuildOptions) -> nn.Module:
        """The VAE (decoder used for the final pixels)."""
        return self._build(self.vae_class(), self.vae_config, "vae", opts)

    @abstractmethod
    def build_pipeline(self, opts: BuildOptions) -> DiffusionPipeline:
        """The model's real diffusers pipeline. Text encoders are loaded only with real weights;
        without them the pipeline is driven with prompt embeddings from ``prompt_embeddings``."""

    # ------------------------------------------------------------------ calling the pipeline
    @abstractmethod
    def prompt_embeddings(
        self, prompts: list[str], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """Pipeline kwargs holding prompt embeddings (and masks, negative prompts) for ``prompts``.

        Without real text encoders the embeddings are derived deterministically from each prompt
        (docs/measured-facts.md, "Prompts"): same prompt, same embedding, on every worker.
        """

    def encode_prompts(self, pipe: Any, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The same kwargs as ``prompt_embeddings``, from the pipeline's own text encoder run on ``device``."""
        raise NotImplementedError(f"{self.name} has no text encoder")

    def prompt_token_count(self, tokenizer: Any, prompt: str) -> int:
        """Tokens ``prompt`` takes before the pipeline truncates it to ``text_tokens``."""
        raise NotImplementedError(f"{self.name} has no text encoder")

    @abstractmethod
    def call_kwargs(self, t: RequestTemplate, guidance_scale: float | None = None) -> dict[str, Any]:
        """Pipeline ``__call__`` kwargs for a template, excluding prompts, generator and output type."""

    @property
    def default_guidance_scale(self) -> float:
        return 1.0

    def guidance_as_given(self, t: RequestTemplate, guidance_scale: float | None,
                          guidance_scale_2: float | None = None) -> tuple[float | None, float | None]:
        """A request's guidance scales as its batch key carries them: ``(None, None)`` where the
        pipeline would run them exactly as the model's defaults (a request that names the default
        explicitly joins the batches of those that name none), else as given. Judged on the call's
        own arguments (``call_kwargs``, the second expert's scale as the engine sets it), so a
        two-expert model's ``guidance_scale`` alone, which also sets the low-noise expert's, is the
        default only where both are.

        Example:
            >>> from xema_ray.models import get_model_spec
            >>> from xema_ray.templates import RequestTemplate
            >>> spec = get_model_spec("tiny-flux2")
            >>> t = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
            >>> spec.guidance_as_given(t, spec.default_guidance_scale), spec.guidance_as_given(t, 7.5)
            ((None, None), (7.5, None))
        """
        def call(g1: float | None, g2: float | None) -> dict[str, Any]:
            kwargs = self.call_kwargs(t, g1)
            if g2 is not None:
                kwargs["guidance_scale_2"] = g2
            return kwargs

        given = (guidance_scale, guidance_scale_2)
        return (None, None) if given != (None, None) and call(*given) == call(None, None) else given

    def transformer_passes_per_step(self) -> tuple[int, ...]:
        """Batch rows per request of each transformer call a denoising step makes: the one place
        a model states its guidance passes. By default (2,) with classifier-free guidance (the
        conditional and unconditional pass run as one doubled batch), else (1,); Wan2.2 and
        Qwen-Image run CFG as two calls, (1, 1); LTX-2 adds STG and modality isolation, (2, 1, 1)."""
        return (2,) if self.default_guidance_scale > 1 else (1,)

    def dit_batch_multiplier(self) -> int:
        """Transformer batch per request of its widest forward (``transformer_passes_per_step``).
        Temporary serialization of the transformer splits this batch (the CFG pair too, at batch 1)."""
        return max(self.transformer_passes_per_step(), default=1)

    def transformer_rows_per_step(self) -> int:
        """Transformer batch rows per request over all of a step's calls (``transformer_passes_per_step``)."""
        return sum(self.transformer_passes_per_step())

    def runs_guidance(self) -> bool:
        """Whether a step runs more than one transformer row per request (classifier-free guidance:
        the request takes a negative prompt)."""
        return self.transformer_rows_per_step() > 1

    @abstractmethod
    def dit_blocks(self, transformer: nn.Module) -> list[tuple[str, nn.Module]]:
        """The DiT blocks in execution order, as (path relative to the transformer, module):
        the units that block offload / HSDP / chunking address."""

    #: the (width, height, frames) the model is published for, and its reference step count: the
    #: templates a model outside the paper's set is planned and served with (``xema_ray.templates``)
    reference_sizes: tuple[tuple[int, int, int], ...] = ()
    reference_steps: int = 50
    #: the transformer layers the ``balanced`` tier stores quantized (``xema_ray.models.weight_formats``);
    #: None: its weights are never quantized, and it serves no ``balanced`` tier
    weight_quant: QuantRule | None = None

    def sequence_parallel_split(self) -> type[SPPlan] | None:
        """The split of this model's transformer for sequence parallelism (one of
        ``xema_ray.parallel.plans``: which inputs carry tokens, which outputs to gather); None: it
        has none and runs on one GPU per request (more GPUs are data-parallel replicas)."""
        return None

    @property
    def sequence_parallel(self) -> bool:
        """Whether the model has a sequence-parallel split (``sequence_parallel_split``)."""
        return self.sequence_parallel_split() is not None

    def sequence_parallel_for(self, t: RequestTemplate) -> bool:
        """``sequence_parallel`` for ``t`` (a template whose conditioning the split does not cover says no)."""
        return self.sequence_parallel

    #: denoising steps after the first that still allocate unlike the steady state (the analyzer
    #: and ``xema verify`` trace this many more before replicating)
    settling_steps: int = 0
    #: denoising steps an allocation of a step may stay alive for (1: freed by the next step's end;
    #: a multistep scheduler of order 2, UniPC, keeps each model output for 2); the analyzer traces
    #: ``step_lifetime - 1`` more steps and replicates with it (``analyzer.steps.expand_steps``)
    step_lifetime: int = 1

    def settling_steps_for(self, t: RequestTemplate) -> int:
        """``settling_steps`` for ``t`` (a model whose image path settles later says so per template)."""
        return self.settling_steps

    def expert_stages(self, t: RequestTemplate, scheduler_config: Mapping[str, Any] | None = None
                      ) -> tuple[ExpertStage, ...]:
        """Which transformer component runs which denoising steps (one stage: ``transformer``, all);
        ``scheduler_config``: the scheduler the pipeline loaded (None: the spec's own)."""
        return (ExpertStage(component="transformer", first_step=0, last_step=t.steps - 1),)

    def one_expert_call(self, pipe: Any) -> contextlib.AbstractContextManager[None]:
        """The pipeline's call running only ``transformer`` (for a model of several experts: the
        analyzer traces a few steps of one and labels the others' steps by ``expert_stages``)."""
        return contextlib.nullcontext()

    def block_work(self, t: RequestTemplate, rows: int) -> list[BlockCost]:
        """The cost model's per-block work of one transformer pass over ``rows`` batch rows (linear
        FLOPs, attention FLOPs, weight bytes, attended (tokens, width) pairs), analytic from the
        transformer config."""
        raise ValueError(f"no cost model for {self.name}: its spec states no block_work")

    def dit_block_paths(self) -> list[str]:
        """The DiT blocks' paths relative to the transformer, in execution order, from the config
        (``dit_blocks`` without building the model)."""
        return [f"transformer_blocks.{i}" for i in range(int(self.transformer_config["num_layers"]))]

    #: whether the VAE decoder keeps causal conv caches (per frame batch) that activation offload
    #: can move to the host (CogVideoX)
    offloadable_conv_caches: bool = False

    def vae_decoder_levels(self) -> tuple[list[int], list[int]] | None:
        """(channels, resnets) of each VAE decoder up level, lowest resolution first, for the cost
        model; None: read from a diffusers ``block_out_channels`` config."""
        return None

    def option_rules(self) -> OptionRules:
        """The per-request options the pipeline takes and their ranges (``xema_ray.models.options``):
        by default guidance in [0, 50], and a negative prompt wherever a step runs more than one
        transformer row per request (classifier-free guidance)."""
        return OptionRules(negative_prompt=self.runs_guidance(),
                           guidance_note="classifier-free guidance runs when > 1" if self.runs_guidance() else "")

    def tracing_shims(self, t: RequestTemplate) -> contextlib.AbstractContextManager[None]:
        """Patches that let the pipeline run on the meta device where it reads tensor *values*
        to pick shapes (``.item()``-style calls fail on meta). Each shim must perform the same
        allocations as the code it replaces, taking the value from the template instead."""
        return contextlib.nullcontext()

    def vae_decoder_modules(self, vae: nn.Module) -> list[tuple[str, nn.Module]]:
        """VAE decoder up-blocks (path relative to the VAE, module): where VAE chunking applies."""
        return [(f"decoder.up_blocks.{i}", b) for i, b in enumerate(vae.decoder.up_blocks)]

    # ------------------------------------------------------------------ helpers for subclasses
    @staticmethod
    def seeded_embedding(
        prompt: str, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype, salt: str = ""
    ) -> torch.Tensor:
        """A deterministic stand-in embedding for ``prompt`` (unit variance, like encoder outputs)."""
        if torch.device(device).type == "meta":  # only the shape exists there: draw nothing
            return torch.empty(shape, dtype=dtype, device="meta")
        digest = hashlib.sha256(f"{salt}\x00{prompt}".encode()).digest()
        gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        return x.to(device=device, dtype=dtype)
