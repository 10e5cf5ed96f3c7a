"""Where each model's token sequence is split at the transformer input and gathered at its output.

One mechanism serves every model (``sp.apply_sequence_parallel``); a plan only names the
inputs that carry tokens, the dimension they carry them in, and the outputs to gather — the
same information diffusers' ``_cp_plan`` holds, plus CogVideoX, which has none. Every tensor
that is per-token is split with the same shard sizes as its stream, so rotary embeddings and
position ids stay aligned with their tokens; per-batch inputs (timesteps, modulation) are left
whole.

Streams are split independently (text, image, video, audio), each into ``sp`` contiguous shards
(uneven allowed). Inside attention, a rank's sequence is the concatenation of its shards of
each stream; USP gathers the whole (permuted) sequence, which softmax attention without a mask
does not see. Attention whose keys come from an unsplit stream (LTX-2's text cross-attention)
runs locally: its queries are split, its keys are whole on every rank.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from xema_ray.parallel.attention import gather, shard, split_sizes
from xema_ray.parallel.groups import SPGroup


@dataclass
class ShardContext:
    """Shard sizes of one transformer call, per stream (filled by ``split``, read by ``gather``)."""

    group: SPGroup
    sizes: dict[str, list[int]] = field(default_factory=dict)

    def plan(self, stream: str, n: int, unit: int = 1) -> list[int]:
        sizes = split_sizes(n, self.group.size, unit)
        if stream in self.sizes and self.sizes[stream] != sizes:
            raise ValueError(f"stream {stream!r} split twice with different sizes: {self.sizes[stream]} vs {sizes}")
        self.sizes[stream] = sizes
        return sizes

    def split(self, x: torch.Tensor, stream: str, dim: int) -> torch.Tensor:
        """This rank's shard of ``x`` along ``dim``, with the sizes planned for ``stream``."""
        if stream not in self.sizes:
            self.plan(stream, x.shape[dim])
        return shard(x, dim, self.sizes[stream], self.group.rank)

    def gather(self, x: torch.Tensor, stream: str, dim: int) -> torch.Tensor:
        return gather(x, dim, self.sizes[stream], self.group.group)

    @property
    def uniform(self) -> bool:
        """All shards of every stream are equally long (then attention needs no length exchange)."""
        return all(len(set(s)) == 1 for s in self.sizes.values())


class SPPlan(ABC):
    """How one model family's transformer is split for sequence parallelism (a model's spec names
    its plan: ``ModelSpec.sequence_parallel_split``)."""

    #: attention modules (last name component) whose keys/values are not split: run locally
    local_attention: frozenset[str] = frozenset()

    def __init__(self, transformer: nn.Module) -> None:
        self.check(transformer)
        self.config = transformer.config

    def check(self, transformer: nn.Module) -> None:
        """Raise ValueError if this transformer's configuration cannot be split by the plan."""
        return None

    @abstractmethod
    def split(self, args: dict[str, Any], ctx: ShardContext) -> dict[str, Any]:
        """Forward kwargs with every per-token input replaced by this rank's shard."""

    @abstractmethod
    def gather(self, output: Any, ctx: ShardContext) -> Any:
        """The transformer output with every per-token output gathered back to full length."""


def _require(args: dict[str, Any], name: str, family: str) -> torch.Tensor:
    x = args.get(name)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{family} sequence parallelism needs the tensor input {name!r}, got {type(x).__name__}")
    return x


def _gather_first(output: Any, fn: Any) -> Any:
    """Apply ``fn`` to a diffusers output's ``sample`` (tuple element 0 or ``.sample``)."""
    if isinstance(output, tuple):
        return (fn(output[0]), *output[1:])
    output.sample = fn(output.sample)
    return output


