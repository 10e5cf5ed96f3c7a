"""DiT chunking: sequence-chunked token-wise pieces of chosen DiT blocks (paper §5.2).

Inside a transformer block the peaks come from token-wise computations that run over the whole
sequence at once: the feed-forward (a 4x-wide intermediate), the q/k normalisation and the
rotary embedding (both upcast to fp32, so their temporaries are 2-4x the bf16 tensors they
read). Each of these is exact per token, so running it over ``chunks`` slices of the sequence
and writing each slice into one preallocated output gives the same result with temporaries a
``chunks``-th of the size. Attention itself is not chunked (its fused kernels are already
linear in memory).

- Feed-forwards and q/k norms are modules: ``TokenChunkHook`` replaces their forward.
- The rotary embedding is a function the attention processors call
  (``diffusers.models.embeddings.apply_rotary_emb``, LTX-2's ``apply_*_rotary_emb``). It is
  wrapped by ``_ChunkedRotary``, which chunks only while a chosen block is running
  (``DitChunkBlockHook`` sets that), so other blocks run the original code.

Tolerance: a matmul over a slice of rows may pick a different kernel blocking than over all
rows, so the feed-forward can differ from the unchunked one in the last bits (fp32 on CPU:
within 1e-5 relative); norms and rotary are element-wise per token and come out identical.

Example:
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> spec = get_model_spec("tiny-cogvideox")
    >>> pipe = spec.build_pipeline(BuildOptions())
    >>> h = apply_dit_chunking(spec.dit_blocks(pipe.transformer), DitChunkingConfig(blocks=(0,), chunks=4))
    >>> h.remove()
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Literal

import torch
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.mitigation.hooks import HOOK_NAMES, MemorySaving, MitigationHandle, check_blocks, hook_module

DitPart = Literal["ff", "qk_norm", "rotary"]
#: class names of token-wise feed-forward modules across the three models
FEED_FORWARD_CLASSES = ("FeedForward", "Flux2FeedForward")
QK_NORM_NAMES = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


class DitChunkingConfig(BaseModel):
    """Which blocks, how many chunks, which pieces."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: tuple[int, ...] = Field(description="indices into ModelSpec.dit_blocks")
    chunks: int = Field(ge=1, description="sequence slices")
    parts: tuple[DitPart, ...] = Field(default=("ff", "qk_norm", "rotary"), description="pieces to chunk")


def sequence_dim(t: torch.Tensor) -> int:
    """The sequence dimension of a token tensor: the longest one between batch and features
    ([B, S, D] -> 1, [B, H, S, D] -> 2)."""
    if t.ndim < 3:
        raise ValueError(f"expected a [batch, ..., sequence, features] tensor, got shape {tuple(t.shape)}")
    dims = range(1, t.ndim - 1)
    return max(dims, key=lambda d: (t.shape[d], d))


def _bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    step = -(-n // max(1, min(chunks, n)))
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def run_chunked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dim: int, chunks: int,
                other: Callable[[int, int], tuple[Any, ...]] = lambda a, b: ()) -> torch.Tensor:
    """``fn`` over ``chunks`` slices of ``x`` along ``dim``, written into one output allocated
    after the first slice (so only one slice's temporaries are alive at a time).

    ``other(a, b)`` gives extra positional arguments for the slice ``[a, b)``."""
    n = x.shape[dim]
    out: torch.Tensor | None = None
    for a, b in _bounds(n, chunks):
        part = fn(x.narrow(dim, a, b - a), *other(a, b))
        if out is None:
            shape = list(part.shape)
            shape[dim] = n
            out = torch.empty(shape, dtype=part.dtype, device=part.device)
        out.narrow(dim, a, b - a).copy_(part)
        del part
    if out is None:
        raise ValueError(f"cannot chunk an empty sequence (shape {tuple(x.shape)})")
    return out


class TokenChunkHook(ModelHook):
    """A token-wise module (feed-forward, q/k norm) run over sequence chunks."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks

    def new_forward(self, module: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        forward = self.fn_ref.original_forward
        if hidden_states.ndim < 3:
            return forward(hidden_states, *args, **kwargs)
        return run_chunked(lambda x: forward(x, *args, **kwargs), hidden_states, sequence_dim(hidden_states), self.chunks)


class _State(threading.local):
    chunks = 0


_STATE = _State()


class DitChunkBlockHook(ModelHook):
    """Marks a chosen block as running, so the wrapped rotary functions chunk inside it."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks
        self.outer = 0

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.outer = _STATE.chunks
        _STATE.chunks = self.chunks
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        _STATE.chunks = self.outer
        return output


def _slice_freq(f: Any, n: int, a: int, b: int) -> Any:
    """Slice a rotary table along its sequence dimension (the last non-feature dim of size n);
    tables without one broadcast and are passed whole."""
    if not isinstance(f, torch.Tensor):
        return f
    dims = [d for d in range(f.ndim - 1) if f.shape[d] == n]
    return f.narrow(dims[-1], a, b - a) if dims else f


