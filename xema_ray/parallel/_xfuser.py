"""The only place that imports xfuser (xDiT). Imported lazily, and only on CUDA: xfuser raises
"No Accelerators" at import on a machine without one and imports triton at top level
(ARCHITECTURE.md). Its parallel state is process-global, so we do not call its
``initialize_model_parallel``; we build its USP attention (yunchang's ``LongContextAttention``
underneath) and hand it the process groups of the batch's SP group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xema_ray.parallel.groups import SPGroup

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


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

    attn = xFuserLongContextAttention()
    # the constructor read yunchang's global PROCESS_GROUP; point it at this batch's groups
    attn.ulysses_pg = group.ulysses_group
    attn.ring_pg = group.ring_group

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out = attn(None, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
        return out.transpose(1, 2)

    return run
