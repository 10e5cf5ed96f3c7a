"""The three published Hugging Face repositories as data: how each lays out its diffusers folders,
and the start-up check that a weights directory is one of them (or a tiny one laid out the same).

What is recorded, and from where (looked up, never downloaded):

- ``model_index.json`` classes: the repositories' own files (FLUX.2-dev's as duplicated in
  ``diffusers/FLUX.2-dev-bnb-4bit``; ``zai-org/CogVideoX-5b``; ``Lightricks/LTX-2``'s diffusers
  weights, PR #3).
- dtypes: CogVideoX-5b's VAE is fp32 (862 MB; the repository's commit "Upload VAE in fp32 (#23)"),
  its transformer and T5 encoder bf16; the other components bf16 as their repositories are
  published for ``torch_dtype=torch.bfloat16`` (the VAEs' stored dtype is not verified here: a
  component stored in another dtype is cast on load with a log line, so a wrong guess costs nothing).
- sharding: ``save_pretrained``'s default shard sizes (diffusers 10 GB, transformers 5 GB) split
  every transformer and text encoder of these sizes, never a VAE, scheduler or tokenizer.
- disk: the diffusers folders only (``hf download --include``), from the parameter counts at bf16.

Example:
    >>> layout = PUBLISHED["cogvideox"]
    >>> layout.repo, layout.components["vae"].dtype
    ('zai-org/CogVideoX-5b', 'float32')
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DTypeName = Literal["float32", "bfloat16", "float16"]


class PublishedComponent(BaseModel):
    """One folder of a repository, as its ``model_index.json`` names it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    library: str = Field(description="model_index.json's first entry: diffusers, transformers or a pipeline module (ltx2)")
    class_name: str = Field(description="model_index.json's second entry")
    dtype: DTypeName | None = Field(default=None, description="stored dtype of its weights (None: no weights)")
    sharded: bool = Field(default=False, description="weights split into shards with a *.safetensors.index.json")


class PublishedLayout(BaseModel):
    """One published repository's diffusers layout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    repo: str
    pipeline: str = Field(description="model_index.json's _class_name")
    gated: bool = Field(description="the repository asks users to accept its license before downloading")
    disk_gb: float = Field(description="the diffusers folders' size (hf download --include those folders)")
    components: dict[str, PublishedComponent]

    def include_patterns(self) -> list[str]:
        """``hf download --include`` patterns for the diffusers folders (not the single-file checkpoints
        the same repositories also hold at their root)."""
        return ["model_index.json", *(f"{c}/*" for c in sorted(self.components))]


def _c(library: str, class_name: str, dtype: DTypeName | None = None, sharded: bool = False) -> PublishedComponent:
    return PublishedComponent(library=library, class_name=class_name, dtype=dtype, sharded=sharded)


def _wan(repo: str, pipeline: str, disk_gb: float, experts: int) -> PublishedLayout:
    """A Wan2.2 repository's layout. Stored dtypes are assumed (bf16 weights, the fp32 Wan VAE),
    not read from those files."""
    transformers = {name: _c("diffusers", "WanTransformer3DModel", "bfloat16", sharded=True)
                    for name in ("transformer", "transformer_2")[:experts]}
    return PublishedLayout(repo=repo, pipeline=pipeline, gated=False, disk_gb=disk_gb, components={
        "scheduler": _c("diffusers", "UniPCMultistepScheduler"),
        "text_encoder": _c("transformers", "UMT5EncoderModel", "bfloat16", sharded=True),
        "tokenizer": _c("transformers", "T5TokenizerFast"),
        **transformers,
        "vae": _c("diffusers", "AutoencoderKLWan", "float32"),
    })


#: per model family (the real model and its tiny variant share the layout)
PUBLISHED: dict[str, PublishedLayout] = {
    "flux2": PublishedLayout(
        repo="black-forest-labs/FLUX.2-dev", pipeline="Flux2Pipeline", gated=True, disk_gb=112.0,
        components={
            "scheduler": _c("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": _c("transformers", "Mistral3ForConditionalGeneration", "bfloat16", sharded=True),
            "tokenizer": _c("transformers", "PixtralProcessor"),
            "transformer": _c("diffusers", "Flux2Transformer2DModel", "bfloat16", sharded=True),
            "vae": _c("diffusers", "AutoencoderKLFlux2", "bfloat16"),
        }),
    "cogvideox": PublishedLayout(
        repo="zai-org/CogVideoX-5b", pipeline="CogVideoXPipeline", gated=False, disk_gb=21.5,
        components={
            "scheduler": _c("diffusers", "CogVideoXDDIMScheduler"),
            "text_encoder": _c("transformers", "T5EncoderModel", "bfloat16", sharded=True),
            "tokenizer": _c("transformers", "T5Tokenizer"),
            "transformer": _c("diffusers", "CogVideoXTransformer3DModel", "bfloat16", sharded=True),
            "vae": _c("diffusers", "AutoencoderKLCogVideoX", "float32"),
        }),
    # CogVideoX-5B-I2V: the same components as CogVideoX-5b, its own transformer and pipeline
    # (stored dtypes as CogVideoX-5b's are assumed, not read from this repository's files)
    "cogvideox-i2v": PublishedLayout(
        repo="zai-org/CogVideoX-5b-I2V", pipeline="CogVideoXImageToVideoPipeline", gated=False, disk_gb=21.5,
        components={
            "scheduler": _c("diffusers", "CogVideoXDDIMScheduler"),
            "text_encoder": _c("transformers", "T5EncoderModel", "bfloat16", sharded=True),
            "tokenizer": _c("transformers", "T5Tokenizer"),
            "transformer": _c("diffusers", "CogVideoXTransformer3DModel", "bfloat16", sharded=True),
            "vae": _c("diffusers", "AutoencoderKLCogVideoX", "float32"),
        }),
    "ltx2": PublishedLayout(
        repo="Lightricks/LTX-2", pipeline="LTX2Pipeline", gated=True, disk_gb=64.0,
        components={
            "audio_vae": _c("diffusers", "AutoencoderKLLTX2Audio", "bfloat16"),
            "connectors": _c("ltx2", "LTX2TextConnectors", "bfloat16"),
            "scheduler": _c("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": _c("transformers", "Gemma3ForConditionalGeneration", "bfloat16", sharded=True),
            "tokenizer": _c("transformers", "GemmaTokenizerFast"),
            "transformer": _c("diffusers", "LTX2VideoTransformer3DModel", "bfloat16", sharded=True),
            "vae": _c("diffusers", "AutoencoderKLLTX2Video", "bfloat16"),
            "vocoder": _c("ltx2", "LTX2Vocoder", "bfloat16"),
        }),
    # Wan2.2 (Wan-AI's "-Diffusers" repositories, ``_wan``): T2V-A14B and I2V-A14B hold their two 14 B
    # experts as transformer and transformer_2 of one directory (I2V-A14B's model_index.json also
    # lists image_encoder and image_processor as [null, null]: Wan2.2 has no CLIP image encoder);
    # TI2V-5B has one transformer and the Wan2.2 VAE.
    "wan-a14b": _wan("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "WanPipeline", 126.0, experts=2),
    "wan-i2v-a14b": _wan("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "WanImageToVideoPipeline", 126.0, experts=2),
    "wan-ti2v-5b": _wan("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "WanPipeline", 34.0, experts=1),
    "qwen-image": PublishedLayout(
        repo="Qwen/Qwen-Image", pipeline="QwenImagePipeline", gated=False, disk_gb=58.0,
        components={
            "scheduler": _c("diffusers", "FlowMatchEulerDiscreteScheduler"),
            "text_encoder": _c("transformers", "Qwen2_5_VLForConditionalGeneration", "bfloat16", sharded=True),
            "tokenizer": _c("transformers", "Qwen2Tokenizer"),
            "transformer": _c("diffusers", "QwenImageTransformer2DModel", "bfloat16", sharded=True),
            "vae": _c("diffusers", "AutoencoderKLQwenImage", "bfloat16"),
        }),
}


class WeightsDirError(ValueError):
    """A model group's ``weights_dir`` is not a diffusers directory of its model (a start-up error)."""


