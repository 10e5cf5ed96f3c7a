"""Sequence parallelism for a diffusers transformer: split at the input, USP inside, gather at
the output (ARCHITECTURE.md, "SP layer").

``apply_sequence_parallel(transformer, split, group)`` installs two kinds of removable hooks,
in the style of diffusers' ``HookRegistry`` (an instance ``forward`` that shadows the class's,
deleted on removal):

* on the transformer: bind the call's arguments, replace every per-token input by this rank's
  shard (``plans``), run the original forward, gather the outputs;
* on each attention module whose keys are split: while its forward runs, a
  ``TorchFunctionMode`` routes ``F.scaled_dot_product_attention`` (what every diffusers
  processor ends in, CogVideoX's directly and Flux.2's/LTX-2's through ``dispatch_attention_fn``'s
  native backend) to USP attention over the batch's group. The mode is active only inside
  attention modules, so the rest of the model runs without interception.

USP's backend is xDiT's (``_xfuser``) on CUDA when xfuser is installed and the shards are even,
else ours (``attention``), which is also what runs over gloo on CPU.

Example (each rank of a 2-worker set)::

    groups = init_process_groups(ParallelConfig(rank=r, world_size=2, init_method=url))
    with apply_sequence_parallel(pipe.transformer, spec.sequence_parallel_split(), groups.select(ulysses=2, ring=1)):
        image = pipe(...)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.overrides import TorchFunctionMode

from xema_ray.parallel.attention import (
    attention_with_lse,
    exchange_lengths,
    heads_to_seq,
    ring_attention,
    seq_to_heads,
)
from xema_ray.parallel.groups import SPGroup
from xema_ray.parallel.plans import ShardContext, SPPlan, bind_arguments

SPBackend = Literal["auto", "native", "xfuser"]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class USPAttention:
    """USP over one SP group: Ulysses all-to-all inside ``group.ulysses_group``, ring attention
    inside ``group.ring_group``, both of degree 1 allowed.

    ``ctx`` (the current transformer call's shard sizes) says whether shards are even; if not,
    each call first exchanges every rank's query and key lengths (a few bytes)."""

    def __init__(self, group: SPGroup, backend: SPBackend = "auto") -> None:
        self.group = group
        self.backend = backend
        self.ctx: ShardContext | None = None
        self._xfuser: AttentionFn | None = None
        self.calls = 0

    def _xfuser_fn(self, q: torch.Tensor) -> AttentionFn | None:
        if self.backend == "native" or q.device.type != "cuda":
            if self.backend == "xfuser":
                raise ValueError(f"the xfuser USP backend needs CUDA tensors, got {q.device}")
            return None
        if self._xfuser is None:
            from xema_ray.parallel import _xfuser

            if not _xfuser.xfuser_available():
                if self.backend == "xfuser":
                    raise ValueError("backend='xfuser' was requested but xfuser cannot be imported")
                return None
            self._xfuser = _xfuser.make_xfuser_usp(self.group)
        return self._xfuser

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        g = self.group
        u, r = g.layout.ulysses, g.layout.ring
        self.calls += 1
        uniform = self.ctx is not None and self.ctx.uniform
        if uniform and q.shape[2] == k.shape[2]:
            fn = self._xfuser_fn(q)
            if fn is not None:
                return fn(q, k, v, scale)
        if uniform:
            lengths = [[q.shape[2], k.shape[2]]] * g.size
        else:
            lengths = exchange_lengths([q.shape[2], k.shape[2]], g.group)
        # group rank = ring_rank * u + ulysses_rank (groups.py): my Ulysses peers are a run of u
        peers = [g.ring_rank * u + j for j in range(u)]
        q_lens = [lengths[p][0] for p in peers]
        kv_lens = [lengths[p][1] for p in peers]
        if u > 1:
            q = seq_to_heads(q, q_lens, g.ulysses_group)
            k = seq_to_heads(k, kv_lens, g.ulysses_group)
            v = seq_to_heads(v, kv_lens, g.ulysses_group)
        if r > 1:
            # after the all-to-all, ring member i holds the keys of Ulysses block i
            ring_kv = [sum(lengths[i * u + j][1] for j in range(u)) for i in range(r)]
            out = ring_attention(q, k, v, scale, ring_kv, g.ring_rank, g.ring_group)
        else:
            out = attention_with_lse(q, k, v, scale)[0]
        if u > 1:
            out = heads_to_seq(out, q_lens, g.ulysses_rank, g.ulysses_group)
        return out


class _SDPAToUSP(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to USP; every other call passes through."""

    def __init__(self, usp: USPAttention) -> None:
        super().__init__()
        self.usp = usp

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._sdpa(*args, **kwargs)

    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or is_causal or dropout_p or enable_gqa:
            raise ValueError(
                "USP attention over split keys supports neither masks, causal attention, dropout nor GQA "
                f"(attn_mask={'set' if attn_mask is not None else None}, is_causal={is_causal}, "
                f"dropout_p={dropout_p}, enable_gqa={enable_gqa})"
            )
        return self.usp(query, key, value, scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))


def _is_attention(module: nn.Module) -> bool:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return isinstance(module, (Attention, AttentionModuleMixin))


class SequenceParallelHandle:
    """What ``apply_sequence_parallel`` installed; ``remove()`` (or leaving the ``with``) restores
    the original forwards."""

    def __init__(self, transformer: nn.Module, plan: SPPlan, usp: USPAttention) -> None:
        self.transformer = transformer
        self.plan = plan
        self.usp = usp
        self.attention_modules: list[str] = []
        self.local_modules: list[str] = []
        self._patched: list[nn.Module] = []

    def _install(self) -> None:
        t = self.transformer
        # a forward override already there (diffusers' HookRegistry: a mitigation's hook on the
        # transformer, e.g. block offload's first prefetch) runs inside the split: SP wraps it
        self._previous = vars(t).get("forward")
        original = self._previous if self._previous is not None else type(t).forward.__get__(t)
        plan, usp = self.plan, self.usp

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = bind_arguments(original, args, kwargs)
            ctx = ShardContext(usp.group)
            usp.ctx = ctx
            try:
                return plan.gather(original(**plan.split(call, ctx)), ctx)
            finally:
                usp.ctx = None

        forward._xema_sequence_parallel = True  # type: ignore[attr-defined]
        for name, module in t.named_modules():
            if module is t or not _is_attention(module):
                continue
            if name.rsplit(".", 1)[-1] in plan.local_attention:
                self.local_modules.append(name)
                continue
            self._wrap_attention(module)
            self.attention_modules.append(name)
        t.forward = forward
        self._patched.append(t)

    def _wrap_attention(self, module: nn.Module) -> None:
        original = type(module).forward.__get__(module)
        usp = self.usp

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with _SDPAToUSP(usp):
                return original(*args, **kwargs)

        module.forward = forward
        self._patched.append(module)

    def remove(self) -> None:
        for module in self._patched:
            del module.forward  # the class's forward shows through again
            if module is self.transformer and self._previous is not None:
                module.forward = self._previous  # the override SP wrapped (a mitigation's hook)
        self._patched.clear()

    def __enter__(self) -> SequenceParallelHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_sequence_parallel(
    transformer: nn.Module, split: type[SPPlan] | None, group: SPGroup, backend: SPBackend = "auto"
) -> SequenceParallelHandle:
    """Make ``transformer`` run sequence-parallel over ``group`` until the handle is removed.

    Args:
        transformer: the pipeline's DiT (weights untouched: every rank keeps a full copy).
        split: the plan that splits this transformer, as the model's spec names it
            (``ModelSpec.sequence_parallel_split``; None: the model has none).
        group: the batch's SP group (``ProcessGroups.select``); every rank of it must make the
            same calls with the same inputs.
        backend: "auto" (xfuser on CUDA when available, else ours), "native" or "xfuser".

    Raises:
        ValueError: no split, a transformer configuration the plan cannot split, or
            the transformer already has SP installed (other forward overrides, such as
            diffusers hooks, are wrapped and restored on removal).
    """
    if backend not in ("auto", "native", "xfuser"):
        raise ValueError(f"backend must be 'auto', 'native' or 'xfuser', got {backend!r}")
    if getattr(vars(transformer).get("forward"), "_xema_sequence_parallel", False):
        raise ValueError("sequence parallelism is already installed on this transformer")
    if split is None:
        raise ValueError("this model has no sequence-parallel split (its spec's sequence_parallel_split is None)")
    handle = SequenceParallelHandle(transformer, split(transformer), USPAttention(group, backend))
    handle._install()
    return handle
