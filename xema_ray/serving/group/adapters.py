"""A model group's LoRA adapters: the folder of its YAML at start-up, files added and removed at
run time (``POST`` / ``DELETE /v1/adapters``) on every worker at once, requests checked against
what is loaded, and batches split so that no sub-batch needs more adapters than the pool's slots.

``ModelGroup`` holds a ``GroupAdapters`` (its ``adapters``) and answers the Router's admin calls
through it. A file is added on all of the group's workers or on none: a worker
that refuses it makes the others drop it again, so a refused adapter changes nothing served. An
added file joins the worker set's load config, so a rebuilt set (a worker died) loads it again.
A name already loaded is refused (409): replacing an adapter in place would change the outputs of
requests already queued for it; delete it first.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from xema_ray.lora_pool import (AdapterInfo, AdapterPathRefused, AdapterRejected, AdapterSource, LoraPoolConfig, LoraUse,
                                PoolStats)
from xema_ray.serving.group.adapter_registry import RegistryClient, RegistryState
from xema_ray.serving.messages import InvalidRequest

if TYPE_CHECKING:
    from xema_ray.runtime.worker import LoadedModel
    from xema_ray.serving.group.worker_set import WorkerSet

logger = logging.getLogger(__name__)
#: longest an adapter change waits for the group's other replicas to apply it
SYNC_TIMEOUT_S = 60.0
#: longest a request naming adapters waits for its replica's sync with the registry
REQUEST_SYNC_S = 10.0
T = TypeVar("T")
K = TypeVar("K")


class NamesAdapters(Protocol):
    """A request as ``GroupAdapters.check`` reads it (``GenerationRequest``)."""

    @property
    def lora(self) -> Sequence[LoraUse]: ...


R = TypeVar("R", bound=NamesAdapters)


class AdapterConflict(AdapterRejected):
    """An adapter of that name is already loaded (HTTP 409)."""


def folder_sources(model: str, cfg: LoraPoolConfig | None) -> tuple[AdapterSource, ...]:
    """The adapters of ``cfg.dir``: every ``*.safetensors`` file, named by its stem."""
    if cfg is None or cfg.dir is None:
        return ()
    folder = cfg.dir.expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"{model}: adapters.dir {str(folder)!r} is not a folder")
    out = []
    for f in sorted(folder.glob("*.safetensors")):
        try:
            out.append(AdapterSource(name=f.stem, model=model, path=f))
        except ValueError:
            logger.warning("%s: adapter file %s skipped: its stem is not a valid adapter name", model, f.name)
    return tuple(out)


def split_for_pool(items: Sequence[T], uses: Callable[[T], Sequence[LoraUse]], slots: int) -> list[list[T]]:
    """``items`` in order, cut into runs whose distinct adapters fit ``slots`` (one run when they do)."""
    runs: list[list[T]] = []
    names: set[str] = set()
    for it in items:
        mine = {u.name for u in uses(it)}
        if runs and len(names | mine) <= slots:
            runs[-1].append(it)
            names |= mine
        else:
            runs.append([it])
            names = set(mine)
    return runs


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("adapter sync (or dropping an adapter from the workers) failed: %s", task.exception())


def _cause(e: BaseException) -> BaseException:
    return getattr(e, "cause", None) or e  # a Ray actor's error wraps the worker's exception


class GroupAdapters:
    """A model group's adapters: what its workers load, what requests may name, the admin calls
    (the Router's endpoints reach them through the group's handle) and, with a registry, the
    replicas' sync.

    Args:
        model: the group's model.
        owner: this replica (as the registry knows it).
        pool: the group's adapter pool (``adapters:`` in its YAML; None: it serves none).
        workers: the group's worker set (adapters are loaded on each of its workers; an added
            file joins its load config, so a rebuilt set loads it again).
        in_use: whether a paused batch (step-level preemption) has a request stacking a name: the
            workers forget a deleted adapter only once none has.
        registry: the app's ``AdapterRegistry`` where the group has several replicas (ignored
            without a pool).
    """

    def __init__(self, model: str, owner: str, pool: LoraPoolConfig | None, workers: WorkerSet[Any],
                 in_use: Callable[[str], bool], registry: RegistryClient | None = None) -> None:
        self.model = model
        self.owner = owner
        self.pool_config = pool
        self.workers = workers
        self._in_use = in_use
        self.registry = registry if pool is not None else None
        self.names: set[str] = set()  # loaded on every worker of this replica
        self.lock = asyncio.Lock()  # held while the workers' adapters (or the set itself) change
        self._folder = folder_sources(model, pool)  # as at start-up, on every replica
        self._folder_names = {s.name for s in self._folder}
        self._claiming: collections.Counter[str] = collections.Counter()  # names this replica adds or deletes itself
        self._dropping: dict[str, asyncio.Event] = {}  # names the workers have yet to forget -> set once they did
        self._synced_version = 0  # the registry's version this replica serves
        self._epoch = 0  # the registry's, at the last sync
        self._applied: RegistryState | None = None
        self._sync_lock = asyncio.Lock()
        self._sync_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def loaded(self, result: LoadedModel) -> None:
        """A new worker set loaded (the set's ``on_loaded``): note the adapters its workers hold."""
        self.names = set(result.adapters)
        self._synced_version = 0  # a new worker set: the next sync compares everything again
        for why in result.adapters_refused:
            logger.warning("%s: %s", self.model, why)

    def sources(self) -> tuple[AdapterSource, ...]:
        """The adapters a new worker set loads (e.g. for new plans): what the workers serve now."""
        sources: tuple[AdapterSource, ...] = self.workers.spec.load.adapter_sources
        return sources

    def fit_pool(self, groups: dict[K, list[T]], uses: Callable[[T], Sequence[LoraUse]],
                 failed: dict[str, Exception], rid: Callable[[T], str]) -> list[tuple[K, list[T]]]:
        """Each group's requests cut into runs that fit the pool's slots (one run per group when they
        do): requests with different adapters share a batch. A request naming an adapter deleted
        while it waited goes to ``failed`` (HTTP 422 naming it) instead of failing its batch."""
        slots = self.pool_config.slots if self.pool_config is not None else 1
        kept: dict[K, list[T]] = {}
        for key, items in groups.items():
            for it in items:
                gone = [u.name for u in uses(it) if u.name not in self.names]
                if gone:
                    failed[rid(it)] = InvalidRequest(f"lora: adapter {gone[0]!r} was deleted while the request "
                                                     "waited; it is no longer loaded", "lora")
                else:
                    kept.setdefault(key, []).append(it)
        return [(key, run) for key, items in kept.items() for run in split_for_pool(items, uses, slots)]

    def check(self, request: R) -> R:
        """A request's adapters (``request.lora``), checked on arrival (``InvalidRequest``, HTTP 422,
        naming the first bad one; 404 for a name no loaded adapter has); returns the request."""
        uses = request.lora
        if not uses:
            return request
        cfg = self.pool_config
        if cfg is None:
            raise InvalidRequest(f"{self.model} serves no LoRA adapters (its group has no `adapters:`)", "lora")
        if len(uses) > cfg.max_per_request:
            raise InvalidRequest(f"lora: {len(uses)} adapters stacked; {self.model} allows {cfg.max_per_request} "
                                 "per request", "lora")
        for i, u in enumerate(uses):
            if u.name not in self.names:
                known = ", ".join(sorted(self.names)) or "none"
                raise InvalidRequest(f"lora[{i}].name: unknown adapter {u.name!r} for {self.model} (loaded: {known})",
                                     f"lora[{i}].name", status=404)  # a name of nothing loaded, as an unknown id
        if len({u.name for u in uses}) != len(uses):
            raise InvalidRequest("lora: an adapter is named twice; give it one scale", "lora")
        return request

    def _set_sources(self, sources: tuple[AdapterSource, ...]) -> None:
        spec = self.workers.spec
        self.workers.spec = spec.model_copy(update={"load": spec.load.model_copy(update={"adapter_sources": sources})})

    async def add(self, source: AdapterSource) -> AdapterInfo:
        """Load ``source`` on every worker (all or none), and with a registry on every replica of the
        group (``registry``). Raises ``AdapterPathRefused`` (HTTP 403: a path outside
        ``adapters.roots``), ``AdapterRejected`` (422) or ``AdapterConflict`` (409)."""
        if self.pool_config is None:
            raise AdapterRejected(f"adapter {source.name!r}: {self.model} serves no adapters (its group has no "
                                  "`adapters:` in the serve YAML)", source.name)
        if source.model != self.model:
            raise AdapterRejected(f"adapter {source.name!r} is for {source.model!r}, this group serves {self.model!r}",
                                  source.name)
        for field, path in source.paths().items():  # before anything looks at a file
            if not self.pool_config.permits(path):
                raise AdapterPathRefused(source.name, field)
        registry = self.registry
        if registry is None:
            return await self._load(source)
        name = source.name
        self._claiming[name] += 1  # this replica's own sync leaves the name alone meanwhile
        try:
            if name in self.names or not await registry.reserve(self.model, name, name in self._folder_names):
                raise self._conflict(name)  # loaded here, or taken on another replica
            try:
                info = await self._load(source)
            except BaseException:
                await registry.release(self.model, name)  # refused: nothing changes anywhere
                raise
            await self._synced_everywhere(await registry.commit(source))
            return info
        finally:
            self._claiming[name] -= 1

    def _conflict(self, name: str) -> AdapterConflict:
        return AdapterConflict(f"adapter {name!r} is already loaded for {self.model}; DELETE it first", name)

    async def _load(self, source: AdapterSource) -> AdapterInfo:
        """``source`` on every worker of this replica, or on none."""
        dropping = self._dropping.get(source.name)
        if dropping is not None:  # deleted a moment ago: loaded again once the workers forgot it
            await dropping.wait()
        async with self.lock:
            if source.name in self.names:
                raise self._conflict(source.name)
            results = await asyncio.gather(*(self.workers.collective_rpc("add_adapter", ranks=[r], args=(source,))
                                             for r in range(self.workers.size)), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                accepted = [r for r, out in enumerate(results) if not isinstance(out, BaseException)]
                if accepted:  # all or none: the workers that took it drop it again
                    await self.workers.collective_rpc("remove_adapter", ranks=accepted, args=(source.name,))
                raise _cause(failed[0])
            self.names.add(source.name)
            self._set_sources((*self.workers.spec.load.adapter_sources, source))
            info: AdapterInfo = results[0][0]  # type: ignore[index]
            return info

    async def remove(self, name: str) -> bool:
        """Forget ``name`` on every worker (and with a registry, on every replica); False: not loaded.
        Requests that name it afterwards get a 422; batches running or paused with it keep it until
        they end (the call returns then)."""
        registry = self.registry
        if registry is None:
            return await self._unload(name)
        self._claiming[name] += 1
        try:
            state: RegistryState = await registry.state(self.model)
            served = name in state.added or (name in self._folder_names and name not in state.removed)
            if name not in self.names and not served:
                return False
            version = await registry.remove(self.model, name, name in self._folder_names)
            await self._unload(name)
            await self._synced_everywhere(version)
            return True
        finally:
            self._claiming[name] -= 1

    async def _unload(self, name: str) -> bool:
        async with self.lock:
            if name not in self.names:
                return False
            self._forget(name)
        await self._drop(name)
        return True

    def _forget(self, name: str) -> None:
        """New requests naming ``name`` are refused, queued ones fail alone (``fit_pool``), and a
        worker set loaded from now on (a rebuild, new plans) leaves it out; ``_drop`` tells the workers."""
        self.names.discard(name)
        self._set_sources(tuple(s for s in self.workers.spec.load.adapter_sources if s.name != name))
        self._dropping.setdefault(name, asyncio.Event())

    async def _drop(self, name: str) -> None:
        """The workers forget ``name`` once no batch uses it: a paused batch resumes with it and a
        running one keeps it until it ends. Waits without holding ``lock``, so adding
        other adapters (and syncing) goes on meanwhile."""
        try:
            while True:
                while self._in_use(name):
                    await asyncio.sleep(0.05)
                async with self.lock:
                    try:
                        await self.workers.collective_rpc("remove_adapter", args=(name,))
                        return
                    except Exception as e:  # noqa: BLE001 — only "in use" is waited for
                        if not isinstance(_cause(e), AdapterRejected):
                            raise
                await asyncio.sleep(0.05)
        finally:
            done = self._dropping.pop(name, None)
            if done is not None:
                done.set()

    # ------------------------------------------------------------------ replicas (adapter_registry)
    async def _synced_everywhere(self, version: int) -> None:
        """After this replica's own change (``version``): catch up with the registry (changes other
        replicas made meanwhile included) and wait (``SYNC_TIMEOUT_S`` at most) for the group's
        other live replicas to apply it; one that does not is logged (it follows on a later sync)."""
        assert self.registry is not None  # only a change made through the registry waits for it
        await self.sync()
        late = await self.registry.wait_synced(self.model, version, SYNC_TIMEOUT_S)
        if late:
            logger.warning("%s: replicas %s did not apply adapter change %d within %.0f s; they apply it on "
                           "their next sync", self.model, ", ".join(late), version, SYNC_TIMEOUT_S)

    def _background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    def tick(self) -> asyncio.Task[None] | None:
        """A sync with the registry, started unless one runs (the replica's routing-stats tick)."""
        if self.registry is None:
            return None
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = self._background(self.sync())
        return self._sync_task

    async def synced_for(self, uses: Sequence[LoraUse]) -> None:
        """Before a request naming adapters is checked: a sync with the registry (the running one, or
        one started now; at most ``REQUEST_SYNC_S``), so that a replica started since a change, or
        one whose ticks are late, checks it against the changes callers were answered for. Never
        fails the request: past the wait, or with the registry unreachable, it is checked as things are."""
        task = self.tick() if uses else None
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), REQUEST_SYNC_S)
        except Exception as e:  # noqa: BLE001 — see the docstring
            logger.warning("%s: adapter registry not synced within %.0f s (%r); the request is checked against "
                           "this replica's adapters", self.model, REQUEST_SYNC_S, e)

    async def sync(self) -> None:
        """Make this replica's adapters what the registry says: the YAML folder's, less those deleted
        at run time, plus those added; then acknowledge the version. A file this replica refuses
        (``AdapterRejected``: unreadable on its node, ...) is logged and left out (requests naming
        it here get the usual 422); any other failure leaves the version unacknowledged, so the
        next sync tries again."""
        registry = self.registry
        if registry is None:
            return
        async with self._sync_lock:
            state: RegistryState | None = await registry.poll(self.model, self.owner, self._synced_version, self._epoch)
            if state is None:
                return
            if state.epoch != self._epoch:
                if self._applied is not None:  # the registry was replaced: it gets back what was served
                    state = await registry.restore(self.model, self._applied)
                self._epoch = state.epoch
            wanted = {s.name: s for s in self._folder if s.name not in state.removed}
            wanted.update(state.added)
            complete = True
            for name, source in wanted.items():
                if name not in self.names and not self._claiming[name]:
                    try:
                        await self._load(source)
                    except Exception as e:  # noqa: BLE001 — one replica's refusal is logged, never fatal
                        complete = complete and isinstance(_cause(e), AdapterRejected)
                        logger.warning("%s: adapter %s not loaded on this replica: %s", self.model, name, _cause(e))
            for name in sorted(self.names - set(wanted)):
                if not self._claiming[name]:
                    self._forget(name)
                    self._background(self._drop(name))
            self._applied = state
            if complete:
                self._synced_version = state.version
                await registry.ack(self.model, self.owner, state.version)

    async def info(self) -> list[AdapterInfo]:
        """The adapters loaded (as worker 0 holds them: every worker holds the same)."""
        if self.pool_config is None:
            return []
        return list((await self.workers.collective_rpc("list_adapters", ranks=[0]))[0])

    async def pool_stats(self) -> list[PoolStats]:
        """Each worker's pool: residency, copies, evictions and the seconds batches waited for copies."""
        if self.pool_config is None:
            return []
        return [s for s in await self.workers.collective_rpc("adapter_stats") if s is not None]
