"""The adapter pool: every known adapter on the host, ``slots`` of them resident on the device.

The device side is one pair of stacked tensors per target linear layer, allocated once at the
size the plan states (``LoraPoolConfig``: slots x max_rank): ``a[layer]`` is ``[slots, max_rank,
in]``, ``b[layer]`` is ``[slots, out, max_rank]``, an adapter of rank ``r < max_rank`` zero-padded
and its ``alpha / r`` folded into ``b``. Making an adapter resident copies it into a slot (the
least recently used one moves out: it stays on the host); a batch names, per sample, the slots
and scales it uses (``activate``), and the layers' hooks (``xema_ray.lora.layers``) gather from
the stacks. Nothing is allocated per batch but the per-sample index, so the pool's device bytes
are fixed and planned (``xema_ray.lora.memory``), and a request for an adapter that is not
resident waits for its copy (``Activation.wait_s``), never allocates.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from xema_ray.lora_pool import AdapterInfo, LoraPoolConfig, PoolStats  # noqa: F401  (re-exported)
from xema_ray.lora.adapter import ADAPTED_COMPONENTS, AdapterRejected, LoraAdapter, LoraUse


@dataclass(frozen=True)
class Activation:
    """A batch's adapters: per sample, the slots and scales (padded with scale 0)."""

    slots: torch.Tensor  # [B, k] long, on the device
    scales: torch.Tensor  # [B, k], the compute dtype, on the device
    layers: frozenset[str]  # target layers any active adapter adapts (the others add nothing)
    wait_s: float  # seconds this activation waited for copies
    copied: int  # adapters copied in for it


def target_layers(components: dict[str, nn.Module]) -> dict[str, nn.Linear]:
    """Every linear layer of the adapted components, by path (``transformer.<module>``)."""
    return {f"{c}.{n}": m for c, comp in components.items() for n, m in comp.named_modules() if isinstance(m, nn.Linear)}


def adapted_components(pipe: object) -> dict[str, nn.Module]:
    """The pipeline's components an adapter may adapt (``ADAPTED_COMPONENTS`` it has)."""
    return {c: m for c in ADAPTED_COMPONENTS if isinstance(m := getattr(pipe, c, None), nn.Module)}


