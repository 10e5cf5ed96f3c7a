"""The worker set in this process: workers (``WorkerBase``) called on threads, no Ray. For tests of a
``ModelGroup`` (dispatch, preemption, job lifecycle, a worker's death and the rebuild) in seconds.

Each worker serves its calls on a thread pool of ``spec.concurrency`` threads, as its actor
would (one thread: calls run one at a time in arrival order; more: a pause reaches a worker busy
in ``execute``). ``kill`` makes a worker die as a crashed actor does: every call waiting on it,
and every later one, raises ``WorkerDied`` (the thread it was running on finishes in the
background, its result dropped).

SP 1 only: torch.distributed has one world per process, so ranks of one SP group cannot live
in one process. Every worker here is a world of its own; a plan with SP > 1 is refused when the
set is made, naming the plans and the backend that runs them (``ray``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xema_ray.serving.group.worker_set import Generation, WorkerDied, WorkerSet, WorkerSetSpec, WorkerState

if TYPE_CHECKING:
    from xema_ray.runtime.worker_base import WorkerBase


@dataclass(eq=False)
class LocalHandle:
    """One in-process worker as the set holds it (a Ray actor handle's counterpart): the worker,
    its call threads, and whether it was killed."""

    worker: WorkerBase
    pool: cf.ThreadPoolExecutor
    dead: bool = False
    waiting: set[asyncio.Future] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


class InProcessWorkerSet(WorkerSet[LocalHandle]):
    """``WorkerSet`` of in-process workers (see the module docstring)."""

    def __init__(self, spec: WorkerSetSpec) -> None:
        if spec.layouts:
            sp = ", ".join(f"ulysses={u} ring={r}" for u, r in spec.layouts)
            raise ValueError(f"the in-process worker set runs SP 1 only (one torch.distributed world per process); "
                             f"the plans need SP layouts {sp}: use the ray backend for them")
        super().__init__(spec)

    def _spawn(self) -> list[LocalHandle]:
        kind = self.spec.kind()
        cls = kind.load_class()
        return [LocalHandle(cls(platform=kind.platform, static_allocator=self.spec.static_allocator),
                            cf.ThreadPoolExecutor(self.spec.concurrency, thread_name_prefix=f"worker{i}"))
                for i in range(self.spec.size)]

    def _call_blocking(self, workers: Sequence[LocalHandle], method: str,
                       per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        futures = [w.pool.submit(getattr(w.worker, method), *a) for w, a in zip(workers, per_rank, strict=True)]
        return [f.result() for f in futures]

    def _parallel(self, rank: int, port: int) -> Any:
        from xema_ray.parallel.groups import ParallelConfig

        del rank, port  # every worker is a world of one (SP 1)
        return ParallelConfig(rank=0, world_size=1)

    def _order(self, workers: list[LocalHandle]) -> list[LocalHandle]:
        return workers  # nothing is linked in one process

    async def _invoke(self, gen: Generation[LocalHandle], method: str, ranks: Sequence[int], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> list[Any]:
        loop = asyncio.get_running_loop()

        def call(rank: int) -> asyncio.Future:
            w = gen.workers[rank]
            out: asyncio.Future = loop.create_future()
            with w.lock:
                if w.dead:
                    out.set_exception(WorkerDied(rank, "killed"))
                    return out
                w.waiting.add(out)
            done = w.pool.submit(getattr(w.worker, method), *args, **kwargs)
            done.add_done_callback(lambda f: loop.call_soon_threadsafe(_settle, w, rank, out, f))
            return out

        return list(await asyncio.gather(*(call(r) for r in ranks)))

    def _send(self, gen: Generation[LocalHandle], method: str, ranks: Sequence[int], args: tuple[Any, ...]) -> None:
        for r in ranks:
            w = gen.workers[r]
            if not w.dead:
                w.pool.submit(getattr(w.worker, method), *args)

    def _discard(self, workers: Sequence[LocalHandle]) -> None:
        for i, w in enumerate(workers):
            self._die(w, i, "stopped")
            w.pool.shutdown(wait=False, cancel_futures=True)

    def _kill(self, gen: Generation[LocalHandle], rank: int) -> None:
        self._die(gen.workers[rank], rank, "killed")

    async def _probe(self, gen: Generation[LocalHandle], rank: int, timeout_s: float) -> WorkerState:
        del timeout_s  # a thread of this process is asked nothing: it is dead only when killed
        return "dead" if gen.workers[rank].dead else "ok"

    def _die(self, w: LocalHandle, rank: int, how: str) -> None:
        with w.lock:
            w.dead = True
            waiting, w.waiting = w.waiting, set()
        for fut in waiting:
            fut.get_loop().call_soon_threadsafe(_fail, fut, WorkerDied(rank, how))


def _settle(w: LocalHandle, rank: int, out: asyncio.Future, done: cf.Future) -> None:
    with w.lock:
        w.waiting.discard(out)
    if out.done():  # the worker was killed meanwhile: its answer is dropped
        return
    if done.cancelled():
        out.set_exception(WorkerDied(rank, "stopped"))
        return
    error = done.exception()
    if error is not None:
        out.set_exception(error)
    else:
        out.set_result(done.result())


def _fail(fut: asyncio.Future, e: Exception) -> None:
    if not fut.done():
        fut.set_exception(e)
