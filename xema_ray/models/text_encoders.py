"""The models' text encoders: configs, builders, tokenizers made locally, meta-device shims.

| model   | encoder (transformers class)              | real size (bf16)  | prompt tokens |
|---------|-------------------------------------------|-------------------|---------------|
| Flux.2  | Mistral-Small-3.1 (Mistral3ForConditionalGeneration) | 23.3 B (46.7 GB) | 512 |
| CogVideoX-5B | T5-v1.1-XXL encoder (T5EncoderModel)  | 4.76 B (9.5 GB)   | 226           |
| LTX-2   | Gemma-3-12B (Gemma3ForConditionalGeneration) | 12.2 B (24.4 GB) | 1024          |
| Wan2.2  | UMT5-XXL encoder (UMT5EncoderModel)       | 5.7 B (11.4 GB)   | 512           |
| Qwen-Image | Qwen2.5-VL-7B (Qwen2_5_VLForConditionalGeneration) | 8.3 B (16.6 GB) | 512 (padded) |

Configs are in ``xema_ray/configs/*_text_encoder.json`` with their sources; the tiny versions
are sized to the tiny transformers' text widths. The encoder is built like every other
component (``loading.build_on_meta`` + ``materialize``), so its weights are placed module by
module at their home (device, host for streaming, or the CPU to run there).

Tokenizers are never downloaded: with real weights the checkpoint's tokenizer is loaded from
its directory; ``build_tokenizer`` makes a byte-level BPE tokenizer locally (trained in
milliseconds on a fixed corpus) for tiny checkpoints and for random-weight encoders.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

EncoderFamily = Literal["mistral3", "t5", "gemma3", "umt5", "qwen2_5_vl"]
#: encoder-only T5 architectures (T5, UMT5): one layer list under ``encoder.block``
T5_LIKE = ("t5", "umt5")

_CORPUS = (
    "a photo of a cat sitting on a red sofa in warm evening light. waves crash on a rocky shore at sunset. "
    "a fox runs through snow in a pine forest. a city street at night with neon signs and rain. "
    "an astronaut rides a horse on the moon, highly detailed, cinematic. a bowl of fruit on a wooden table. "
    "slow motion of a hummingbird drinking nectar from a flower. aerial view of mountains and a winding river. "
    "The quick brown fox jumps over the lazy dog 0123456789 !?,.;:'\"()-"
)


@dataclass(frozen=True)
class EncoderChoice:
    """The text encoder a registered model runs: its family and config (its prompt length is the
    spec's ``text_tokens``, so that the two cannot disagree: ``ModelSpec.text_encoder``)."""

    family: EncoderFamily
    config_file: str
    #: Flux.2 stacks these hidden states (None: the pipeline's own choice)
    out_layers: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TextEncoderSpec:
    """One model's text encoder."""

    family: EncoderFamily
    config_file: str
    max_tokens: int = 512
    #: Flux.2 stacks these hidden states (None: the pipeline's own choice)
    out_layers: tuple[int, ...] | None = None

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        from xema_ray.models.base import load_config

        return load_config(self.config_file)

    def model_class(self) -> type[nn.Module]:
        import transformers

        return getattr(transformers, self.config["_class"])

    def hf_config(self) -> Any:
        import transformers

        cfg = {k: v for k, v in self.config.items() if not k.startswith("_")}
        cls = {"mistral3": transformers.Mistral3Config, "t5": transformers.T5Config,
               "gemma3": transformers.Gemma3Config, "umt5": transformers.UMT5Config,
               "qwen2_5_vl": transformers.Qwen2_5_VLConfig}[self.family]
        return cls(**cfg) if self.family in T5_LIKE else cls.from_dict(cfg)

    def layers(self, encoder: nn.Module) -> list[tuple[str, nn.Module]]:
        """The encoder's transformer layers in execution order (what streaming offloads)."""
        if self.family in T5_LIKE:
            return [(f"encoder.block.{i}", b) for i, b in enumerate(encoder.encoder.block)]
        lm = encoder.model.language_model
        prefix = "model.language_model.layers"
        return [(f"{prefix}.{i}", b) for i, b in enumerate(lm.layers)]

    def unit_paths(self) -> tuple[str, ...]:
        """The parts a text encoding runs, in order, each streamed through the device on its own:
        the embedding, every layer, the final norm (and the LM head the forward also applies)."""
        n = self.num_layers
        if self.family in T5_LIKE:
            return ("shared", *(f"encoder.block.{i}" for i in range(n)), "encoder.final_layer_norm")
        lm = "model.language_model"
        return (f"{lm}.embed_tokens", *(f"{lm}.layers.{i}" for i in range(n)), f"{lm}.norm", "lm_head")

    def units(self, encoder: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(p, encoder.get_submodule(p)) for p in self.unit_paths()]

    def streamed_host_modules(self) -> tuple[str, ...]:
        """What lives on the host when the encoder streams: every unit it runs (brought in one by
        one) and the vision tower, which text encoding never runs."""
        if self.family in T5_LIKE:
            return self.unit_paths()
        if self.family == "qwen2_5_vl":  # Qwen2.5-VL's vision tower and merger are one module
            return (*self.unit_paths(), "model.visual")
        return (*self.unit_paths(), "model.vision_tower", "model.multi_modal_projector")

    @property
    def num_layers(self) -> int:
        cfg = self.config if self.family in T5_LIKE else self.config["text_config"]
        return int(cfg["num_layers"] if self.family in T5_LIKE else cfg["num_hidden_layers"])

    @property
    def vocab_size(self) -> int:
        cfg = self.config if self.family in T5_LIKE else self.config["text_config"]
        return int(cfg["vocab_size"])


def build_tokenizer(spec: TextEncoderSpec) -> Any:
    """A byte-level BPE tokenizer made here (no download), with the special tokens and the
    padding side each pipeline expects, and a chat template for Flux.2's ``apply_chat_template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>", "<s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    size = min(512, spec.vocab_size)
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    eos, bos = tok.token_to_id("</s>"), tok.token_to_id("<s>")
    if spec.family in T5_LIKE:  # T5 appends </s>
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", eos)])
    else:  # Mistral and Gemma start with <s> / <bos>
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", bos_token="<s>",
        model_max_length=spec.max_tokens, padding_side="left" if spec.family == "gemma3" else "right",
    )
    if spec.family == "mistral3":
        # Flux.2 formats prompts as chat messages whose content is a list of {"type": "text"} parts
        # (text parts only, empty ones skipped: a tiny encoder's few tokens go to the prompt)
        fast.chat_template = (
            "{% for m in messages %}{% if m['content'] is string %}{% if m['content'] %}{{ m['content'] + ' ' }}{% endif %}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' and c['text'] %}{{ c['text'] + ' ' }}"
            "{% endif %}{% endfor %}{% endif %}{% endfor %}"
        )
    return fast


def load_tokenizer(directory: Any) -> Any:
    """A checkpoint's tokenizer, as its repository ships it: ``tokenizer.json`` (Gemma), a
    SentencePiece ``spiece.model`` (CogVideoX's T5; needs ``sentencepiece``) or the text half of a
    processor folder (FLUX.2-dev's ``PixtralProcessor``: prompts are text only, and the processor's
    image half would need torchvision). The folder's chat template comes with it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def save_published_tokenizer(spec: TextEncoderSpec, tokenizer: Any, class_name: str, directory: Any) -> None:
    """Write ``tokenizer`` (``build_tokenizer``'s) into ``directory`` as a repository ships a
    tokenizer of ``class_name``: ``T5Tokenizer`` as a SentencePiece model trained here on the same
    corpus, ``GemmaTokenizerFast`` as its tokenizer.json, ``PixtralProcessor`` as the tokenizer and
    chat template with the processor's two config files beside them."""
    import json
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if class_name == "T5Tokenizer":
        import io

        import sentencepiece as spm

        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(_CORPUS.split(". ") * 8), model_writer=model, vocab_size=min(96, spec.vocab_size),
            model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, hard_vocab_limit=False, minloglevel=2)
        (d / "spiece.model").write_bytes(model.getvalue())
        config = {"tokenizer_class": "T5Tokenizer", "model_max_length": spec.max_tokens, "extra_ids": 0,
                  "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    elif class_name == "GemmaTokenizerFast":
        from transformers import GemmaTokenizer

        GemmaTokenizer(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>", eos_token="</s>",
                       unk_token="<unk>", bos_token="<s>", padding_side="left",
                       model_max_length=spec.max_tokens).save_pretrained(str(d))
    elif class_name == "PixtralProcessor":
        tokenizer.save_pretrained(str(d))
        (d / "processor_config.json").write_text(json.dumps(
            {"processor_class": "PixtralProcessor", "image_token": "[IMG]", "patch_size": 14, "spatial_merge_size": 2},
            indent=2))
        (d / "preprocessor_config.json").write_text(json.dumps(
            {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
             "patch_size": {"height": 14, "width": 14}, "size": {"longest_edge": 1540}}, indent=2))
    else:
        raise ValueError(f"no published tokenizer layout for {class_name!r}")


@contextlib.contextmanager
def meta_shims() -> Iterator[None]:
    """transformers decides whether an attention mask can be skipped by reading it
    (``padding_mask.all()``), which meta tensors cannot answer. Prompts are padded to the
    encoder's length, so a real run has padding and builds the mask: on meta it always does."""
    import transformers.masking_utils as mu

    saved = {n: getattr(mu, n) for n in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa") if hasattr(mu, n)}
    for n in saved:
        setattr(mu, n, lambda *a, **k: False)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(mu, n, f)


def encoder_weight_bytes(spec: TextEncoderSpec, dtype: torch.dtype) -> tuple[int, list[int]]:
    """(all weights, per layer) of the encoder at ``dtype``, from a meta build."""
    enc = build_encoder_on_meta(spec, dtype)
    total = sum(t.numel() * t.element_size() for t in [*enc.parameters(), *enc.buffers()])
    per_layer = [sum(p.numel() * p.element_size() for p in b.parameters()) for _, b in spec.layers(enc)]
    return total, per_layer


def checkpoint_keys(model: nn.Module, stored: Iterable[str]) -> dict[str, str]:
    """The model's tensor name -> its name in a transformers checkpoint, for the tensors whose
    names differ (checkpoints keep the layout they were saved in, e.g. Mistral-3's and Gemma-3's
    ``language_model.model.*`` for ``model.language_model.*``): transformers' own renaming rules
    for the model's class, applied to each stored name. A stored tensor that transformers would
    convert (split, merge) rather than rename cannot be read tensor by tensor: an error names it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from xema_ray.models.loading import CheckpointError

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    ours = model.state_dict()
    out = {}
    for key in stored:
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, ours)
        if converted is not None:
            raise CheckpointError(f"checkpoint tensor {key!r} needs transformers' conversion {converted!r} "
                                  "(not a renaming): this loader reads tensors as they are stored")
        if name != key:
            out[name] = key
    return out


def tied_keys(model: nn.Module) -> dict[str, str]:
    """The model's tied tensors (name -> the tensor it repeats), which checkpoints store once."""
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return dict(tied) if isinstance(tied, dict) else {}


def build_encoder_on_meta(spec: TextEncoderSpec, dtype: torch.dtype, real_buffers: bool = True) -> nn.Module:
    """The encoder's module tree: parameters on meta, buffers (rotary frequencies) computed on
    the CPU unless ``real_buffers`` is False (pure analysis)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from xema_ray.models.loading import parameters_on_meta

    where = parameters_on_meta() if real_buffers else torch.device("meta")
    with _disable_current_modes(), where:
        model = spec.model_class()._from_config(spec.hf_config(), dtype=dtype)
    return model.eval().requires_grad_(False)