class _ChunkedRotary:
    """Wraps a rotary function ``fn(x, freqs, ...)``; chunks along x's sequence dim when active."""

    def __init__(self, fn: Callable[..., torch.Tensor], seq_dim_of: Callable[[torch.Tensor, dict[str, Any]], int]) -> None:
        self.fn = fn
        self.seq_dim_of = seq_dim_of
        functools.update_wrapper(self, fn)

    def __call__(self, x: torch.Tensor, freqs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _STATE.chunks <= 1:
            return self.fn(x, freqs, *args, **kwargs)
        dim = self.seq_dim_of(x, kwargs)
        n = x.shape[dim]

        def part(xs: torch.Tensor, fs: Any) -> torch.Tensor:
            return self.fn(xs, fs, *args, **kwargs)

        def freqs_for(a: int, b: int) -> tuple[Any]:
            sliced = tuple(_slice_freq(f, n, a, b) for f in freqs) if isinstance(freqs, (tuple, list)) else _slice_freq(freqs, n, a, b)
            return (sliced,)

        return run_chunked(part, x, dim, _STATE.chunks, freqs_for)


def _rotary_targets() -> list[tuple[Any, str, Callable[[torch.Tensor, dict[str, Any]], int]]]:
    """(module, attribute, sequence-dim rule) of every rotary function the processors call."""
    from diffusers.models import embeddings
    from diffusers.models.transformers import transformer_flux2, transformer_ltx2

    def diffusers_dim(x: torch.Tensor, kw: dict[str, Any]) -> int:
        return int(kw.get("sequence_dim", 2))

    def ltx2_dim(x: torch.Tensor, kw: dict[str, Any]) -> int:
        return 1 if x.ndim == 3 else 2

    return [
        (embeddings, "apply_rotary_emb", diffusers_dim),  # CogVideoX's processor imports it at call time
        (transformer_flux2, "apply_rotary_emb", diffusers_dim),
        (transformer_ltx2, "apply_interleaved_rotary_emb", ltx2_dim),
        (transformer_ltx2, "apply_split_rotary_emb", ltx2_dim),
    ]


_PATCH_USERS = 0
_PATCH_ORIGINALS: list[tuple[Any, str, Any]] = []


def _install_rotary() -> None:
    """Wrap the rotary functions once for all users (the wrapper is inert outside chosen blocks)."""
    global _PATCH_USERS
    if _PATCH_USERS == 0:
        for mod, name, rule in _rotary_targets():
            original = getattr(mod, name)
            _PATCH_ORIGINALS.append((mod, name, original))
            setattr(mod, name, _ChunkedRotary(original, rule))
    _PATCH_USERS += 1


def _uninstall_rotary() -> None:
    global _PATCH_USERS
    _PATCH_USERS -= 1
    if _PATCH_USERS == 0:
        for mod, name, original in _PATCH_ORIGINALS:
            setattr(mod, name, original)
        _PATCH_ORIGINALS.clear()


def apply_dit_chunking(blocks: list[tuple[str, nn.Module]], config: DitChunkingConfig) -> MitigationHandle:
    """Chunk the chosen pieces of ``config.blocks`` into ``config.chunks`` sequence slices.

    Args:
        blocks: all DiT blocks in execution order (``ModelSpec.dit_blocks``).
        config: where and how much.
    """
    check_blocks("dit_chunking", config.blocks, len(blocks))
    unknown = set(config.parts) - {"ff", "qk_norm", "rotary"}
    if unknown or not config.parts:
        raise ValueError(f"dit_chunking: parts must be a non-empty subset of ff, qk_norm, rotary, got {config.parts}")
    handle = MitigationHandle("dit_chunking")
    if config.chunks == 1:
        return handle
    for i in sorted(config.blocks):
        block = blocks[i][1]
        for name, sub in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            wanted = ("ff" in config.parts and type(sub).__name__ in FEED_FORWARD_CLASSES) or (
                "qk_norm" in config.parts and leaf in QK_NORM_NAMES
            )
            if wanted and name:
                hook_module(handle, sub, TokenChunkHook(config.chunks), HOOK_NAMES["dit_chunk_tokens"])
        if "rotary" in config.parts:
            hook_module(handle, block, DitChunkBlockHook(config.chunks), HOOK_NAMES["dit_chunk_block"])
    if "rotary" in config.parts:
        _install_rotary()
        handle.add_undo(_uninstall_rotary)
    return handle


def estimate_dit_chunking(tokens: int, batch: int, hidden: int, ff_mult: float, elem: int, config: DitChunkingConfig) -> MemorySaving:
    """Saving at a chosen block's peak: the feed-forward's widest intermediate (``ff_mult``
    times the hidden width; the activation makes a second one) or, where the attention
    pre-processing peaks, the rotary fp32 temporaries (two fp32 copies of q or k), shrunk to
    one chunk. Reported as the larger of the two, since they are not live together.

    Example:
        >>> estimate_dit_chunking(1000, 1, 8, 4.0, 2, DitChunkingConfig(blocks=(0,), chunks=4)).per_phase
        {'dit': 96000}
    """
    keep = 1.0 / config.chunks
    ff = 2 * tokens * batch * hidden * ff_mult * elem if "ff" in config.parts else 0.0
    rot = 2 * tokens * batch * hidden * 4 if "rotary" in config.parts else 0.0
    saved = int(max(ff, rot) * (1 - keep)) if config.blocks else 0
    return MemorySaving(kind="dit_chunking", per_phase={"dit": saved},
                        note=f"{config.chunks} chunks over {tokens * batch} tokens")
