"""The only place that imports xfuser (xDiT). Imported lazily, and only on CUDA: xfuser raises
"No Accelerators" at import on a machine without one and imports triton at top level
(docs/measured-facts.md, "SP layer"). Its parallel state is process-global, so we do not call its
``initialize_model_parallel``; we build its USP attention (yunchang's ``LongContextAttention``
underneath) with the process groups of the batch's SP group in place.

yunchang's constructor reads its process-global ``PROCESS_GROUP`` and asserts one is set ("use
set_seq_parallel_pg() first"), so ``build_long_context_attention`` sets the batch's groups there
for the constructor only and restores what was there before: other SP groups' attentions, built
earlier or later in the same worker, keep their own groups. yunchang imports without an
accelerator, so CPU tests exercise this construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from xema_ray.parallel.groups import SPGroup

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
A = TypeVar("A")


@contextlib.contextmanager
def _yunchang_groups(ulysses: Any, ring: Any) -> Iterator[None]:
    """yunchang's global Ulysses / ring groups set to these, restored on exit."""
    from yunchang.globals import PROCESS_GROUP

    saved = (PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG)
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = ulysses, ring
    try:
        yield
    finally:
        PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = saved


def build_long_context_attention(cls: Callable[..., A], group: SPGroup, **kwargs: Any) -> A:
    """``cls(**kwargs)`` — yunchang's ``LongContextAttention`` or a subclass such as xfuser's
    ``xFuserLongContextAttention`` — built over ``group``'s Ulysses and ring groups.

    Example (CPU, gloo, inside an initialised worker set):
        >>> from yunchang import LongContextAttention  # doctest: +SKIP
        >>> attn = build_long_context_attention(LongContextAttention, groups.select(2, 1))  # doctest: +SKIP
    """
    with _yunchang_groups(group.ulysses_group, group.ring_group):
        attn = cls(**kwargs)
    if getattr(attn, "ulysses_pg", None) is not group.ulysses_group or getattr(attn, "ring_pg", None) is not group.ring_group:
        raise RuntimeError(f"{getattr(cls, '__name__', cls)} did not take the SP group's process groups")
    return attn


def xfuser_available() -> bool:
    """True when xfuser imports (an accelerator is present and the package is installed)."""
    try:
        import xfuser.core.long_ctx_attention  # noqa: F401
    except Exception:  # ImportError, or xfuser's RuntimeError("No Accelerators")
        return False
    return True


def make_xfuser_usp(group: SPGroup) -> AttentionFn:
    """xDiT's USP attention over ``group``'s Ulysses and ring groups, as ``(q, k, v, scale)``
    in SDPA layout ``[B, H, S, D]`` (xfuser wants ``[B, S, H, D]``).

    Only for equal shard lengths: yunchang's all-to-all splits evenly; the SP layer routes
    uneven shards to our own implementation."""
    from xfuser.core.long_ctx_attention import xFuserLongContextAttention

    attn = build_long_context_attention(xFuserLongContextAttention, group)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out = attn(None, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
        return out.transpose(1, 2)

    return run
