"""A model group replica's video jobs in the job store (``store.py``): the group calls this
collaborator at each point of a job's life, and it never holds the workers.

The group marks a job accepted (its owner id, kept alive by a heartbeat lease: ``accept``),
started (``start``), its progress after every step (``observer``: the workers' step observer) and
its result (``store_result``). No store call waits on the denoising path: progress goes out
through the workers' own publisher (``progress.JobProgress``), and a result the store cannot take
yet is kept and retried in the background (``_flush_results``) while the workers move on. A store
that comes back empty (a new epoch) gets the records of the jobs this replica holds written back.
A job whose worker set or store failed is re-dispatched, up to ``MAX_JOB_ATTEMPTS`` runs
(``failed``); a replica being drained hands its jobs back (``hand_back_queued``, ``hand_back_all``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from xema_ray.serving.messages import GroupUnavailable
from xema_ray.serving.jobs.progress import JobProgress, PhaseEstimate
from xema_ray.serving.jobs.store import (JobRecord, JobStore, JobStoreConfig, open_store, result_name, store_call,
                                         store_faults)

if TYPE_CHECKING:
    from xema_ray.scheduling.dispatcher import Dispatcher
    from xema_ray.serving.messages import GenerateResult

#: a job whose worker set failed this many times fails instead of being re-dispatched
MAX_JOB_ATTEMPTS = 3
#: longest a batch's workers wait for its jobs' start marks (a healthy store answers in milliseconds)
START_WAIT_S = 0.25
#: results a replica keeps while the job store cannot take them (beyond: the oldest is run again)
MAX_UNSTORED_RESULTS = 64

logger = logging.getLogger("xema_ray.serving")


class JobLifecycle:
    """The video jobs one model group replica holds (``cfg`` None: the group has no job store,
    and every job call fails saying so)."""

    def __init__(self, model: str, owner: str, cfg: JobStoreConfig | None) -> None:
        self.model = model
        self.owner = owner  # this replica, as job owner
        self.cfg = cfg
        self.held: set[str] = set()  # jobs queued or running here
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._beating = False  # the last heartbeat reached the store
        self._records: dict[str, JobRecord] = {}  # the jobs held here, as accepted (written back to a store that lost them)
        self._epoch: str | None = None  # the store's epoch as last seen
        self._unstored: dict[str, tuple[str, bytes, str]] = {}  # job -> result the store has not taken yet
        self._flush_task: asyncio.Task[None] | None = None
        self._store_lags_until = 0.0  # until then, a batch does not wait for its jobs' start marks

    def store(self) -> JobStore:
        if self.cfg is None:
            raise RuntimeError(f"{self.model}: this model group was started without a job store")
        return open_store(self.cfg)

    # ------------------------------------------------------------------ the lease
    def start_heartbeat(self) -> None:
        """Keep this replica's lease alive from now on (on the running loop; no store: nothing)."""
        if self.cfg is not None and self._heartbeat_task is None:
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        """Keep this replica's lease on its jobs alive (a lapsed lease gets them re-dispatched)."""
        assert self.cfg is not None
        while True:
            try:
                store = self.store()
                await store_call(self.cfg, store.heartbeat, self.owner)
                self._beating = True
                epoch = await store_call(self.cfg, store.epoch)
                if self._epoch is not None and epoch != self._epoch:
                    await self._restore_records(store)
                self._epoch = epoch
            except Exception as e:  # a store hiccup must not kill the loop; the next beat retries
                self._beating = False
                logger.warning("%s: job store heartbeat failed (%s: %s)", self.model, type(e).__name__, e)
            await asyncio.sleep(self.cfg.lease_s / 4)

    async def _restore_records(self, store: JobStore) -> None:
        """The store lost its data (a new epoch): write back every job held here, so that it
        runs (or goes on running) and is found again."""
        assert self.cfg is not None
        held = [r for j, r in self._records.items() if j in self.held or j in self._unstored]
        n = 0
        for rec in held:
            n += bool(await store_call(self.cfg, store.restore, rec.model_copy(update={"owner": self.owner})))
        logger.warning("%s: the job store lost its data (new epoch); wrote back %d of the %d jobs held here",
                       self.model, n, len(held))

    # ------------------------------------------------------------------ accepted, started, done
    async def reclaim(self, job_id: str) -> bool:
        """A job handed over again while held here: re-claim it (a lapsed lease may have given it
        away) and say True; False: not held here."""
        store = self.store()
        if job_id not in self.held:
            return False
        await store_call(self.cfg, store.accept, job_id, self.owner)  # type: ignore[arg-type]
        return True

    async def accept(self, job_id: str, queue: Callable[[], None]) -> bool:
        """Take the job in the store and ``queue`` it (into the group's dispatcher). False: the job
        is gone or finished. A queue that refuses it (``OverflowError``) hands it back to the
        store and raises."""
        store = self.store()
        # ours from here on: a second hand-over of the same job (two reconcilers saw it unowned)
        # arriving while this one awaits the store only re-claims it, it never queues it twice
        self.held.add(job_id)
        try:
            if not self._beating:  # the lease must be live before the first job names this owner
                await store_call(self.cfg, store.heartbeat, self.owner)  # type: ignore[arg-type]
            accepted = await store_call(self.cfg, store.accept, job_id, self.owner)  # type: ignore[arg-type]
            if accepted is None:
                self.held.discard(job_id)
                return False
            self._records[job_id] = accepted
            queue()
        except OverflowError:
            self.held.discard(job_id)
            self._records.pop(job_id, None)
            await store_call(self.cfg, store.requeue, job_id, self.owner)  # type: ignore[arg-type]
            raise
        except BaseException:
            self.held.discard(job_id)
            raise
        return True

    def cancelled(self, job_id: str) -> None:
        """The job left the dispatcher's queue (deleted while queued)."""
        self.held.discard(job_id)
        self._records.pop(job_id, None)

    async def start(self, jobs: list[str], predicted_s: float) -> set[str]:
        """Mark the jobs started; the ones the store says were deleted are left out. The workers
        wait for that at most ``START_WAIT_S`` (not at all while the store lags): a job whose
        answer is late runs, its mark lands when the store answers."""
        store = self.store()
        calls = {j: asyncio.ensure_future(self._call(store.start, j, self.owner, predicted_s)) for j in jobs}
        if time.monotonic() >= self._store_lags_until:
            await asyncio.wait(calls.values(), timeout=START_WAIT_S)
        started = set()
        for j, call in calls.items():
            if not call.done():  # late: it runs; the store hears of it when it answers
                self._store_lags_until = time.monotonic() + self.cfg.lease_s  # type: ignore[union-attr]
                call.add_done_callback(lambda c: c.cancelled() or c.exception())  # nothing waits for it now
                started.add(j)
            elif call.exception() is not None:
                if not isinstance(call.exception(), store_faults()):
                    raise call.exception()  # type: ignore[misc]
                started.add(j)  # the store is down: run it anyway (it is ours), record it later
            elif call.result():
                started.add(j)
        return started

    async def rerun(self, jobs: list[str], predicted_s: float) -> dict[str, float]:
        """The jobs' sub-batch runs again (a neighbour failed it: ``isolation``): each keeps its
        progress, its remaining time becomes ``predicted_s``; returns the progress each counts on
        from (the ones deleted meanwhile left out; with the store down, 0: it runs, it is ours)."""
        store = self.store()

        async def one(j: str) -> float | None:
            try:
                return await self._call(store.rerun, j, self.owner, predicted_s)  # type: ignore[no-any-return]
            except store_faults():
                return 0.0
        got = await asyncio.gather(*(one(j) for j in jobs))
        return {j: base for j, base in zip(jobs, got, strict=True) if base is not None}

    def observer(self, jobs: list[str], others: int, estimate: PhaseEstimate,
                 bases: dict[str, float] | None = None) -> JobProgress | None:
        """The step observer that publishes the progress of ``jobs`` (a sub-batch that runs
        ``others`` synchronous requests beside them; ``bases``: a re-run's, ``rerun``); None: no job in it."""
        return JobProgress(self.cfg, jobs, others, estimate, bases) if jobs and self.cfg is not None else None

    async def decoding(self, jobs: list[str]) -> None:
        """The jobs' latents went to the group's decode pool: their stage is decode from now."""
        if self.cfg is None or not jobs:
            return
        store = self.store()
        await asyncio.gather(*(store_call(self.cfg, store.set_stage, j, "decode") for j in jobs))

    async def store_result(self, job_id: str, out: GenerateResult) -> None:
        """Hand the result to the store; one the store cannot take now is kept (bounded) and
        retried in the background, so the batch's workers never wait for the store."""
        self._unstored[job_id] = (result_name(job_id, "video"), out.data, out.media_type)
        while len(self._unstored) > MAX_UNSTORED_RESULTS:  # the oldest is re-run instead (its lease stays ours)
            dropped = next(iter(self._unstored))
            self._unstored.pop(dropped)
            logger.error("%s: more than %d results wait for the job store; %s will be run again",
                         self.model, MAX_UNSTORED_RESULTS, dropped)
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_results())

    def finished(self, request_ids: Iterable[str]) -> None:
        """A batch ended (its results stored, kept for the store, or failed): its jobs are no
        longer held here (a result still waiting for the store keeps its record)."""
        for rid in request_ids:
            self.held.discard(rid)
            if rid not in self._unstored:
                self._records.pop(rid, None)

    async def _call(self, fn: Any, job_id: str, *args: Any) -> Any:
        """A store update of a job held here; if it fails because the store lost the record (it
        came back empty and this replica has not written its jobs back yet), the record is
        written back and the update tried once more."""
        assert self.cfg is not None
        store = self.store()
        done = await store_call(self.cfg, fn, job_id, *args)
        rec = self._records.get(job_id)
        if done or rec is None or await store_call(self.cfg, store.get, job_id, True) is not None:
            return done
        await store_call(self.cfg, store.restore, rec.model_copy(update={"owner": self.owner}))
        return await store_call(self.cfg, fn, job_id, *args)

    async def _flush_results(self) -> None:
        assert self.cfg is not None
        delay = 0.0
        while self._unstored:
            await asyncio.sleep(delay)
            for job_id, (name, data, media) in list(self._unstored.items()):
                try:
                    await self._call(self.store().complete, job_id, {name: (data, media)})
                except store_faults() as e:
                    logger.warning("%s: the result of %s waits for the job store (%s)", self.model, job_id,
                                   type(e).__name__)
                    delay = min(5.0, max(0.5, 2 * delay))
                    break
                except Exception as e:  # not a store fault: the job fails with the reason
                    self._unstored.pop(job_id, None)
                    await self.failed(job_id, e)
                else:
                    self._unstored.pop(job_id, None)
                    self._records.pop(job_id, None)

    # ------------------------------------------------------------------ failed, shed, handed back
    async def failed(self, job_id: str, e: Exception) -> None:
        """A fault (the worker set or the store) re-dispatches the job, up to MAX_JOB_ATTEMPTS
        runs; any other error fails it with its message."""
        store, cfg = self.store(), self.cfg
        self._records.pop(job_id, None)
        try:
            rec = await store_call(cfg, store.get, job_id)  # type: ignore[arg-type]
            if rec is None:
                return
            if isinstance(e, (GroupUnavailable, *store_faults())) and rec.attempts < MAX_JOB_ATTEMPTS:
                await store_call(cfg, store.requeue, job_id, self.owner)  # type: ignore[arg-type]
            else:
                await store_call(cfg, store.fail, job_id, "generation_failed", f"{type(e).__name__}: {e}")  # type: ignore[arg-type]
        except Exception:
            logger.exception("%s: could not record the failure of %s; its lease will lapse", self.model, job_id)

    async def shed(self, job_id: str, reason: str) -> None:
        """The admission policy shed the job (it can no longer meet its SLO): it fails with ``reason``."""
        self.held.discard(job_id)
        try:
            await asyncio.to_thread(self.store().fail, job_id, "shed", reason)
        except Exception:
            logger.exception("%s: could not record shedding %s; its lease will lapse", self.model, job_id)

    async def hand_back_queued(self, dispatcher: Dispatcher[Any]) -> int:
        """Take the jobs still queued out of ``dispatcher`` and back to the store (another
        replica's reconciler re-dispatches them); how many the store took back."""
        if self.cfg is None:
            return 0
        store = self.store()
        n = 0
        for job_id in list(self.held):
            if dispatcher.cancel(job_id):  # queued, not running: another replica takes it
                self.held.discard(job_id)
                if await asyncio.to_thread(store.requeue, job_id, self.owner) is not None:
                    n += 1
        return n

    async def hand_back_all(self) -> int:
        """Hand every job still held here back to the store (the replica is going away)."""
        if self.cfg is None:
            return 0
        store = self.store()
        n = 0
        for job_id in list(self.held):
            if await asyncio.to_thread(store.requeue, job_id, self.owner) is not None:
                n += 1
            self.held.discard(job_id)
        return n