class Flux2Plan(SPPlan):
    """Image tokens and text tokens split along the sequence, with their position ids."""

    def check(self, transformer: nn.Module) -> None:
        if transformer.config.patch_size != 1:
            raise ValueError(f"Flux.2 SP expects patch_size 1 (packed latents), got {transformer.config.patch_size}")

    def split(self, args: dict[str, Any], ctx: ShardContext) -> dict[str, Any]:
        if args.get("kv_cache_mode") is not None:
            raise ValueError(f"Flux.2 SP does not support reference-image KV caching (kv_cache_mode={args['kv_cache_mode']!r})")
        hs = _require(args, "hidden_states", "Flux.2")
        ehs = _require(args, "encoder_hidden_states", "Flux.2")
        ctx.plan("image", hs.shape[1])
        ctx.plan("text", ehs.shape[1])
        out = dict(args)
        out["hidden_states"] = ctx.split(hs, "image", 1)
        out["encoder_hidden_states"] = ctx.split(ehs, "text", 1)
        # ids are [B, S, 4] or [S, 4]: tokens are dim -2 either way
        out["img_ids"] = ctx.split(_require(args, "img_ids", "Flux.2"), "image", -2)
        out["txt_ids"] = ctx.split(_require(args, "txt_ids", "Flux.2"), "text", -2)
        return out

    def gather(self, output: Any, ctx: ShardContext) -> Any:
        return _gather_first(output, lambda x: ctx.gather(x, "image", 1))


