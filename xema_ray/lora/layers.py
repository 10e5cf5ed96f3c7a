"""Per-sample multi-LoRA on the target linear layers (the primitive: Config + Hook + apply).

Each target linear layer computes ``y = base(x)`` with its weights untouched and then adds each
sample's own delta in place, batched over the samples (never a loop over requests)::

    for j in range(k):        # k: the most adapters a sample of the batch stacks
        A_j = A[slots[:, j]]  # [N, R, in]    gathered per row: the row's sample's j-th adapter
        B_j = B[slots[:, j]]  # [N, out, R]
        h   = (x @ A_j^T) * s_j   # [N, L, R]  s_j: that adapter's request scale per row
        y  += h @ B_j^T       # baddbmm_ into the base output

``R`` is the pool's padded rank, ``k`` the most adapters a sample of the batch stacks (a sample
with fewer is padded with scale 0; one with none adds exactly zero). Rows map to samples as
``row % B``: the DiT input is the batch, or ``m`` copies of it concatenated (classifier-free
guidance's ``torch.cat([uncond, cond])``: a sample's condition and uncondition rows share its
adapters); a sequence-parallel rank holds all rows of its part of the sequence, so nothing
changes there. No weight is merged or unmerged and no shape depends on which adapters run, so
nothing recompiles.

Example:
    >>> pool = AdapterPool(LoraPoolConfig(slots=4), adapted_components(pipe), device, dtype)  # doctest: +SKIP
    >>> handle = apply_multi_lora(pool, MultiLoraConfig())  # doctest: +SKIP
    >>> with pool.activate([[LoraUse(name="style")], []]):  # doctest: +SKIP
    ...     pipe(...)
    >>> handle.remove()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.hooks import ModelHook
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.lora.pool import AdapterPool
from xema_ray.mitigation.hooks import MitigationHandle, hook_module

HOOK_NAME = "xema_multi_lora"


class MultiLoraConfig(BaseModel):
    """Which layers carry the per-sample delta."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[str, ...] | None = Field(
        default=None, description="target layer paths (transformer.<module>); None = every linear layer of the pool")


def lora_delta_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                scales: torch.Tensor) -> torch.Tensor:
    """Add each row's delta to ``out`` in place and return it (see the module docstring).

    Args:
        out: the base layer's output ``[N, ..., out]`` (contiguous, as ``F.linear`` makes it).
        x: its input ``[N, ..., in]``.
        a, b: the pool's stacks for this layer, ``[S, R, in]`` and ``[S, out, R]``.
        slots, scales: ``[B, k]`` per sample; ``N`` must be a multiple of ``B``.
    """
    n, samples = x.shape[0], slots.shape[0]
    if n % samples:
        raise ValueError(f"a LoRA layer's input has {n} rows, not a multiple of the batch's {samples} samples")
    if n != samples:  # classifier-free guidance: [uncond; cond], each the whole batch in order
        rows = torch.arange(n, device=slots.device) % samples
        slots, scales = slots[rows], scales[rows]
    x3 = x.reshape(n, -1, x.shape[-1])
    out3 = out.view(n, -1, out.shape[-1])
    # one stacked adapter at a time (k is the stacking depth, a handful; never the requests): each
    # adds (x A_j^T s_j) B_j^T to the output in the same order whatever else the batch holds, and
    # a padded entry (scale 0) adds exact zeros, so a sample's bytes do not depend on its batch
    for j in range(slots.shape[1]):
        idx = slots[:, j]
        h = torch.bmm(x3, a[idx].transpose(1, 2))  # [N, L, R]
        h.mul_(scales[:, j].view(n, 1, 1))
        out3.baddbmm_(h, b[idx].transpose(1, 2))  # += h B_j^T, into the base output
    return out


class MultiLoraHook(ModelHook):
    """On one linear layer: the base output plus each sample's delta from the pool's stacks."""

    def __init__(self, pool: AdapterPool, path: str) -> None:
        super().__init__()
        self.pool = pool
        self.path = path

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = self.fn_ref.original_forward(*args, **kwargs)
        act = self.pool.active
        if act is None or self.path not in act.layers:
            return out
        x = args[0] if args else kwargs["input"]
        if not out.is_contiguous():
            out = out.contiguous()
        return lora_delta_(out, x, self.pool.a[self.path], self.pool.b[self.path], act.slots, act.scales)


def apply_multi_lora(pool: AdapterPool, config: MultiLoraConfig) -> MitigationHandle:
    """Hook ``config.layers`` (default: every target of ``pool``) so each batch ``pool.activate``
    names adds its samples' deltas.

    Args:
        pool: the adapter pool (its stacks and the running batch's activation).
        config: which layers.

    Returns:
        A handle whose ``remove()`` detaches every hook (the layers are as before).
    """
    paths = config.layers if config.layers is not None else tuple(pool.targets)
    unknown = [p for p in paths if p not in pool.targets]
    if unknown:
        raise ValueError(f"multi_lora: {unknown[0]!r} is not a linear layer of the pool's components")
    handle = MitigationHandle("multi_lora")
    for p in paths:
        hook_module(handle, pool.targets[p], MultiLoraHook(pool, p), HOOK_NAME)
    return handle