class AdapterPool:
    """Adapters of one loaded model: host copies and ``slots`` device-resident ones.

    Args:
        config: slots, padded rank, stacking limit, key tolerance.
        components: the adapted components (``adapted_components(pipe)``).
        device: where the stacks live (the transformer's compute device; meta in ``xema verify``).
        dtype: the compute dtype.
        synchronize: waits for the device's copies (the platform's), so a wait is measured whole.
    """

    def __init__(self, config: LoraPoolConfig, components: dict[str, nn.Module], device: torch.device,
                 dtype: torch.dtype, synchronize: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.components = components
        self.device = device
        self.dtype = dtype
        self.synchronize = synchronize
        self.targets = target_layers(components)
        r, s = config.max_rank, config.slots
        self.a = {p: torch.zeros(s, r, m.in_features, device=device, dtype=dtype) for p, m in self.targets.items()}
        self.b = {p: torch.zeros(s, m.out_features, r, device=device, dtype=dtype) for p, m in self.targets.items()}
        self.host: dict[str, LoraAdapter] = {}
        self.paths: dict[str, str] = {}
        self.expert_paths: dict[str, dict[str, str]] = {}
        self.slot_of: collections.OrderedDict[str, int] = collections.OrderedDict()  # least recently used first
        self.active: Activation | None = None
        self._names: set[str] = set()  # the running batch's adapters (not removable meanwhile)
        self._lock = threading.RLock()  # the API's add/remove threads and a batch's thread
        self.copies = self.evictions = self.bytes_copied = 0
        self.wait_s = 0.0

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.a.values(), *self.b.values()])

    # ------------------------------------------------------------------ adapters known
    def add(self, adapter: LoraAdapter, path: str = "", experts: dict[str, str] | None = None) -> None:
        """Know ``adapter`` (on the host; a device slot when a batch asks for it), read from ``path``
        or from a pair's ``experts`` files. Replacing one of the same name drops the old copy from its slot."""
        with self._lock:
            self.remove(adapter.name, missing_ok=True)
            self.host[adapter.name] = adapter
            self.paths[adapter.name] = path
            self.expert_paths[adapter.name] = dict(experts or {})

    def remove(self, name: str, missing_ok: bool = False) -> bool:
        with self._lock:
            if name not in self.host:
                if missing_ok:
                    return False
                raise KeyError(name)
            if self.active is not None and name in self._names:
                raise AdapterRejected(f"adapter {name!r} is in use by the running batch; retry", name)
            self.host.pop(name)
            self.paths.pop(name, None)
            self.expert_paths.pop(name, None)
            self.slot_of.pop(name, None)
            return True

    def info(self) -> list[AdapterInfo]:
        with self._lock:
            return [AdapterInfo(name=a.name, model=a.model, path=self.paths.get(n, ""), rank=a.rank,
                                layers=len(a.layers), bytes=a.nbytes, resident=n in self.slot_of,
                                skipped_keys=len(a.skipped), experts=self.expert_paths.get(n, {}),
                                expert_layers=a.layers_per_component())
                    for n, a in sorted(self.host.items())]

    def stats(self) -> PoolStats:
        return PoolStats(slots=self.config.slots, max_rank=self.config.max_rank, device_bytes=self.device_bytes,
                         adapters=len(self.host), resident=len(self.slot_of), copies=self.copies,
                         evictions=self.evictions, bytes_copied=self.bytes_copied, wait_s=self.wait_s)

    # ------------------------------------------------------------------ residency
    def _copy_in(self, adapter: LoraAdapter, slot: int) -> int:
        moved = 0
        for p in self.targets:
            a, b = self.a[p][slot], self.b[p][slot]
            layer = adapter.layers.get(p)
            a.zero_()
            b.zero_()
            if layer is None:
                continue
            r = layer.rank
            a[:r].copy_(layer.a)
            b[:, :r].copy_(layer.b * layer.scale if layer.scale != 1.0 else layer.b)
            moved += layer.a.numel() * a.element_size() + layer.b.numel() * b.element_size()
        return moved

    def ensure_resident(self, names: Sequence[str]) -> tuple[float, int]:
        """Make ``names`` resident (copying the missing ones in, the least recently used others
        moved out); returns (seconds waited, adapters copied)."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.config.slots:
            raise ValueError(f"a batch needs {len(wanted)} distinct adapters but the pool has {self.config.slots} slots")
        t0 = time.perf_counter()
        copied = 0
        with self._lock:
            for n in wanted:
                if n not in self.host:
                    raise AdapterRejected(f"adapter {n!r} is not loaded for this model (GET /v1/adapters)", n)
            for n in wanted:
                if n in self.slot_of:
                    self.slot_of.move_to_end(n)
                    continue
                used = set(self.slot_of.values())
                free = [s for s in range(self.config.slots) if s not in used]
                if free:
                    slot = free[0]
                else:
                    victim = next(v for v in self.slot_of if v not in wanted)
                    slot = self.slot_of.pop(victim)
                    self.evictions += 1
                self.bytes_copied += self._copy_in(self.host[n], slot)
                self.slot_of[n] = slot
                self.copies += 1
                copied += 1
            if copied:
                self.synchronize()  # the batch must not read a slot before its copy has landed
        waited = time.perf_counter() - t0 if copied else 0.0
        self.wait_s += waited
        return waited, copied

    @contextlib.contextmanager
    def activate(self, per_sample: Sequence[Sequence[LoraUse]]) -> Iterator[Activation | None]:
        """Serve a batch: ``per_sample[i]`` are sample ``i``'s adapters. Yields its ``Activation``
        (None: no sample uses one, the layers add nothing) for the ``with`` block."""
        if not any(per_sample):
            yield None
            return
        k = max(len(u) for u in per_sample)
        if k > self.config.max_per_request:
            raise ValueError(f"a request stacks {k} adapters; the pool allows {self.config.max_per_request}")
        names = [u.name for uses in per_sample for u in uses]
        with self._lock:
            wait_s, copied = self.ensure_resident(names)
            slots = torch.zeros(len(per_sample), k, dtype=torch.long)
            scales = torch.zeros(len(per_sample), k, dtype=torch.float32)
            for i, uses in enumerate(per_sample):
                for j, u in enumerate(uses):
                    slots[i, j] = self.slot_of[u.name]
                    scales[i, j] = u.scale
            layers = frozenset(p for n in set(names) for p in self.host[n].layers)
            act = Activation(slots.to(self.device), scales.to(self.device, self.dtype), layers, wait_s, copied)
            self._names = set(names)
            self.active = act
        try:
            yield act
        finally:
            with self._lock:
                self.active = None
                self._names = set()
