"""A model group's decode pool (its YAML's ``decode:`` block, docs/decode-stage.md): decode
workers of their own, the VAE resident, decoding the latents the DiT workers hand over.

``ModelGroup`` holds one (a collaborator, like its ``GroupAdapters``) when its config has a
``decode:`` block. A DiT worker whose plan has ``config.decode`` stops at the latents
(``BatchResult.handed``); the group frees its DiT workers for the next batch, puts each request's
latents in Ray's object store (``put``: one object per request, its reference kept until the video
is written) and asks the pool to ``decode`` it. The pool sends it to its least busy live decode
worker (``runtime/decode_worker.py`` ``DecodeWorker``):

- a decode that raises fails that request alone (its error goes to its caller or its job);
- a decode worker that dies (its actor killed, its process gone) is replaced in the background
  (a new actor, the VAE loaded again) and the request is decoded again on another live worker,
  or on the replacement, from the same object: the denoising never runs again. A request gives
  up after ``MAX_ATTEMPTS`` workers died under it.

Backends: Ray actors (deployed: ``num_cpus`` = the app's ``worker_cpus``, and on ``device: cuda``
``num_gpus`` = ``gpus_per_worker``; in the replica's placement group, in the bundles after the DiT
workers', where it has one), or in-process workers on threads (the group's tests, no Ray).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from xema_ray.plan import Mitigation
from xema_ray.runtime.requests import RequestOutput
from xema_ray.serving.group.settings import DecodePoolConfig, GroupSettings, ModelGroupConfig

if TYPE_CHECKING:  # the worker's module imports torch: only where the decode workers start
    from xema_ray.runtime.decode_worker import DecodeLoad, HandedLatents

logger = logging.getLogger("xema_ray.serving")

#: decode workers that may die under one request before it fails (GroupUnavailable)
MAX_ATTEMPTS = 3

PoolBackend = Literal["ray", "inprocess"]


class DecodeWorkerLost(RuntimeError):
    """A decode worker died under a request (its actor killed, its process gone)."""


class DecodePoolUnavailable(RuntimeError):
    """Every attempt to decode a request found its decode worker dead."""


@dataclass(eq=False)
class _Slot:
    index: int
    handle: Any  # a Ray actor handle, or a DecodeWorker in this process
    busy: int = 0
    alive: bool = True


class DecodePool:
    """A group's decode workers (see the module docstring).

    Args:
        model: the group's model (names the pool in logs).
        cfg: the group's ``decode:`` block.
        load: what each decode worker builds (the group's model, dtypes, weights, seed).
        device: the app's device ("cpu" or "cuda").
        worker_cpus: the CPUs one decode worker asks for.
        backend: "ray" (actors) or "inprocess" (threads of this process).
        bundle_offset: the replica's placement-group bundle of the first decode worker (the DiT
            workers' count), where the replica has a placement group.
    """

    def __init__(self, model: str, cfg: DecodePoolConfig, load: DecodeLoad, device: str = "cpu",
                 worker_cpus: float = 0.25, backend: PoolBackend = "ray", bundle_offset: int = 0) -> None:
        self.model, self.cfg, self.load, self.device = model, cfg, load, device
        self.worker_cpus, self.backend, self.bundle_offset = worker_cpus, backend, bundle_offset
        self.slots: list[_Slot] = []
        self.decoded = 0
        self.retried = 0  # decodes run again after their worker died
        self.replaced = 0  # decode workers started again
        self._ready: asyncio.Event | None = None
        self._loading: list[Any] = []  # the VAE loads ``spawn`` started, until ``wait_started``
        self._replacing: dict[int, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ start, replace
    def start(self) -> None:
        """Start every decode worker and load its VAE (blocking: the group's start-up)."""
        self.spawn()
        self.wait_started()

    def spawn(self) -> None:
        """Start every decode worker without waiting for its VAE (Ray actors: their processes start
        and load beside the caller's own start-up; ``wait_started`` waits for them). In process the
        workers load here."""
        self._loading = []
        self.slots = []
        for i in range(self.cfg.workers):
            handle, loading = self._launch(i)
            self.slots.append(_Slot(i, handle))
            if loading is not None:
                self._loading.append(loading)

    def wait_started(self) -> None:
        """Block until every worker ``spawn`` started has loaded its VAE (re-raising a load's error)."""
        loading, self._loading = self._loading, []
        if loading:
            import ray

            ray.get(loading)

    def _spawn(self, i: int) -> Any:
        """Decode worker ``i``, loaded (blocking: a replacement)."""
        handle, loading = self._launch(i)
        if loading is not None:
            import ray

            ray.get(loading)
        return handle

    def _launch(self, i: int) -> tuple[Any, Any]:
        """(decode worker ``i``, the reference its VAE's load completes; None in process, loaded already)."""
        from xema_ray.runtime.decode_worker import DecodeWorker

        if self.backend == "inprocess":
            worker = DecodeWorker(self.device)
            worker.load(self.load)
            return worker, None
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict[str, Any] = {"num_cpus": self.worker_cpus, "max_restarts": 0,
                                "num_gpus": self.cfg.gpus_per_worker if self.device == "cuda" else 0}
        pg = get_current_placement_group()
        if pg is not None and self.bundle_offset + i < pg.bundle_count:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=self.bundle_offset + i)
        actor = ray.remote(DecodeWorker).options(**opts).remote(platform=self.device)
        return actor, actor.load.remote(self.load)

    def _lost(self, slot: _Slot) -> None:
        """``slot``'s worker died: start its replacement in the background (once)."""
        if not slot.alive:
            return
        slot.alive = False
        logger.warning("%s: decode worker %d died; starting another", self.model, slot.index)

        async def replace() -> None:
            try:
                slot.handle = await asyncio.to_thread(self._spawn, slot.index)
                slot.alive, slot.busy = True, 0
                self.replaced += 1
            except Exception:  # noqa: BLE001 — logged; the next request that finds none tries again
                logger.exception("%s: decode worker %d could not be started again", self.model, slot.index)
            finally:
                self._replacing.pop(slot.index, None)

        self._replacing[slot.index] = asyncio.get_running_loop().create_task(replace())

    # ------------------------------------------------------------------ decode
    def put(self, handed: HandedLatents) -> Any:
        """``handed`` in Ray's object store (the reference the caller keeps until the video is
        written); in process: itself."""
        if self.backend == "inprocess":
            return handed
        import ray

        return ray.put(handed)

    async def _free_slot(self) -> _Slot:
        while True:
            live = [s for s in self.slots if s.alive]
            if live:
                return min(live, key=lambda s: (s.busy, s.index))
            pending = [t for t in self._replacing.values() if not t.done()]
            if not pending:  # every worker dead and none being replaced: start them again
                for s in self.slots:
                    s.alive = True
                    self._lost(s)
                pending = list(self._replacing.values())
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    async def decode(self, ref: Any, mitigations: tuple[Mitigation, ...] = ()) -> RequestOutput:
        """One request's video from its latents (``put``'s reference): on the least busy live
        worker; again on another (or a replacement) when its worker dies under it.

        Raises:
            DecodePoolUnavailable: ``MAX_ATTEMPTS`` workers died under it.
            Exception: the decode's own error (this request alone fails).
        """
        for attempt in range(1, MAX_ATTEMPTS + 1):
            slot = await self._free_slot()
            slot.busy += 1
            try:
                out = await self._call(slot, ref, mitigations)
            except DecodeWorkerLost:
                self._lost(slot)
                if attempt < MAX_ATTEMPTS:
                    self.retried += 1
                continue
            finally:
                slot.busy = max(0, slot.busy - 1)
            self.decoded += 1
            return out
        raise DecodePoolUnavailable(f"{self.model}: {MAX_ATTEMPTS} decode workers died decoding this request; "
                                    "retry later")

    async def _call(self, slot: _Slot, ref: Any, mitigations: tuple[Mitigation, ...]) -> RequestOutput:
        if self.backend == "inprocess":
            worker = slot.handle
            if getattr(worker, "killed", False):
                raise DecodeWorkerLost(slot.index)
            out = await asyncio.to_thread(worker.decode, ref, mitigations)
            if getattr(worker, "killed", False):
                raise DecodeWorkerLost(slot.index)  # killed while it decoded: its answer is dropped
            return out  # type: ignore[no-any-return]
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return await slot.handle.decode.remote(ref, mitigations)  # type: ignore[no-any-return]
        except RayActorError as e:
            raise DecodeWorkerLost(slot.index) from e
        except RayTaskError as e:
            raise e.as_instanceof_cause() from None

    # ------------------------------------------------------------------ operator and tests
    def kill(self, index: int) -> None:
        """Kill decode worker ``index`` as a crash would (its replacement starts at the next decode)."""
        slot = self.slots[index]
        if self.backend == "inprocess":
            slot.handle.killed = True  # its running decode's answer is dropped, its next call refused
            return
        import ray

        ray.kill(slot.handle, no_restart=True)

    def report(self) -> dict[str, Any]:
        """The pool as ``/v1/templates`` and the group's status show it."""
        return {"workers": self.cfg.workers, "gpus_per_worker": self.cfg.gpus_per_worker,
                "alive": sum(s.alive for s in self.slots), "decoded": self.decoded, "retried": self.retried,
                "replaced": self.replaced}

    def shutdown(self) -> None:
        if self.backend == "ray":
            import ray

            for s in self.slots:
                try:
                    ray.kill(s.handle, no_restart=True)
                except Exception:  # noqa: BLE001 — already gone
                    pass
        self.slots = []


def pool_for(config: ModelGroupConfig, s: GroupSettings) -> DecodePool | None:
    """The group's decode pool (None: no ``decode:`` block), not started: Ray actors wherever Ray
    runs (a deployed group, whatever its DiT workers' backend), else in process (the group's tests)."""
    if config.decode is None:
        return None
    from xema_ray.runtime.decode_worker import DecodeLoad

    load = DecodeLoad(model=config.model, weights_dir=config.weights_dir, dtype=config.dtype,
                      component_dtypes=dict(config.component_dtypes))
    import ray

    backend: PoolBackend = "ray" if ray.is_initialized() else "inprocess"
    return DecodePool(config.model, config.decode, load, s.device, s.worker_cpus, backend, bundle_offset=config.workers)