class CogVideoXPlan(SPPlan):
    """The latent video is split along its height in whole patches, so each rank's tokens are
    (frame, local rows, column) in the model's own order and its unpatchify still works on the
    local latent; the text is split along the sequence; the rotary table, computed by the
    pipeline for the whole grid, is cut to the same rows."""

    def check(self, transformer: nn.Module) -> None:
        cfg = transformer.config
        if cfg.patch_size_t is not None:
            raise ValueError(f"CogVideoX SP supports CogVideoX 1.0 (patch_size_t None), got patch_size_t={cfg.patch_size_t}")
        if getattr(transformer.patch_embed, "use_positional_embeddings", False):
            raise ValueError("CogVideoX SP needs rotary position embeddings; learned positional embeddings cover the whole grid")

    def split(self, args: dict[str, Any], ctx: ShardContext) -> dict[str, Any]:
        hs = _require(args, "hidden_states", "CogVideoX")  # [B, F, C, H, W]
        ehs = _require(args, "encoder_hidden_states", "CogVideoX")
        p = int(self.config.patch_size)
        _, frames, _, height, width = hs.shape
        rows = ctx.plan("rows", height, unit=p)
        ctx.plan("text", ehs.shape[1])
        out = dict(args)
        out["hidden_states"] = shard(hs, 3, rows, ctx.group.rank)
        out["encoder_hidden_states"] = ctx.split(ehs, "text", 1)
        rope = args.get("image_rotary_emb")
        if rope is not None:
            grid = (frames, height // p, width // p)
            patch_rows = [n // p for n in rows]
            out["image_rotary_emb"] = tuple(
                shard(t.reshape(*grid, t.shape[-1]), 1, patch_rows, ctx.group.rank).reshape(-1, t.shape[-1]) for t in rope
            )
        return out

    def gather(self, output: Any, ctx: ShardContext) -> Any:
        return _gather_first(output, lambda x: ctx.gather(x, "rows", 3))


class LTX2Plan(SPPlan):
    """Video and audio tokens split along the sequence with their RoPE coordinates; the text
    (prompt) stays whole, so the text cross-attentions (``attn2``, ``audio_attn2``) run locally.
    Audio<->video cross-attention has split queries and split keys: USP handles it like
    self-attention (the all-to-alls of queries and of keys are independent)."""

    local_attention = frozenset({"attn2", "audio_attn2"})

    def split(self, args: dict[str, Any], ctx: ShardContext) -> dict[str, Any]:
        for name in ("video_coords", "audio_coords"):
            _require(args, name, "LTX-2")  # computed whole inside forward otherwise
        if args.get("video_self_attention_mask") is not None:
            raise ValueError("LTX-2 SP does not support video_self_attention_mask (a token x token mask)")
        hs = _require(args, "hidden_states", "LTX-2")
        ahs = _require(args, "audio_hidden_states", "LTX-2")
        ctx.plan("video", hs.shape[1])
        ctx.plan("audio", ahs.shape[1])
        out = dict(args)
        out["hidden_states"] = ctx.split(hs, "video", 1)
        out["audio_hidden_states"] = ctx.split(ahs, "audio", 1)
        out["video_coords"] = ctx.split(args["video_coords"], "video", 2)  # [B, 3, N, 2]
        out["audio_coords"] = ctx.split(args["audio_coords"], "audio", 2)  # [B, 1, N_audio, 2]
        if args.get("video_keyframes_mask") is not None:
            out["video_keyframes_mask"] = ctx.split(args["video_keyframes_mask"], "video", 1)
        return out

    def gather(self, output: Any, ctx: ShardContext) -> Any:
        if isinstance(output, tuple):
            return (ctx.gather(output[0], "video", 1), ctx.gather(output[1], "audio", 1), *output[2:])
        output.sample = ctx.gather(output.sample, "video", 1)
        output.audio_sample = ctx.gather(output.audio_sample, "audio", 1)
        return output


class WanPlan(SPPlan):
    """Wan2.x: the latent video split along its height in whole patches (as CogVideoX's), so each
    rank's tokens are (frame, local rows, column) in the model's order and its unpatchify works on
    the local latent. The rotary table, which Wan computes inside forward from the latent's shape,
    is computed for the whole grid and cut to the same rows (``_RowRope``); per-token timesteps
    (TI2V-5B) are cut alike. The prompt stays whole, so the cross-attention (``attn2``) runs
    locally. Each expert of Wan2.2-A14B gets the plan on its own (the engine installs SP on both)."""

    local_attention = frozenset({"attn2"})

    def check(self, transformer: nn.Module) -> None:
        if getattr(transformer.config, "image_dim", None):
            raise ValueError("Wan SP covers text-to-video; image conditioning (image_dim) is not split")
        self.rope = transformer.rope

    def split(self, args: dict[str, Any], ctx: ShardContext) -> dict[str, Any]:
        hs = _require(args, "hidden_states", "Wan")  # [B, C, F, H, W]
        p_t, p_h, p_w = (int(v) for v in self.config.patch_size)
        _, _, frames, height, width = hs.shape
        rows = ctx.plan("rows", height, unit=p_h)
        grid = (frames // p_t, height // p_h, width // p_w)
        patch_rows = [n // p_h for n in rows]
        out = dict(args)
        out["hidden_states"] = shard(hs, 3, rows, ctx.group.rank)
        ts = args.get("timestep")
        if isinstance(ts, torch.Tensor) and ts.ndim == 2:  # one timestep per token, (f, h, w) order
            out["timestep"] = shard(ts.reshape(ts.shape[0], *grid), 2, patch_rows, ctx.group.rank).reshape(ts.shape[0], -1)
        _RowRope(self.rope, hs, out["hidden_states"].shape, patch_rows, ctx.group.rank)
        return out

    def gather(self, output: Any, ctx: ShardContext) -> Any:
        vars(self.rope).pop("forward", None)
        return _gather_first(output, lambda x: ctx.gather(x, "rows", 3))


class _RowRope:
    """Installed as ``rope.forward`` for one split call: called with the local latent, it returns
    the whole grid's table cut to this rank's rows (any other shape: the rope's own answer)."""

    def __init__(self, rope: nn.Module, whole: torch.Tensor, local: torch.Size, patch_rows: list[int], rank: int) -> None:
        self.own = type(rope).forward.__get__(rope)
        self.whole = whole.new_empty(()).expand(whole.shape)  # its shape only: no memory
        self.local, self.patch_rows, self.rank = tuple(local), patch_rows, rank
        rope.forward = self

    def __call__(self, hidden_states: torch.Tensor) -> Any:
        if tuple(hidden_states.shape) != self.local:
            return self.own(hidden_states)
        full = self.own(self.whole)
        b, c, f, h, w = self.whole.shape
        p_t, p_h, p_w = self.own.__self__.patch_size
        grid = (f // p_t, h // p_h, w // p_w)
        return tuple(shard(t.reshape(*grid, t.shape[-1]), 1, self.patch_rows, self.rank).reshape(1, -1, 1, t.shape[-1])
                     for t in full)


def bind_arguments(forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Positional and keyword arguments of a forward call as one name -> value dict."""
    bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    return dict(bound.arguments)
