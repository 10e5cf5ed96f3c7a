"""Text encoding for a batch: the model's own encoder where it has one, placed as planned, cached.

``PromptEncoder.encode(prompts)`` returns the pipeline kwargs holding prompt embeddings (and the
negative prompt's, and masks), the encode time, and per prompt whether it was truncated to the
encoder's limit. Where the encoder runs is the plan's choice (``TextEncoderPlacement``):

- ``device``: on the compute device, resident for the whole request;
- ``streamed``: its layers live on (pinned) host memory and stream through the device layer by
  layer during the set-up interval only, with block offload's machinery (next layer prefetched);
- ``cpu``: on the host CPU; only the embeddings cross to the device.

An embedding cache (bounded in bytes, least recently used out, kept on the host) serves a
repeated prompt without running the encoder again; it is keyed by the prompt within one
encoder (one engine holds one). Models configured without weights and without an encoder use
the seeded stand-in embeddings (docs/measured-facts.md, "Prompts").
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from xema_ray.models import ModelSpec
from xema_ray.models.base import TextEncoderPlacement
from xema_ray.platforms import Platform

DEFAULT_CACHE_BYTES = 256 * 2**20


@dataclass
class EmbeddingCache:
    """prompt -> its embeddings (batch dimension 1, on the host), LRU within ``max_bytes``."""

    max_bytes: int = DEFAULT_CACHE_BYTES
    hits: int = 0
    misses: int = 0
    _items: OrderedDict[str, dict[str, torch.Tensor]] = field(default_factory=OrderedDict)
    _bytes: int = 0

    @staticmethod
    def _size(item: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in item.values())

    def get(self, prompt: str) -> dict[str, torch.Tensor] | None:
        item = self._items.get(prompt)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(prompt)
        self.hits += 1
        return item

    def put(self, prompt: str, item: dict[str, torch.Tensor]) -> None:
        size = self._size(item)
        if size > self.max_bytes:
            return
        if prompt in self._items:
            self._bytes -= self._size(self._items.pop(prompt))
        while self._items and self._bytes + size > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= self._size(old)
        self._items[prompt] = item
        self._bytes += size

    @property
    def bytes(self) -> int:
        return self._bytes


@dataclass
class EncodedPrompts:
    inputs: dict[str, torch.Tensor]
    seconds: float
    truncated: list[bool]
    tokens: list[int | None]


class PromptEncoder:
    """Encodes prompts for one engine's pipeline (see the module docstring).

    Args:
        pipe: the pipeline (its ``text_encoder`` and ``tokenizer``, or none).
        spec: the model.
        device: the compute device.
        dtype: the embeddings' dtype.
        placement: where the encoder runs (ignored without one).
        platform: for synchronising before reading the clock.
        cache_bytes: embedding cache size (0 disables it).
    """

    def __init__(self, pipe: Any, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 placement: TextEncoderPlacement = "device", platform: Platform | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.pipe = pipe
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.placement = placement
        self.platform = platform
        self.cache = EmbeddingCache(cache_bytes)

    @property
    def encoder(self) -> Any:
        return getattr(self.pipe, "text_encoder", None)

    @contextlib.contextmanager
    def _streaming(self) -> Iterator[None]:
        """Stream the host-homed layers through the device while the encoder runs."""
        if self.placement != "streamed":
            yield
            return
        from xema_ray.mitigation.block_offload import BlockOffloadConfig, apply_block_offload

        units = self.spec.text_encoder.units(self.encoder)
        with apply_block_offload(self.encoder, units, BlockOffloadConfig(blocks=tuple(range(len(units))))):
            yield

    def _run_encoder(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        where = torch.device("cpu") if self.placement == "cpu" and self.device.type != "meta" else self.device
        with torch.no_grad(), self._streaming():
            out = self.spec.encode_prompts(self.pipe, prompts, where, self.dtype)
        return {k: v.to(self.device) for k, v in out.items()}

    def encode(self, prompts: list[str]) -> EncodedPrompts:
        t0 = time.perf_counter()
        if self.encoder is None:
            inputs = self.spec.prompt_embeddings(list(prompts), self.device, self.dtype)
            return EncodedPrompts(inputs, time.perf_counter() - t0, [False] * len(prompts), [None] * len(prompts))
        tokens = [self.spec.prompt_token_count(self.pipe.tokenizer, p) for p in prompts]
        truncated = [n > self.spec.text_tokens for n in tokens]
        if self.device.type == "meta" and self.placement == "cpu":
            # shape-only: an encoder on the host CPU allocates nothing on the device; only its
            # embeddings arrive there, with exactly the stand-ins' shapes
            inputs = self.spec.prompt_embeddings(list(prompts), self.device, self.dtype)
        elif self.device.type == "meta" or self.cache.max_bytes == 0:
            inputs = self._run_encoder(list(prompts))
        else:
            items: dict[str, dict[str, torch.Tensor]] = {}
            for p in dict.fromkeys(prompts):
                hit = self.cache.get(p)
                if hit is not None:
                    items[p] = hit
            missing = [p for p in dict.fromkeys(prompts) if p not in items]
            if missing:
                fresh = self._run_encoder(missing)
                for i, p in enumerate(missing):
                    items[p] = {k: v[i : i + 1].to("cpu") for k, v in fresh.items()}
                    self.cache.put(p, items[p])
            keys = items[prompts[0]].keys()
            inputs = {k: torch.cat([items[p][k] for p in prompts]).to(self.device) for k in keys}
        if self.platform is not None:
            self.platform.synchronize()
        return EncodedPrompts(inputs, time.perf_counter() - t0, truncated, tokens)
