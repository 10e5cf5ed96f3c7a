"""A worker's LoRA adapters (``xema_ray.lora``): the pool loaded with the model, files added and
removed at run time without a restart.

``Worker`` holds a ``WorkerAdapters`` (its ``adapters``, None when the group serves none) and
answers the worker set's adapter calls through it. ``install_adapters`` makes one at load when the
group serves adapters: the pool (its device stacks at the planned size), every target layer hooked
once (the hooks add nothing while no batch names an adapter) and the load config's files read; a
file that is refused there is reported, not fatal (``LoadedModel.adapters_refused``). ``add``
reads and checks a file completely before the pool knows it, so a refused file changes nothing served.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from xema_ray.lora import AdapterInfo, AdapterPool, AdapterRejected, AdapterSource, LoraUse, PoolStats, read_adapter
from xema_ray.lora.layers import MultiLoraConfig, apply_multi_lora
from xema_ray.lora.pool import adapted_components

from xema_ray.lora_pool import LoraPoolConfig

if TYPE_CHECKING:
    from xema_ray.mitigation.hooks import MitigationHandle
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


#: the refusal of an adapter call on a worker whose group serves none
NO_POOL = "this model group serves no adapters (give it `adapters:` in the serve YAML)"


class WorkerAdapters:
    """One worker's adapter pool, hooked into its loaded pipeline (the worker set reaches it
    through the worker's ``add_adapter`` / ``remove_adapter`` / ... and ``collective_rpc``).

    Args:
        engine: the worker's engine, its pipeline loaded (the pool becomes its ``adapters``).
        config: the pool's size and limits.
        synchronize: the platform's device synchronisation (the pool's copies wait on it).
    """

    def __init__(self, engine: ExecutionEngine, config: LoraPoolConfig, synchronize: Callable[[], None]) -> None:
        self.engine = engine
        self.pool = AdapterPool(config, adapted_components(engine.pipe), engine.device, engine.dtype,
                                synchronize=synchronize)
        self.hooks: MitigationHandle = apply_multi_lora(self.pool, MultiLoraConfig())
        engine.adapters = self.pool

    def add(self, source: AdapterSource) -> AdapterInfo:
        """Read, check and add ``source`` (replacing one of the same name only once the new one passed).

        Raises:
            AdapterRejected: the file cannot serve this model (nothing changed).
        """
        engine, pool = self.engine, self.pool
        if source.model != engine.spec.name:
            raise AdapterRejected(f"adapter {source.name!r} is for model {source.model!r}; this group serves "
                                  f"{engine.spec.name!r}", source.name)
        cfg = pool.config
        adapter = read_adapter(source, type(engine.pipe), pool.components, max_rank=cfg.max_rank,
                               max_unknown_keys=cfg.max_unknown_keys, dtype=engine.dtype)
        pool.add(adapter, str(source.path) if source.path is not None else "",
                 {k: str(v) for k, v in source.experts.files().items()} if source.experts is not None else None)
        return next(i for i in pool.info() if i.name == source.name)

    def remove(self, name: str) -> bool:
        """Forget ``name`` (False: not loaded here)."""
        return self.pool.remove(name, missing_ok=True)

    def info(self) -> list[AdapterInfo]:
        return self.pool.info()

    def stats(self) -> PoolStats:
        return self.pool.stats()


def install_adapters(engine: ExecutionEngine, config: LoraPoolConfig | None, sources: tuple[AdapterSource, ...],
                     synchronize: Callable[[], None]) -> tuple[WorkerAdapters | None, list[str]]:
    """The worker's adapters for a load (None: the group serves none) with ``sources`` read, and
    why each refused file was refused."""
    if config is None:
        if sources:
            raise ValueError("adapters were given but the group has no adapter pool (adapters: in its YAML)")
        return None, []
    adapters = WorkerAdapters(engine, config, synchronize)
    refused = []
    for s in sources:
        try:
            adapters.add(s)
        except AdapterRejected as e:
            refused.append(str(e))
    return adapters, refused
