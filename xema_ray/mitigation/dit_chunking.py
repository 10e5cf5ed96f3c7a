"""DiT chunking: sequence-chunked token-wise pieces of chosen DiT blocks (paper §5.2, §8).

Inside a transformer block the peaks come from token-wise computations that run over the whole
sequence at once: the feed-forward (a 4x-wide intermediate), the q/k normalisation and the
rotary embedding (both upcast to fp32, so their temporaries are 2-4x the bf16 tensors they
read). Each of these is exact per token, so running it over ``chunks`` slices of the sequence
and writing each slice into one preallocated output gives the same result with temporaries a
``chunks``-th of the size.

Attention is chunked over query rows (part ``attention``): every query row's softmax reads all
keys and values but no other query, so attention over a slice of the queries against the whole
K and V is exact. Two levels:

- the attention call itself (any processor: ``F.scaled_dot_product_attention`` is wrapped while
  a chosen block runs, ``_ChunkedSDPA``): on CUDA's fused kernels this saves only the fp32
  log-sum-exp (their memory is already linear); on the math path (CPU) it saves the
  ``Sq x Sk`` score matrix;
- CogVideoX's processor (``QueryChunkedCogVideoXProcessor``): the query projection, its norm and
  rotary, the attention and the output projection run per query chunk, written into one
  output, so the whole-sequence query and attention output never exist (two of the ~seven
  sequence-sized tensors alive in its attention; K and V stay whole).

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
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.mitigation.hooks import HOOK_NAMES, MitigationHandle, check_blocks, hook_module

if TYPE_CHECKING:
    from xema_ray.mitigation.hsdp import Collective
    from xema_ray.models import ModelSpec

DitPart = Literal["ff", "qk_norm", "rotary", "attention"]
DIT_PARTS: tuple[DitPart, ...] = ("ff", "qk_norm", "rotary", "attention")
#: class names of token-wise feed-forward modules across the three models
FEED_FORWARD_CLASSES = ("FeedForward", "Flux2FeedForward")
QK_NORM_NAMES = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


class DitChunkingConfig(BaseModel):
    """Which blocks, how many chunks, which pieces."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: tuple[int, ...] = Field(description="indices into ModelSpec.dit_blocks")
    chunks: int = Field(ge=1, description="sequence slices")
    parts: tuple[DitPart, ...] = Field(default=DIT_PARTS, description="pieces to chunk")


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
    chunks = 0  # rotary chunks inside the running chosen block
    attention = 0  # attention query chunks inside it (0: off)


_STATE = _State()


class DitChunkBlockHook(ModelHook):
    """Marks a chosen block as running, so the wrapped rotary functions chunk inside it."""

    def __init__(self, chunks: int, attention: int = 0) -> None:
        super().__init__()
        self.chunks = chunks
        self.attention = attention
        self.outer: tuple[int, int] = (0, 0)
        self.sdpa: Any = None

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.outer = (_STATE.chunks, _STATE.attention)
        _STATE.chunks, _STATE.attention = self.chunks, self.attention
        if self.attention and not isinstance(F.scaled_dot_product_attention, _ChunkedSDPA):
            # wrap whatever SDPA is current (the analyzer's CUDA-like one while tracing)
            self.sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _ChunkedSDPA(self.sdpa)  # type: ignore[assignment]
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        _STATE.chunks, _STATE.attention = self.outer
        if self.sdpa is not None:
            F.scaled_dot_product_attention = self.sdpa
            self.sdpa = None
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
    unknown = set(config.parts) - set(DIT_PARTS)
    if unknown or not config.parts:
        raise ValueError(f"dit_chunking: parts must be a non-empty subset of {', '.join(DIT_PARTS)}, got {config.parts}")
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
        if "attention" in config.parts:
            _chunk_processors(handle, block, config.chunks)
        if "rotary" in config.parts or "attention" in config.parts:
            hook_module(handle, block, DitChunkBlockHook(config.chunks if "rotary" in config.parts else 1,
                                                         attention=config.chunks if "attention" in config.parts else 0),
                        HOOK_NAMES["dit_chunk_block"])
    if "rotary" in config.parts:
        _install_rotary()
        handle.add_undo(_uninstall_rotary)
    return handle


