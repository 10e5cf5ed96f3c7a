"""Adapter files made locally, in the key layouts trainers publish (tests, benchmarks, the demo).

Nothing is downloaded: the factors are seeded random tensors shaped for a loaded model, written
as safetensors in one of these layouts:

- ``diffusers``: ``transformer.<module>.lora_A.weight`` / ``lora_B.weight`` with diffusers'
  ``lora_adapter_metadata`` (``r``, ``lora_alpha``, ``target_modules``), as
  ``save_lora_weights`` writes it;
- ``peft``: ``base_model.model.<module>.lora_A.weight`` (PEFT's ``save_pretrained`` names);
- ``ai-toolkit-flux2``: Flux.2's original names as ai-toolkit writes them
  (``diffusion_model.double_blocks.<i>.img_attn.qkv.lora_A.weight``, ``single_blocks.<i>.linear1``,
  ...: fused q/k/v, which diffusers' converter splits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from torch import nn

Layout = Literal["diffusers", "peft", "ai-toolkit-flux2"]


def block_linears(transformer: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers inside the DiT blocks (what LoRA trainers target), by module path."""
    return {n: m for n, m in transformer.named_modules() if isinstance(m, nn.Linear) and "blocks." in n}


def _factors(g: torch.Generator, rank: int, n_in: int, n_out: int, std: float) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(rank, n_in, generator=g) * std
    b = torch.randn(n_out, rank, generator=g) * std
    return a, b


def write_adapter(path: Path, transformer: nn.Module, rank: int = 4, seed: int = 0, layout: Layout = "diffusers",
                  alpha: float | None = None, std: float = 0.1) -> Path:
    """Write a seeded adapter for ``transformer`` at ``path`` (a ``.safetensors`` file).

    Args:
        path: the file to write.
        transformer: the model's DiT (its block linears are the targets).
        rank: LoRA rank.
        seed: the factors' seed.
        layout: the key layout (module docstring).
        alpha: ``lora_alpha`` stored in diffusers' metadata (``diffusers`` layout; None: = rank).
        std: the factors' standard deviation.

    Returns:
        ``path``.
    """
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    metadata = {"format": "pt"}
    targets = block_linears(transformer)
    if layout in ("diffusers", "peft"):
        prefix = "transformer." if layout == "diffusers" else "base_model.model."
        for name, m in sorted(targets.items()):
            a, b = _factors(g, rank, m.in_features, m.out_features, std)
            tensors[f"{prefix}{name}.lora_A.weight"] = a
            tensors[f"{prefix}{name}.lora_B.weight"] = b
        if layout == "diffusers":
            meta = {"transformer.r": rank, "transformer.lora_alpha": alpha if alpha is not None else rank,
                    "transformer.target_modules": sorted(targets)}
            metadata["lora_adapter_metadata"] = json.dumps(meta, sort_keys=True)
    elif layout == "ai-toolkit-flux2":
        double = sorted({int(n.split(".")[1]) for n in targets if n.startswith("transformer_blocks.")})
        single = sorted({int(n.split(".")[1]) for n in targets if n.startswith("single_transformer_blocks.")})
        for i in double:
            d = f"transformer_blocks.{i}"
            for orig, q, diff in (("img_attn.qkv", "attn.to_q", None), ("txt_attn.qkv", "attn.add_q_proj", None),
                                  ("img_attn.proj", None, "attn.to_out.0"), ("txt_attn.proj", None, "attn.to_add_out"),
                                  ("img_mlp.0", None, "ff.linear_in"), ("img_mlp.2", None, "ff.linear_out"),
                                  ("txt_mlp.0", None, "ff_context.linear_in"), ("txt_mlp.2", None, "ff_context.linear_out")):
                m = targets[f"{d}.{q or diff}"]
                n_out = 3 * m.out_features if q else m.out_features
                a, b = _factors(g, rank, m.in_features, n_out, std)
                tensors[f"diffusion_model.double_blocks.{i}.{orig}.lora_A.weight"] = a
                tensors[f"diffusion_model.double_blocks.{i}.{orig}.lora_B.weight"] = b
        for i in single:
            for orig, diff in (("linear1", "attn.to_qkv_mlp_proj"), ("linear2", "attn.to_out")):
                m = targets[f"single_transformer_blocks.{i}.{diff}"]
                a, b = _factors(g, rank, m.in_features, m.out_features, std)
                tensors[f"diffusion_model.single_blocks.{i}.{orig}.lora_A.weight"] = a
                tensors[f"diffusion_model.single_blocks.{i}.{orig}.lora_B.weight"] = b
    else:
        raise ValueError(f"unknown adapter layout {layout!r}; one of diffusers, peft, ai-toolkit-flux2")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path
