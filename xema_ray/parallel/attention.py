"""USP attention (Ulysses all-to-all x ring) over torch.distributed, plus the sequence
split/gather collectives the SP layer uses at the transformer boundary.

This is our own implementation of the math xDiT/yunchang run on GPUs, written against plain
``torch.distributed`` so the CPU path runs it over gloo:

* **Ulysses**: each rank holds ``S_r`` tokens of all ``H`` heads; one all-to-all per tensor
  regroups them into all ``sum(S_r)`` tokens of ``H / u`` heads, attention runs locally, and a
  reverse all-to-all restores the token split. Uneven ``S_r`` are allowed (a 226-token CogVideoX
  prompt over SP = 4), using ``all_to_all_single``'s split sizes.
* **Ring**: key/value blocks travel around the ring group; each rank attends its queries to
  every block and merges the partial results with their log-sum-exp, so the attention must
  return an exact LSE (the math SDPA backend does not: its LSE is zeros, docs/measured-facts.md).

Layout throughout is SDPA's ``[batch, heads, tokens, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------- splitting


def split_sizes(n: int, parts: int, unit: int = 1) -> list[int]:
    """Sizes of ``parts`` contiguous shards of ``n`` elements, in multiples of ``unit``; the
    first shards take the remainder (like ``torch.tensor_split``).

    Example:
        >>> split_sizes(226, 4)
        [57, 57, 56, 56]
    """
    if n % unit:
        raise ValueError(f"cannot split {n} elements in units of {unit}")
    units = n // unit
    if units < parts:
        raise ValueError(f"cannot split {n} elements (units of {unit}) into {parts} non-empty shards")
    base, extra = divmod(units, parts)
    return [(base + (1 if i < extra else 0)) * unit for i in range(parts)]


def shard(x: torch.Tensor, dim: int, sizes: Sequence[int], index: int) -> torch.Tensor:
    """Shard ``index`` of ``x`` along ``dim`` (contiguous, so collectives can use it)."""
    if x.shape[dim] != sum(sizes):
        raise ValueError(f"tensor of size {x.shape[dim]} along dim {dim} does not match shard sizes {list(sizes)}")
    start = sum(sizes[:index])
    return x.narrow(dim, start, sizes[index]).contiguous()


def gather(x: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` (shard ``i`` has ``sizes[i]`` elements).

    Shards are padded to the largest so one ``all_gather`` moves them (gloo and NCCL both want
    equal shapes), then trimmed."""
    world = len(sizes)
    if dist.get_world_size(group) != world:
        raise ValueError(f"{world} shard sizes for a group of {dist.get_world_size(group)} ranks")
    dim = dim % x.dim()
    biggest = max(sizes)
    x = x.contiguous()
    if x.shape[dim] < biggest:
        pad_shape = list(x.shape)
        pad_shape[dim] = biggest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)], dim=dim)


def exchange_lengths(local: Sequence[int], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's ``local`` integers (e.g. its query and key lengths), in group-rank order."""
    t = torch.tensor(list(local), dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return [p.tolist() for p in parts]


# ---------------------------------------------------------------------------- local attention


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning the output and the exact fp32 log-sum-exp ``[B, H, Sq]``.

    Uses the flash kernels, which compute the LSE anyway (CPU: ``_scaled_dot_product_flash_
    attention_for_cpu``; CUDA: ``_scaled_dot_product_flash_attention``) and never materialise
    the S x S scores; other devices fall back to explicit fp32 math."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        return out, lse.float()
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
        return res[0], res[1].float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return out, lse


def merge_partials(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-attention partials over disjoint key sets (accumulated in fp32)."""
    block_out = block_out.float()
    if out is None or lse is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


# ---------------------------------------------------------------------------- Ulysses


def seq_to_heads(x: torch.Tensor, lengths: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all ``[B, H, S_r, D]`` (this rank's tokens, all heads) -> ``[B, H/u, sum(S), D]``
    (all tokens, this rank's head group). ``lengths[j]`` is rank j's token count."""
    u = len(lengths)
    b, h, s, d = x.shape
    if h % u:
        raise ValueError(f"Ulysses degree {u} must divide the {h} attention heads")
    hg = h // u
    # head group j goes to rank j: [u, B, H/u, S_r, D] flattened, equal chunks out
    send = x.reshape(b, u, hg, s, d).transpose(0, 1).contiguous().reshape(-1)
    recv = x.new_empty(b * hg * sum(lengths) * d)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[b * hg * n * d for n in lengths],
        input_split_sizes=[b * hg * s * d] * u,
        group=group,
    )
    chunks = recv.split([b * hg * n * d for n in lengths])
    return torch.cat([c.view(b, hg, n, d) for c, n in zip(chunks, lengths, strict=True)], dim=2)


def heads_to_seq(x: torch.Tensor, lengths: Sequence[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of ``seq_to_heads``: ``[B, H/u, sum(S), D]`` -> ``[B, H, S_rank, D]``."""
    u = len(lengths)
    b, hg, _, d = x.shape
    s = lengths[rank]
    send = torch.cat([c.contiguous().reshape(-1) for c in x.split(list(lengths), dim=2)])
    recv = x.new_empty(u * b * hg * s * d)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[b * hg * s * d] * u,
        input_split_sizes=[b * hg * n * d for n in lengths],
        group=group,
    )
    # chunk j holds head group j of this rank's tokens
    return recv.view(u, b, hg, s, d).transpose(0, 1).reshape(b, u * hg, s, d)


# ---------------------------------------------------------------------------- ring


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    kv_lengths: Sequence[int],
    rank: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Attention of this rank's queries to the keys/values of every rank of the ring.

    Blocks are padded to the longest so each hop moves one fixed-size buffer; the padding is
    sliced off before attending (the valid length of the block held at hop ``t`` is that of
    rank ``rank - t``). The next hop's transfer is posted before the current block is computed
    so communication overlaps the attention, as in ring attention."""
    r = len(kv_lengths)
    longest = max(kv_lengths)
    kv = torch.stack([k, v])  # [2, B, H, S_kv, D]: one buffer per hop
    if kv.shape[3] < longest:
        pad = list(kv.shape)
        pad[3] = longest - kv.shape[3]
        kv = torch.cat([kv, kv.new_zeros(pad)], dim=3)
    kv = kv.contiguous()
    nxt = dist.get_global_rank(group, (rank + 1) % r)
    prv = dist.get_global_rank(group, (rank - 1) % r)
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for hop in range(r):
        reqs = []
        if hop < r - 1:
            incoming = torch.empty_like(kv)
            reqs = [dist.isend(kv, dst=nxt, group=group), dist.irecv(incoming, src=prv, group=group)]
        valid = kv_lengths[(rank - hop) % r]
        block_out, block_lse = attention_with_lse(q, kv[0, :, :, :valid], kv[1, :, :, :valid], scale)
        out, lse = merge_partials(out, lse, block_out, block_lse)
        for req in reqs:
            req.wait()
        if hop < r - 1:
            kv = incoming
    if out is None:  # only if the ring were empty, which split_sizes/ProcessGroups rule out
        raise RuntimeError("ring attention over an empty ring")
    return out.to(q.dtype)