def apply(pipe: Any, spec: ModelSpec, config: DitChunkingConfig, comm: Collective | None = None) -> MitigationHandle:
    """The primitive's entry point: ``apply_dit_chunking`` on ``pipe.transformer``'s DiT blocks
    (``comm`` unused)."""
    return apply_dit_chunking(spec.dit_blocks(pipe.transformer), config)


# ---------------------------------------------------------------------------- attention
class _ChunkedSDPA:
    """``scaled_dot_product_attention`` over query-row slices, written into one output laid out
    as the fused kernels write it (BSHD, returned as a BHSD view)."""

    def __init__(self, sdpa: Callable[..., torch.Tensor]) -> None:
        self.sdpa = sdpa

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        chunks = _STATE.attention
        sq = query.shape[-2]
        if chunks <= 1 or query.ndim != 4 or sq < 2 or kwargs.get("is_causal") or args[1:2] == (True,):
            return self.sdpa(query, key, value, attn_mask, *args, **kwargs)
        b, h, _, _ = query.shape
        out = torch.empty((b, sq, h, value.shape[-1]), dtype=query.dtype, device=query.device).transpose(1, 2)
        for a, e in _bounds(sq, chunks):
            mask = attn_mask
            if mask is not None and mask.ndim >= 2 and mask.shape[-2] == sq:
                mask = mask.narrow(-2, a, e - a)
            part = self.sdpa(query.narrow(-2, a, e - a), key, value, mask, *args, **kwargs)
            out.narrow(-2, a, e - a).copy_(part)
            del part
        return out


class QueryChunkedCogVideoXProcessor:
    """CogVideoX's attention (``CogVideoXAttnProcessor2_0``, same arguments and result) with
    the query side run per chunk of the joint text + video sequence: projection, norm, rotary
    (on the chunk's video rows), attention against the whole K and V, output projection."""

    def __init__(self, original: Any, chunks: int) -> None:
        self.original = original
        self.chunks = chunks

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> Any:
        if attention_mask is not None or self.chunks <= 1:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask=attention_mask,
                                 image_rotary_emb=image_rotary_emb)
        from diffusers.models import embeddings  # looked up per call: DiT chunking may wrap it

        text = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch, seq, _ = hidden_states.shape
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        heads = attn.heads
        head_dim = key.shape[-1] // heads
        key = key.view(batch, -1, heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, heads, head_dim).transpose(1, 2)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None and not attn.is_cross_attention:
            key[:, :, text:] = embeddings.apply_rotary_emb(key[:, :, text:], image_rotary_emb)
        out: torch.Tensor | None = None
        for a, b in _bounds(seq, self.chunks):
            q = attn.to_q(hidden_states[:, a:b]).view(batch, -1, heads, head_dim).transpose(1, 2)
            if attn.norm_q is not None:
                q = attn.norm_q(q)
            lo = max(a, text)
            if image_rotary_emb is not None and b > lo:
                cos, sin = image_rotary_emb
                q[:, :, lo - a:] = embeddings.apply_rotary_emb(q[:, :, lo - a:], (cos[lo - text:b - text], sin[lo - text:b - text]))
            outer, _STATE.attention = _STATE.attention, 0  # already a query chunk: not cut again
            try:
                o = F.scaled_dot_product_attention(q, key, value, dropout_p=0.0, is_causal=False)
            finally:
                _STATE.attention = outer
            del q
            o = attn.to_out[1](attn.to_out[0](o.transpose(1, 2).reshape(batch, -1, heads * head_dim)))
            if out is None:
                out = torch.empty((batch, seq, o.shape[-1]), dtype=o.dtype, device=o.device)
            out[:, a:b].copy_(o)
            del o
        assert out is not None
        encoder_hidden_states, hidden_states = out.split([text, seq - text], dim=1)
        return hidden_states, encoder_hidden_states


def _chunk_processors(handle: MitigationHandle, block: nn.Module, chunks: int) -> None:
    """Swap CogVideoX attention processors inside ``block`` for the query-chunked one."""
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    for sub in block.modules():
        proc = getattr(sub, "processor", None)
        if type(proc) is CogVideoXAttnProcessor2_0:
            sub.processor = QueryChunkedCogVideoXProcessor(proc, chunks)

            def undo(m: nn.Module = sub, p: Any = proc) -> None:
                m.processor = p

            handle.add_undo(undo)


