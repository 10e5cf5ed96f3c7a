"""The worker set as Ray actors: one actor per worker, each in its bundle of the replica's
placement group (``STRICT_PACK``: one node), what a deployed ``ModelGroup`` runs.

Ranks follow the interconnect (NVLink pairs become aligned rank pairs, which is where the
dispatcher places SP-2 batches; bundle order on CPU, where nothing is linked). An actor that
died (``RayActorError``: its process was killed, its node went away) surfaces as ``WorkerDied``;
an error raised inside a worker method surfaces as that error (Ray's ``RayTaskError`` made an
instance of its cause, so ``except BatchCancelled`` sees it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from xema_ray.serving.group.worker_set import Generation, WorkerDied, WorkerSet, WorkerState


class RayWorkerSet(WorkerSet[ActorHandle]):
    """``WorkerSet`` on Ray actors (see the module docstring)."""

    def _spawn(self) -> list[ActorHandle]:
        kind = self.spec.kind()
        actor_cls = ray.remote(kind.load_class())
        pg = get_current_placement_group()
        actors = []
        for i in range(self.spec.size):
            opts: dict[str, Any] = {"num_cpus": self.spec.worker_cpus, "num_gpus": kind.num_gpus, "max_restarts": 0,
                                    **kind.ray_options}
            if self.spec.concurrency > 1:
                opts["max_concurrency"] = self.spec.concurrency
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i, placement_group_capture_child_tasks=False)
            actors.append(actor_cls.options(**opts).remote(platform=kind.platform, static_allocator=self.spec.static_allocator))
        return actors

    def _call_blocking(self, workers: Sequence[ActorHandle], method: str,
                       per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        return list(ray.get([getattr(w, method).remote(*a) for w, a in zip(workers, per_rank, strict=True)]))

    def _parallel(self, rank: int, port: int) -> Any:
        from xema_ray.parallel.groups import ParallelConfig, SPLayout

        n = self.spec.size
        layouts = tuple(SPLayout(ulysses=u, ring=r) for u, r in self.spec.layouts) or None
        return ParallelConfig(rank=rank, world_size=n, layouts=layouts,
                              init_method=f"tcp://127.0.0.1:{port}" if n > 1 else None)

    def _order(self, workers: list[ActorHandle]) -> list[ActorHandle]:
        from xema_ray.platforms.topology import pair_order

        topo: list[tuple[str, list[str]]] = ray.get([w.device_topology.remote() for w in workers])
        order = pair_order([d for d, _ in topo], {d: set(p) for d, p in topo})
        return [workers[i] for i in order]

    async def _invoke(self, gen: Generation[ActorHandle], method: str, ranks: Sequence[int], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> list[Any]:
        async def one(rank: int) -> Any:
            try:
                return await getattr(gen.workers[rank], method).remote(*args, **kwargs)
            except RayActorError as e:
                raise WorkerDied(rank, type(e).__name__) from e
            except RayTaskError as e:
                if isinstance(e.cause, BaseException) and not isinstance(e, type(e.cause)):
                    raise e.as_instanceof_cause() from None
                raise

        return list(await asyncio.gather(*(one(r) for r in ranks)))

    def _send(self, gen: Generation[ActorHandle], method: str, ranks: Sequence[int], args: tuple[Any, ...]) -> None:
        for r in ranks:
            getattr(gen.workers[r], method).remote(*args)

    def _discard(self, workers: Sequence[ActorHandle]) -> None:
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already gone
                pass

    def _kill(self, gen: Generation[ActorHandle], rank: int) -> None:
        ray.kill(gen.workers[rank], no_restart=True)

    async def _probe(self, gen: Generation[ActorHandle], rank: int, timeout_s: float) -> WorkerState:
        try:
            await asyncio.wait_for(gen.workers[rank].__ray_ready__.remote(), timeout_s)
        except TimeoutError:
            return "busy"  # queued behind a batch (a worker serving one call at a time)
        except RayActorError:
            return "dead"
        return "ok"
