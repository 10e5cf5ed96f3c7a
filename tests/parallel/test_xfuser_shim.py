"""The xfuser shim builds yunchang's ``LongContextAttention`` (what xfuser's USP attention
subclasses) with the batch's SP groups in place, on CPU over gloo: the constructor's
"use set_seq_parallel_pg() first" assertion does not fire, yunchang's process-global groups are
left as they were, and the attention it builds computes full attention over the group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from sp_harness import run_worker_set
from xema_ray.parallel.groups import ParallelConfig, SPLayout, init_process_groups



def shim_scenario(rank: int, world: int, url: str) -> dict[str, float | bool]:
    from yunchang import LongContextAttention
    from yunchang.globals import PROCESS_GROUP
    from yunchang.kernels import AttnType

    from xema_ray.parallel._xfuser import build_long_context_attention

    cfg = ParallelConfig(rank=rank, world_size=world, init_method=url, timeout_s=60,
                         layouts=(SPLayout(ulysses=2, ring=1), SPLayout(ulysses=1, ring=2)))
    groups = init_process_groups(cfg)
    out: dict[str, float | bool] = {}
    try:
        with pytest.raises(AssertionError, match="set_seq_parallel_pg"):
            LongContextAttention(attn_type=AttnType.TORCH_MATH)  # what the shim used to do first
        ulysses = groups.select(2, 1)
        attn = build_long_context_attention(LongContextAttention, ulysses, attn_type=AttnType.TORCH_MATH)
        out["took_groups"] = attn.ulysses_pg is ulysses.ulysses_group and attn.ring_pg is ulysses.ring_group
        out["globals_restored"] = PROCESS_GROUP.ULYSSES_PG is None and PROCESS_GROUP.RING_PG is None
        ring = groups.select(1, 2)
        other = build_long_context_attention(LongContextAttention, ring, attn_type=AttnType.TORCH_MATH)
        out["groups_independent"] = other.ring_pg is ring.ring_group and attn.ring_pg is ulysses.ring_group

        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, 4, 16, generator=g) for _ in range(3))  # [B, S, H, D], yunchang's layout
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        shard = slice(ulysses.rank * 4, (ulysses.rank + 1) * 4)
        got = attn(q[:, shard], k[:, shard], v[:, shard])
        out["max_error"] = float((got - ref[:, shard]).abs().max())
    finally:
        groups.shutdown()
    return out


def test_shim_builds_yunchang_attention_over_the_batch_groups() -> None:
    for res in run_worker_set(shim_scenario, 2):
        assert res["took_groups"] and res["globals_restored"] and res["groups_independent"], res
        assert res["max_error"] < 1e-5, res