def check_weights_dir(family: str, model: str, directory: Path, text_encoder: bool = True) -> None:
    """Refuse, before any worker starts, a ``weights_dir`` that cannot serve ``model``: missing,
    no ``model_index.json``, another pipeline's, or without a folder the model loads.

    Args:
        family: the model's family ("flux2", "cogvideox", "ltx2").
        model: its registry name (named in the messages).
        directory: the directory the YAML names.
        text_encoder: the group runs the repository's text encoder (its folder and tokenizer are needed).

    Raises:
        WeightsDirError: naming the directory, what is missing and how to get it.
    """
    layout = PUBLISHED[family]
    hint = (f"download it with: hf download {layout.repo} --local-dir {directory} --include "
            + " ".join(f"'{p}'" for p in layout.include_patterns()))
    if not directory.is_dir():
        raise WeightsDirError(f"{model}: weights_dir {directory} does not exist; {hint}")
    index = directory / "model_index.json"
    if not index.is_file():
        raise WeightsDirError(f"{model}: {index} is missing (a diffusers directory has one); {hint}")
    try:
        doc = json.loads(index.read_text())
    except json.JSONDecodeError as e:
        raise WeightsDirError(f"{model}: {index} is not JSON ({e}); {hint}") from None
    if doc.get("_class_name") != layout.pipeline:
        raise WeightsDirError(f"{model}: {index} is a {doc.get('_class_name')!r} directory, {model} needs a "
                              f"{layout.pipeline} one ({layout.repo})")
    needed = [c for c, comp in layout.components.items()
              if comp.dtype is not None and (text_encoder or c != "text_encoder")]
    if text_encoder:
        needed.append("tokenizer")
    missing = [c for c in needed if not (directory / c).is_dir()]
    if missing:
        raise WeightsDirError(f"{model}: {directory} has no {', '.join(missing)} folder(s) (incomplete download?); {hint}")
    for c in needed:
        if c != "tokenizer":
            _check_component(directory / c, model, hint)


def _check_component(folder: Path, model: str, hint: str) -> None:
    """A weights folder has its config.json and every shard its index names (an interrupted
    download leaves them out: found here, not by a worker half-way through loading)."""
    if not (folder / "config.json").is_file():
        raise WeightsDirError(f"{model}: {folder}/config.json is missing (incomplete download?); {hint}")
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        try:
            shards = set(json.loads(indexes[0].read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise WeightsDirError(f"{model}: {indexes[0]} is not a safetensors index ({e!r})") from None
        lost = sorted(f for f in shards if not (folder / f).is_file())
        if lost:
            raise WeightsDirError(f"{model}: {folder} lacks {len(lost)} of the {len(shards)} shards its index names, "
                                  f"e.g. {lost[0]} (incomplete download?); {hint}")
    elif not any(folder.glob("*.safetensors")):
        raise WeightsDirError(f"{model}: {folder} has no *.safetensors weights (incomplete download?); {hint}")
