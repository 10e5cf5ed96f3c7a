"""USP attention math over gloo: Ulysses, ring and both, even and uneven shards, against
single-process attention; process-group bookkeeping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from sp_harness import run_worker_set
from xema_ray.parallel.attention import attention_with_lse, merge_partials, split_sizes
from xema_ray.parallel.groups import ParallelConfig, SPLayout, init_process_groups


def _full_inputs(seq_q: int, seq_kv: int, heads: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq_q, 8, generator=g)
    k = torch.randn(2, heads, seq_kv, 8, generator=g)
    v = torch.randn(2, heads, seq_kv, 8, generator=g)
    return q, k, v


def usp_scenario(rank: int, world: int, url: str, cases: list[tuple[int, int, int, int]]) -> list[float]:
    from xema_ray.parallel.attention import shard
    from xema_ray.parallel.plans import ShardContext
    from xema_ray.parallel.sp import USPAttention

    groups = init_process_groups(ParallelConfig(rank=rank, world_size=world, init_method=url, timeout_s=60))
    errors = []
    for ulysses, ring, seq_q, seq_kv in cases:
        group = groups.select(ulysses, ring)
        q, k, v = _full_inputs(seq_q, seq_kv)
        ref = F.scaled_dot_product_attention(q, k, v)
        qs, kvs = split_sizes(seq_q, world), split_sizes(seq_kv, world)
        usp = USPAttention(group, backend="native")
        ctx = ShardContext(group)
        ctx.sizes = {"q": qs, "kv": kvs}
        usp.ctx = ctx
        out = usp(shard(q, 2, qs, group.rank), shard(k, 2, kvs, group.rank), shard(v, 2, kvs, group.rank), 8**-0.5)
        errors.append(float((out - shard(ref, 2, qs, group.rank)).abs().max()))
    groups.shutdown()
    return errors


def test_usp_matches_full_attention_two_ranks() -> None:
    # (ulysses, ring, query tokens, key tokens): self-attention, uneven shards, cross-attention
    cases = [(2, 1, 16, 16), (1, 2, 16, 16), (2, 1, 9, 9), (1, 2, 9, 13), (2, 1, 7, 12)]
    for errs in run_worker_set(usp_scenario, 2, cases):
        assert max(errs) < 1e-5, errs


def test_usp_hybrid_four_ranks() -> None:
    cases = [(2, 2, 16, 16), (2, 2, 11, 10), (4, 1, 8, 8), (1, 4, 10, 9)]
    for errs in run_worker_set(usp_scenario, 4, cases):
        assert max(errs) < 1e-5, errs


def test_merge_partials_equals_attention_over_union() -> None:
    q, k, v = _full_inputs(5, 12)
    out_a, lse_a = attention_with_lse(q, k[:, :, :7], v[:, :, :7], 0.3)
    out_b, lse_b = attention_with_lse(q, k[:, :, 7:], v[:, :, 7:], 0.3)
    out, _ = merge_partials(*merge_partials(None, None, out_a, lse_a), out_b, lse_b)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.3), atol=1e-6, rtol=1e-5)


def test_split_sizes_uneven_and_units() -> None:
    assert split_sizes(226, 4) == [57, 57, 56, 56]
    assert split_sizes(6, 2, unit=2) == [4, 2]


def test_error_raised_if_split_has_empty_shard() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        split_sizes(3, 4)
    with pytest.raises(ValueError, match="units of 2"):
        split_sizes(5, 2, unit=2)


def test_layouts_cover_every_factorisation() -> None:
    cfg = ParallelConfig(rank=0, world_size=4, init_method="tcp://127.0.0.1:1")
    assert [(x.ulysses, x.ring) for x in cfg.resolved_layouts()] == [(1, 2), (2, 1), (1, 4), (2, 2), (4, 1)]


def test_error_raised_if_layout_does_not_divide_world() -> None:
    with pytest.raises(ValueError, match="does not divide world_size 4"):
        ParallelConfig(rank=0, world_size=4, init_method="tcp://x:1", layouts=(SPLayout(ulysses=3),))
    with pytest.raises(ValueError, match="needs an init_method"):
        ParallelConfig(rank=0, world_size=2)


def test_error_raised_if_layout_not_created() -> None:
    groups = init_process_groups(ParallelConfig(rank=0, world_size=1))
    assert groups.select(1, 1) is None
    with pytest.raises(ValueError, match="no process groups"):
        groups.select(2, 1)
