"""Synthetic memory traces for testing and benchmarking the layout solver without a model.

``diffusion_like_trace`` follows the allocation pattern of a DiT request as the tracer sees it:
resident weights and inputs first, then per denoising step and per block the normalisation,
q/k/v, attention (with its fp32 logsumexp freed at once), projection, residual and MLP
temporaries, and finally a VAE decode whose activations grow with each upsampling stage.
``random_trace`` is an unstructured stress test with a bounded live set.

Example:
    >>> t = diffusion_like_trace(blocks=2, steps=2, seed=0)
    >>> int(t.peak()) > 0, len(t) > 50
    (True, True)
"""

from __future__ import annotations

import numpy as np

from xema_ray.memory.trace import Category, MemoryTrace

_BLOCK = 512
_BF16 = 2  # bytes per element of the activations and weights


def _round(nbytes: int) -> int:
    return max(_BLOCK, (nbytes + _BLOCK - 1) // _BLOCK * _BLOCK)


class _Recorder:
    """Hands out event indices and remembers each allocation's columns."""

    def __init__(self) -> None:
        self.t = 0
        self.rows: list[list[int]] = []  # [nbytes, begin, end, category, phase]

    def alloc(self, nbytes: int, category: Category, phase: int) -> int:
        self.rows.append([int(nbytes), self.t, -1, int(category), phase])
        self.t += 1
        return len(self.rows) - 1

    def free(self, row: int) -> None:
        if self.rows[row][2] != -1:
            raise ValueError(f"allocation {row} freed twice")
        self.rows[row][2] = self.t
        self.t += 1

    def trace(self, phases: list[str], meta: dict[str, str]) -> MemoryTrace:
        n_events = self.t
        arr = np.array(self.rows, dtype=np.int64).reshape(-1, 5)
        nbytes = arr[:, 0]
        end = np.where(arr[:, 2] < 0, n_events, arr[:, 2])
        n = len(arr)
        return MemoryTrace(
            size=np.array([_round(int(b)) for b in nbytes], dtype=np.int64),
            nbytes=nbytes,
            begin=arr[:, 1].copy(),
            end=end,
            category=arr[:, 3].astype(np.int8),
            module=np.full(n, -1, np.int32),
            phase=arr[:, 4].astype(np.int32),
            op=np.full(n, -1, np.int32),
            free_module=np.full(n, -1, np.int32),
            n_events=n_events,
            phases=phases,
            meta=meta,
        )


def diffusion_like_trace(
    *,
    blocks: int = 8,
    steps: int = 4,
    tokens: int = 4096,
    hidden: int = 1536,
    heads: int = 24,
    batch: int = 2,
    vae_stages: int = 4,
    vae_chunks: int = 1,
    seed: int = 0,
) -> MemoryTrace:
    """A DiT-like request trace (bf16 activations, CFG batch).

    Args:
        blocks: transformer blocks per step.
        steps: denoising steps.
        tokens: sequence length per sample.
        hidden: model width.
        heads: attention heads (sizes the fp32 logsumexp).
        batch: samples per forward (2 with classifier-free guidance).
        vae_stages: upsampling stages of the decode.
        vae_chunks: temporal chunks the decode runs in; with more than one, every conv keeps a
            cache from chunk to chunk (long-lived allocations interleaved with large short ones).
        seed: varies a few sizes and which optional temporaries appear.
    """
    for name, value in (("blocks", blocks), ("steps", steps), ("tokens", tokens), ("hidden", hidden),
                        ("heads", heads), ("batch", batch), ("vae_stages", vae_stages),
                        ("vae_chunks", vae_chunks)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    rec = _Recorder()
    act = batch * tokens * hidden * _BF16
    _weights(rec, blocks, hidden)
    rec.alloc(batch * 226 * hidden * _BF16, Category.INPUT, 0)  # the prompt embedding: live to the end
    latent = rec.alloc(act // 4, Category.INPUT, 0)
    for _ in range(steps):
        latent = _denoising_step(rec, rng, latent, blocks=blocks, act=act, batch=batch, hidden=hidden,
                                 heads=heads, tokens=tokens)
    _vae_decode(rec, act, vae_stages, vae_chunks)
    rec.free(latent)
    return rec.trace(
        ["load", "denoise", "decode"],
        {
            "generator": "diffusion_like_trace",
            "seed": str(seed),
            "blocks": str(blocks),
            "steps": str(steps),
            "vae_chunks": str(vae_chunks),
        },
    )


def _weights(rec: _Recorder, blocks: int, hidden: int) -> None:
    """Per block qkv/out/mlp matrices and small biases and norms; resident."""
    for _ in range(blocks):
        for shape in ((hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)):
            rec.alloc(shape[0] * shape[1] * _BF16, Category.WEIGHT, 0)
        for width in (3 * hidden, hidden, 4 * hidden, hidden, hidden, hidden):
            rec.alloc(width * _BF16, Category.WEIGHT, 0)


def _denoising_step(rec: _Recorder, rng: np.random.Generator, latent: int, *, blocks: int, act: int, batch: int,
                    hidden: int, heads: int, tokens: int) -> int:
    """One step: the blocks over a hidden state, then the new latent (the row that replaces ``latent``)."""
    hidden_state = rec.alloc(act, Category.ACTIVATION, 1)
    temb = rec.alloc(batch * hidden * 4, Category.ACTIVATION, 1)
    for _ in range(blocks):
        hidden_state = _attention(rec, hidden_state, act=act, batch=batch, heads=heads, tokens=tokens)
        hidden_state = _mlp(rec, rng, hidden_state, act)
    noise_pred = rec.alloc(act // 4, Category.ACTIVATION, 1)
    rec.free(hidden_state)
    rec.free(temb)
    new_latent = rec.alloc(act // 4, Category.ACTIVATION, 1)
    rec.free(noise_pred)
    rec.free(latent)
    return new_latent


def _attention(rec: _Recorder, hidden_state: int, *, act: int, batch: int, heads: int, tokens: int) -> int:
    """A block's attention half: norm, q/k/v, attention (its fp32 logsumexp freed at once), projection,
    residual; the new hidden state's row."""
    norm = rec.alloc(act, Category.ACTIVATION, 1)
    qkv = rec.alloc(3 * act, Category.ACTIVATION, 1)
    rec.free(norm)
    q, k, v = (rec.alloc(act, Category.ACTIVATION, 1) for _ in range(3))
    rec.free(qkv)
    out = rec.alloc(act, Category.ACTIVATION, 1)
    lse = rec.alloc(batch * heads * tokens * 4, Category.ACTIVATION, 1)
    rec.free(lse)
    for x in (q, k, v):
        rec.free(x)
    proj = rec.alloc(act, Category.ACTIVATION, 1)
    rec.free(out)
    new_hidden = rec.alloc(act, Category.ACTIVATION, 1)
    rec.free(proj)
    rec.free(hidden_state)
    return new_hidden


def _mlp(rec: _Recorder, rng: np.random.Generator, hidden_state: int, act: int) -> int:
    """A block's MLP half: norm, up projection, GELU, down projection, residual; the new hidden state's row."""
    norm2 = rec.alloc(act, Category.ACTIVATION, 1)
    up = rec.alloc(4 * act, Category.ACTIVATION, 1)
    rec.free(norm2)
    gelu = rec.alloc(4 * act, Category.ACTIVATION, 1)
    rec.free(up)
    if rng.random() < 0.5:  # an occasional dtype-cast temporary
        cast = rec.alloc(int(rng.integers(1, 64)) * 4096, Category.ACTIVATION, 1)
        rec.free(cast)
    down = rec.alloc(act, Category.ACTIVATION, 1)
    rec.free(gelu)
    new_hidden = rec.alloc(act, Category.ACTIVATION, 1)
    rec.free(down)
    rec.free(hidden_state)
    return new_hidden


def _vae_decode(rec: _Recorder, act: int, vae_stages: int, vae_chunks: int) -> None:
    """VAE decode in temporal chunks (CogVideoX-style): every stage doubles height and width and runs
    two convs; each conv keeps a cache of its input's last frames for the next chunk (a new cache is
    made during the chunk, the previous chunk's caches are dropped when it ends). The output chunks
    stay live to the end."""
    previous: list[int] = []
    for _ in range(vae_chunks):
        x = rec.alloc(act // 4 // vae_chunks, Category.ACTIVATION, 2)
        size = act // 4
        current: list[int] = []
        for stage in range(vae_stages):
            if stage:
                size *= 2
            for _ in range(2):
                y = rec.alloc(size, Category.ACTIVATION, 2)
                tmp = rec.alloc(size // 2, Category.ACTIVATION, 2)
                rec.free(tmp)
                if vae_chunks > 1:
                    current.append(rec.alloc(size // 8, Category.ACTIVATION, 2))
                rec.free(x)
                x = y
        rec.alloc(size // 2 // vae_chunks, Category.ACTIVATION, 2)  # the chunk's output
        rec.free(x)
        for cache in previous:
            rec.free(cache)
        previous = current
    for cache in previous:
        rec.free(cache)


def random_trace(
    n: int, *, seed: int = 0, max_live: int = 64, max_size: int = 64 << 20, keep: float = 0.001
) -> MemoryTrace:
    """``n`` allocations with log-uniform sizes in [512, max_size] and random frees.

    At each event a live allocation is freed with probability growing with the live count (always
    when ``max_live`` are live); a fraction ``keep`` of the allocations is never freed (outputs).

    Args:
        n: number of allocations.
        seed: random seed.
        max_live: bound on simultaneously live, freeable allocations.
        max_size: largest allocation in bytes.
        keep: probability that an allocation is never freed.
    """
    if n < 0 or max_live < 1 or max_size < _BLOCK or not 0.0 <= keep <= 1.0:
        raise ValueError(
            f"need n >= 0, max_live >= 1, max_size >= 512, 0 <= keep <= 1; got {n}, {max_live}, {max_size}, {keep}"
        )
    rng = np.random.default_rng(seed)
    rec = _Recorder()
    live: list[int] = []
    sizes = np.exp(rng.uniform(np.log(_BLOCK), np.log(max_size), size=n)).astype(np.int64)
    for i in range(n):
        while live and (len(live) >= max_live or rng.random() < len(live) / max_live):
            rec.free(live.pop(int(rng.integers(len(live)))))
        row = rec.alloc(int(sizes[i]), Category.ACTIVATION, 0)
        if rng.random() >= keep:
            live.append(row)
    for row in live:
        rec.free(row)
    return rec.trace(["request"], {"generator": "random_trace", "seed": str(seed)})
