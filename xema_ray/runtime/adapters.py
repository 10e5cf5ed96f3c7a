"""A worker's LoRA adapters (``xema_ray.lora``): the pool loaded with the model, files added and
removed at run time without a restart.

``Worker`` mixes this in. ``install_adapters`` runs at load when the group serves adapters: it
makes the pool (its device stacks at the planned size), hooks every target layer once (the hooks
add nothing while no batch names an adapter) and reads the load config's files; a file that is
refused there is reported, not fatal (``LoadedModel.adapters_refused``). ``add_adapter`` reads and
checks a file completely before the pool knows it, so a refused file changes nothing served.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from xema_ray.lora import AdapterInfo, AdapterPool, AdapterRejected, AdapterSource, LoraUse, PoolStats, read_adapter
from xema_ray.lora.layers import MultiLoraConfig, apply_multi_lora
from xema_ray.lora.pool import adapted_components

from xema_ray.lora_pool import LoraPoolConfig

if TYPE_CHECKING:
    from xema_ray.runtime.engine import ExecutionEngine


def enter_adapters(env: contextlib.ExitStack, engine: ExecutionEngine, adapters: list[tuple[LoraUse, ...]] | None) -> None:
    """Activate the batch's per-sample adapters in the pool for ``env``'s life, copying any that
    are not resident (the batch waits for the copies: they are part of its latency, and the
    pool counts them, ``PoolStats.wait_s``). None or no sample with adapters: nothing to do."""
    if adapters is None or not any(adapters):
        return
    if engine.adapters is None:
        raise ValueError(f"{engine.spec.name} serves no LoRA adapters here (no adapter pool was loaded)")
    env.enter_context(engine.adapters.activate(adapters))


class WorkerAdapters:
    """Adapter calls of a worker (the worker set reaches them through ``collective_rpc``)."""

    engine: ExecutionEngine | None
    platform: Any
    _lora_handle: Any = None

    def install_adapters(self, pool_config: LoraPoolConfig | None, sources: tuple[AdapterSource, ...]) -> list[str]:
        """Make the pool and read ``sources``; returns why each refused file was refused."""
        self._lora_handle = None
        if pool_config is None:
            if sources:
                raise ValueError("adapters were given but the group has no adapter pool (adapters: in its YAML)")
            return []
        assert self.engine is not None
        pipe = self.engine.pipe
        pool = AdapterPool(pool_config, adapted_components(pipe), self.engine.device, self.engine.dtype,
                           synchronize=self.platform.synchronize)
        self._lora_handle = apply_multi_lora(pool, MultiLoraConfig())
        self.engine.adapters = pool
        refused = []
        for s in sources:
            try:
                self.add_adapter(s)
            except AdapterRejected as e:
                refused.append(str(e))
        return refused

    def _pool(self) -> AdapterPool:
        pool = self.engine.adapters if self.engine is not None else None
        if pool is None:
            raise AdapterRejected("this model group serves no adapters (give it `adapters:` in the serve YAML)", "")
        return pool

    def add_adapter(self, source: AdapterSource) -> AdapterInfo:
        """Read, check and add ``source`` (replacing one of the same name only once the new one passed).

        Raises:
            AdapterRejected: the file cannot serve this model (nothing changed).
        """
        pool = self._pool()
        assert self.engine is not None
        if source.model != self.engine.spec.name:
            raise AdapterRejected(f"adapter {source.name!r} is for model {source.model!r}; this group serves "
                                  f"{self.engine.spec.name!r}", source.name)
        cfg = pool.config
        adapter = read_adapter(source, type(self.engine.pipe), pool.components, max_rank=cfg.max_rank,
                               max_unknown_keys=cfg.max_unknown_keys, dtype=self.engine.dtype)
        pool.add(adapter, str(source.path))
        return next(i for i in pool.info() if i.name == source.name)

    def remove_adapter(self, name: str) -> bool:
        """Forget ``name`` (False: not loaded here)."""
        return self._pool().remove(name, missing_ok=True)

    def list_adapters(self) -> list[AdapterInfo]:
        pool = self.engine.adapters if self.engine is not None else None
        return pool.info() if pool is not None else []

    def adapter_stats(self) -> PoolStats | None:
        pool = self.engine.adapters if self.engine is not None else None
        return pool.stats() if pool is not None else None
