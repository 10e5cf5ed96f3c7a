"""An adapter file read and checked against the model it is for.

Users have LoRA safetensors as their trainers wrote them: diffusers/PEFT names
(``transformer.<module>.lora_A.weight``), PEFT's ``base_model.model.`` prefix, or a community
layout (kohya's ``lora_unet_*.lora_down.weight``, ai-toolkit's ``diffusion_model.*``, musubi's
Wan names, LTX-2's ``diffusion_model.*``). The key conversion is diffusers' own: each pipeline's
LoRA loader mixin (``Flux2Pipeline.lora_state_dict``, ``WanPipeline.lora_state_dict``, ...) turns
the file into diffusers names; this module only reads the file, hands its tensors to that
function and checks the result against the loaded model.

A refused file raises ``AdapterRejected`` naming the adapter and the first offending key (HTTP
4xx at the API); nothing of it was kept, so a refused adapter changes nothing served.

Scale: ``lora_alpha / r`` from the file's diffusers metadata (``lora_adapter_metadata``, with its
``alpha_pattern``), a per-module ``.alpha`` key a converter left, else 1 (the converters of kohya
files fold alpha into the weights, as diffusers does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

# an adapter's name (URL-safe) and what a request asks for: the request-side schemas, light to import
from xema_ray.lora_pool import LoraUse  # noqa: F401  (re-exported: xema_ray.lora.LoraUse)
# what crosses the API and the worker boundary about an adapter: light schemas and errors (re-exported here)
from xema_ray.lora_pool import (  # noqa: F401
    EXPERT_COMPONENTS, AdapterPathRefused, AdapterRejected, AdapterSource, ExpertFiles)

#: the pipeline components an adapter may adapt (Wan2.2 A14B has two experts)
ADAPTED_COMPONENTS = ("transformer", "transformer_2")


@dataclass(frozen=True)
class LoraLayer:
    """One target layer's factors: ``delta(x) = scale * (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoraAdapter:
    """An adapter read and checked: target layer path (``transformer.<module>``) -> its factors, on the host."""

    name: str
    model: str
    layers: dict[str, LoraLayer] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()  # keys the stated tolerance let through (not applied)

    @property
    def rank(self) -> int:
        return max((lay.rank for lay in self.layers.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(lay.a.numel() * lay.a.element_size() + lay.b.numel() * lay.b.element_size()
                   for lay in self.layers.values())

    def layers_per_component(self) -> dict[str, int]:
        """Layers it adapts per component (``transformer``, ``transformer_2``: the expert each adapts)."""
        out: dict[str, int] = {}
        for p in self.layers:
            comp = p.partition(".")[0]
            out[comp] = out.get(comp, 0) + 1
        return out


def _resolve_file(name: str, p: Path) -> Path:
    if not p.exists():
        raise AdapterRejected(f"adapter {name!r}: {p} does not exist (the path must be readable by the "
                              "model's workers)", name)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if len(files) != 1:
            raise AdapterRejected(f"adapter {name!r}: folder {p} must hold exactly one .safetensors file, "
                                  f"found {len(files)}", name)
        p = files[0]
    if p.suffix != ".safetensors":
        raise AdapterRejected(f"adapter {name!r}: {p.name} is not a .safetensors file (pickled checkpoints "
                              "are never loaded)", name)
    return p


def _read_safetensors(name: str, p: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import SafetensorError, safe_open

    try:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(p), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterRejected(f"adapter {name!r}: {p.name} is not a readable safetensors file ({e})",
                              name) from None
    raw = meta.get("lora_adapter_metadata")
    try:
        lora_meta = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        raise AdapterRejected(f"adapter {name!r}: its lora_adapter_metadata is not JSON", name) from None
    return tensors, lora_meta if isinstance(lora_meta, dict) else {}


def _convert(name: str, pipe_cls: type, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' own key conversion for the model's pipeline (``<Pipeline>.lora_state_dict``)."""
    convert = getattr(pipe_cls, "lora_state_dict", None)
    if convert is None:
        raise AdapterRejected(f"adapter {name!r}: {pipe_cls.__name__} has no LoRA loader in diffusers",
                              name)
    try:
        out = convert(dict(tensors))
    except (ValueError, KeyError, IndexError, RuntimeError) as e:  # a converter that met keys it does not know
        first = next(iter(tensors), None)
        raise AdapterRejected(f"adapter {name!r}: diffusers' {pipe_cls.__name__} LoRA conversion refused the "
                              f"file ({e})", name, first) from None
    if isinstance(out, tuple):  # some loaders return (state_dict, network_alphas)
        out = out[0]
    return dict(out)


def _alpha(meta: dict[str, Any], comp: str, module: str, rank: int) -> float | None:
    pattern = meta.get(f"{comp}.alpha_pattern") or {}
    for k, v in (pattern.items() if isinstance(pattern, dict) else ()):
        if module == k or module.endswith("." + k):
            return float(v) / rank
    alpha = meta.get(f"{comp}.lora_alpha")
    return float(alpha) / rank if alpha is not None else None


def _factor_pairs(state: dict[str, torch.Tensor],
                  components: dict[str, nn.Module]) -> tuple[dict[tuple[str, str], dict[str, torch.Tensor]], list[str]]:
    """The converted keys grouped per (component, module path) into ``lora_A`` / ``lora_B`` /
    ``alpha``; and the keys that name no adapted component or are no such factor, in key order."""
    pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key in sorted(state):
        comp, _, rest = key.partition(".")
        if comp not in components or not rest:
            unknown.append(key)
            continue
        for part in ("lora_A", "lora_B"):
            if rest.endswith(f".{part}.weight"):
                pairs.setdefault((comp, rest.removesuffix(f".{part}.weight")), {})[part] = state[key]
                break
        else:
            if rest.endswith(".alpha"):
                pairs.setdefault((comp, rest.removesuffix(".alpha")), {})["alpha"] = state[key]
            else:
                unknown.append(key)  # lora_magnitude (DoRA), lokr factors, biases: not served
    return pairs, unknown


def _checked_layer(name: str, comp: str, module: str, parts: dict[str, torch.Tensor], layer: nn.Module,
                   max_rank: int, meta: dict[str, Any], dtype: torch.dtype) -> LoraLayer:
    """One layer's factors, checked against the model's ``layer`` (a linear one, both factors, the
    shapes, the rank, finite values), and its scale (the file's alpha / rank, else 1)."""
    key = f"{comp}.{module}.lora_A.weight"
    if not isinstance(layer, nn.Linear):
        raise AdapterRejected(f"adapter {name!r}: key {key!r} targets a {type(layer).__name__}; only linear "
                              "layers are adapted", name, key)
    if "lora_A" not in parts or "lora_B" not in parts:
        missing = "lora_B" if "lora_A" in parts else "lora_A"
        raise AdapterRejected(f"adapter {name!r}: key {key!r} has no {missing} partner", name, key)
    a, b = parts["lora_A"], parts["lora_B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != layer.in_features or b.shape[0] != layer.out_features \
            or a.shape[0] != b.shape[1]:
        raise AdapterRejected(
            f"adapter {name!r}: key {key!r} has shapes A {tuple(a.shape)}, B {tuple(b.shape)}; layer {comp}.{module} "
            f"needs A [r, {layer.in_features}] and B [{layer.out_features}, r] (an adapter for another model or size?)",
            name, key)
    rank = int(a.shape[0])
    if rank > max_rank:
        raise AdapterRejected(f"adapter {name!r}: key {key!r} has rank {rank}, above the pool's max_rank {max_rank}",
                              name, key)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterRejected(f"adapter {name!r}: key {key!r} holds non-finite values", name, key)
    if "alpha" in parts:
        scale = float(parts["alpha"].float().item()) / rank
    else:
        found = _alpha(meta, comp, module, rank)
        scale = 1.0 if found is None else found
    return LoraLayer(a.to(dtype).contiguous(), b.to(dtype).contiguous(), scale)


def _to_expert(name: str, where: str, p: Path, state: dict[str, torch.Tensor], meta: dict[str, Any],
               component: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An expert slot's file: its converted keys (``transformer.``, ``transformer_2.``; diffusers'
    converter turned ``diffusion_model.`` into ``transformer.``) and metadata moved onto ``component``,
    as diffusers' ``load_into_transformer_2=True`` does. A file holding keys of both experts is refused
    (given as ``path``, it is split per expert)."""
    prefixes = {k.partition(".")[0] for k in state} & set(ADAPTED_COMPONENTS)
    if len(prefixes) > 1:
        raise AdapterRejected(f"adapter {name!r}: {where}: {p.name} holds keys of both experts (transformer. and "
                              "transformer_2.); give it as path to split it per expert", name, param=where)

    def moved(key: str) -> str:
        comp, dot, rest = key.partition(".")
        return f"{component}{dot}{rest}" if comp in ADAPTED_COMPONENTS else key

    return {moved(k): v for k, v in state.items()}, {moved(k): v for k, v in meta.items()}


def _read_file(source: AdapterSource, slot: str | None, path: Path, pipe_cls: type, components: dict[str, nn.Module],
               max_rank: int, dtype: torch.dtype) -> tuple[dict[str, LoraLayer], list[str]]:
    """One file of ``source`` (``slot``: its ``experts`` key, None for ``path``): its checked layers
    (``<component>.<module>``) and the keys naming no adapted layer."""
    name = source.name
    where = "path" if slot is None else f"experts.{slot}"
    if slot is not None and EXPERT_COMPONENTS[slot] not in components:
        raise AdapterRejected(f"adapter {name!r}: {where}: {source.model} has one expert (transformer), not a pair; "
                              "give its file as path", name, param="experts")
    p = _resolve_file(name, path)
    tensors, meta = _read_safetensors(name, p)
    if not tensors:
        raise AdapterRejected(f"adapter {name!r}: {p.name} holds no tensors", name)
    state = _convert(name, pipe_cls, tensors)
    if slot is not None:
        state, meta = _to_expert(name, where, p, state, meta, EXPERT_COMPONENTS[slot])
    pairs, unknown = _factor_pairs(state, components)
    modules = {c: dict(m.named_modules()) for c, m in components.items()}
    layers: dict[str, LoraLayer] = {}
    for (comp, module), parts in sorted(pairs.items()):
        layer = modules[comp].get(module)
        if layer is None:
            unknown.append(f"{comp}.{module}.lora_A.weight")
            continue
        layers[f"{comp}.{module}"] = _checked_layer(name, comp, module, parts, layer, max_rank, meta, dtype)
    if not layers:
        target = f"the {slot.replace('_', '-')} expert ({EXPERT_COMPONENTS[slot]}) of " if slot is not None else ""
        first = unknown[0] if unknown else next(iter(state), None)
        raise AdapterRejected(f"adapter {name!r}: {where}: no LoRA layer of {p.name} matches {target}{source.model} "
                              f"(first key {first!r}: an adapter for another model?)", name, first)
    return layers, unknown


def read_adapter(source: AdapterSource, pipe_cls: type, components: dict[str, nn.Module], max_rank: int,
                 max_unknown_keys: int = 0, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Read ``source``'s file(s) and check them against the loaded model.

    ``path``: one file, its keys landing where they name (``transformer.`` and ``diffusion_model.``:
    the high-noise expert; a file holding ``transformer.`` and ``transformer_2.`` keys is split per
    expert). ``experts``: each file adapts its slot's expert whatever its keys' prefix.

    Args:
        source: name, model and file(s).
        pipe_cls: the model's diffusers pipeline class (its ``lora_state_dict`` converts the keys).
        components: the model's adapted components by name (``transformer``, ``transformer_2``).
        max_rank: the pool's padded rank; a larger adapter is refused.
        max_unknown_keys: the stated tolerance: keys naming no layer of the model (or a component not
            adapted, such as a text encoder) that may be skipped; one more refuses the file.
        dtype: the factors' dtype (the model's compute dtype).

    Raises:
        AdapterRejected: missing, not safetensors, a conversion diffusers refuses, unknown keys beyond
            the tolerance, a target that is not a linear layer, wrong shapes, a rank above ``max_rank``,
            a file fitting no layer of its expert, ``experts`` on a one-expert model (``param``).

    Example:
        >>> read_adapter(AdapterSource(name="style", model="tiny-flux2", path="style.safetensors"),
        ...              type(pipe), {"transformer": pipe.transformer}, max_rank=64)  # doctest: +SKIP
    """
    name = source.name
    adapter = LoraAdapter(name=name, model=source.model)
    unknown: list[str] = []
    for slot, path in source.files():
        layers, skipped = _read_file(source, slot, path, pipe_cls, components, max_rank, dtype)
        adapter.layers.update(layers)
        unknown += skipped
    if len(unknown) > max_unknown_keys:
        first = unknown[0]
        raise AdapterRejected(
            f"adapter {name!r}: {len(unknown)} key(s) name no adapted layer of {source.model} (tolerance "
            f"{max_unknown_keys}), the first {first!r} (an adapter for another model, or a text-encoder LoRA?)",
            name, first)
    adapter.skipped = tuple(unknown)
    return adapter
