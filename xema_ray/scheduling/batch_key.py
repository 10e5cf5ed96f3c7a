"""What a batch cannot mix, and what a batch costs as it runs.

A request's ``BatchKey`` holds what one pipeline call takes once for all its rows: the denoising
step count, the guidance scales (every pipeline served takes one scalar ``guidance_scale`` per call,
and a two-expert model one ``guidance_scale_2``), and the quality tier (a cache schedule and a
weight format). Requests of one key run as one call; a batch holding several keys runs one call
per key, one after the other, on the same workers (its *sub-batches*).

Two batching policies (``BatchPolicy``), chosen by measurement (BENCHMARKS.md "One batch key"):

- ``by_key`` (the default): a batch takes only requests of its head's key, so every batch is one
  call; requests of other keys wait for a batch of their own.
- ``mixed``: a batch takes every request of its head's step count and quality tier, whatever its
  guidance, and runs one sub-batch per guidance.

``batch_seconds`` prices a batch as it will run, sub-batches included, from the plan's
latency-by-batch: the dispatcher (its EDF and preemption decisions, ``xema_ray.scheduling``), the
model group's execution, the predicted queue wait, SLO admission and the simulator all read it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

#: a request's guidance scales: ``guidance_scale`` and a two-expert model's ``guidance_scale_2``
#: (None: the model's default; the second: the first's)
Guidance = tuple[float | None, float | None]
#: no guidance given: the model's defaults
DEFAULT_GUIDANCE: Guidance = (None, None)
#: ``by_key``: a batch never mixes keys; ``mixed``: a batch mixes guidance, one sub-batch per key
BatchPolicy = Literal["by_key", "mixed"]
#: the policy that measured the better goodput at load (BENCHMARKS.md "One batch key")
DEFAULT_BATCH_POLICY: BatchPolicy = "by_key"

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, order=True)
class BatchKey:
    """What one pipeline call takes once for all of its rows.

    Example:
        >>> a, b = BatchKey(steps=50), BatchKey(steps=50, guidance=(3.5, None))
        >>> (a == b, a.mixes_with(b), a.mixes_with(BatchKey(steps=20)))
        (False, True, False)
    """

    steps: int  # the denoising steps it runs (a batch runs one step count: ``DispatchPlan.for_steps``)
    guidance: Guidance = DEFAULT_GUIDANCE
    quality: str = "lossless"  # the quality tier (``xema_ray.vocabulary.QualityTier``): a cache schedule, a weight format

    def mixes_with(self, other: BatchKey) -> bool:
        """Whether ``other`` may share a batch with this key under the ``mixed`` policy (as a sub-batch of
        its own): the same step count and quality tier; only the guidance may differ."""
        return self.steps == other.steps and self.quality == other.quality

    def joins(self, other: BatchKey, policy: BatchPolicy) -> bool:
        """Whether a request of key ``other`` joins a batch headed by this key under ``policy``."""
        return self == other if policy == "by_key" else self.mixes_with(other)


def sub_batches(items: Iterable[T], key: Callable[[T], BatchKey]) -> list[tuple[BatchKey, list[T]]]:
    """``items`` split into the sub-batches they run as: one per key, in order of first appearance
    (the batch's earliest deadline first), each keeping its items' order.

    Example:
        >>> [(k.guidance, xs) for k, xs in sub_batches([1, 2, 3], lambda x: BatchKey(1, (float(x % 2), None)))]
        [((1.0, None), [1, 3]), ((0.0, None), [2])]
    """
    out: dict[BatchKey, list[T]] = {}
    for x in items:
        out.setdefault(key(x), []).append(x)
    return list(out.items())


def batch_seconds(keys: Sequence[K], latency_for: Callable[[K, int], float]) -> float:
    """Predicted seconds a batch of requests of ``keys`` holds its workers: one sub-batch per key, run
    one after the other, each ``latency_for(key, n)`` for its ``n`` requests (the plan's
    latency-by-batch at the key's step count: ``DispatchPlan.batch_seconds``; a key is a ``BatchKey``,
    or its number in a replica's summary).

    Example:
        >>> ks = [BatchKey(10, (g, None)) for g in (1.0, 2.0, 1.0)]
        >>> batch_seconds(ks, lambda k, n: {1: 2.0, 2: 3.0}[n])
        5.0
    """
    counts = collections.Counter(keys)
    return sum(latency_for(k, n) for k, n in counts.items())
