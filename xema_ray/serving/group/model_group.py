"""ModelGroup: one model's worker set behind a Ray Serve deployment (paper §4, Figure 3).

The group connects three things: the ``Dispatcher`` (shared with the simulator), which forms
batches per template, orders them by deadline and places each on a free SP group (DP is how
many groups run at once); the ``WorkerSet`` (``xema_ray.serving.group.worker_set``), which starts,
calls and rebuilds the workers — Ray actors in the replica's placement group when deployed, or
in-process workers in tests, given by injection; and the job lifecycle of video jobs. A worker
that dies takes its set's process groups with it, so the set is rebuilt (weights reloaded) and
the batch is retried once; if that fails too, its requests fail with a clear error — never
silently.

Video jobs (``submit_job``) go through the same dispatcher as synchronous requests; their state
lives in the job store (``xema_ray.serving.jobs.store``): the group marks a job accepted (its owner id,
kept alive by a heartbeat lease), started, its progress after every step (through the workers'
step observer) and its result. A job deleted while it runs stops counting at the next step; a
batch whose members are all deleted stops there and frees its workers. No store call waits on
the denoising path or holds the workers: progress goes out through the workers' own publisher
(``job_progress``), and a result the store cannot take yet is kept and retried in the background
(``_flush_results``) while the workers move on. A store that comes back empty (a new epoch) gets
the records of the jobs this replica holds written back.

Step-level preemption (``preemption``, the dispatcher's ``PreemptionPolicy``): when the
dispatcher pauses a running batch for a more urgent one, the group's ``PreemptibleRunner`` asks
the batch's workers to park it at the next step boundary (its state kept on the device or moved
to the host, as the dispatcher decided), starts the urgent batch once they have, and resumes the
paused one when the dispatcher says so. Workers then serve several calls at once, so a pause
reaches a busy worker. A paused video job stays ``in_progress``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from xema_ray.plan import AdmissionPolicy, PlanEntry
from xema_ray.profiling.phases import PhaseShares
from xema_ray.runtime.emulation import EmulationConfig
from xema_ray.runtime.progress import BatchCancelled
from xema_ray.scheduling.batch import Assignment, DispatchPlan, Pending
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.scheduling.preemption_policy import PreemptionPolicy
from xema_ray.serving.group.messages import GenerateResult, GroupStatus, GroupUnavailable, InvalidRequest, QueueFull
from xema_ray.serving.jobs.progress import JobProgress, PhaseEstimate
from xema_ray.serving.jobs.store import JobRecord, JobStore, JobStoreConfig, open_store, store_call, store_faults
from xema_ray.serving.group.layout_stats import GroupLayoutStats, LayoutCounters
from xema_ray.serving.group.metrics import ServingMetrics
from xema_ray.serving.group.preemption import PreemptibleRunner, PreemptionReport
from xema_ray.serving.scale.replica_stats import PublishesSummary
from xema_ray.serving.api.videos import result_name
from xema_ray.serving.group.worker_set import RebuildFailed, WorkerDied, WorkerSetFactory, WorkerSetSpec, worker_set_for

__all__ = ["GroupUnavailable", "InvalidRequest", "ModelGroup", "QueueFull"]

#: a job whose worker set failed this many times fails instead of being re-dispatched
MAX_JOB_ATTEMPTS = 3
#: longest a batch's workers wait for its jobs' start marks (a healthy store answers in milliseconds)
START_WAIT_S = 0.25
#: results a replica keeps while the job store cannot take them (beyond: the oldest is run again)
MAX_UNSTORED_RESULTS = 64
#: concurrent calls a worker serves with preemption on (a running batch, a pause, a
#: preempting batch, a resume)
WORKER_CONCURRENCY = 4

logger = logging.getLogger("xema_ray.serving")


@dataclass
class _Ticket:
    request: Any  # GenerationRequest, validated on arrival
    guidance_scale: float | None
    future: asyncio.Future[GenerateResult] | None  # None for a job: its result goes to the job store
    job_id: str | None = None


def _ticket(r: Pending[_Ticket]) -> _Ticket:
    assert r.payload is not None  # every live request carries its ticket (only the simulator's carry none)
    return r.payload


def _validated(request_id: str, prompt: str, seed: int, guidance_scale: float | None) -> Any:
    """The request as the batch builder will see it, checked now: a request that cannot run
    fails alone (HTTP 422) instead of failing the batch it would join."""
    from pydantic import ValidationError

    from xema_ray.runtime.engine import GenerationRequest

    if guidance_scale is not None and not (isinstance(guidance_scale, int | float) and math.isfinite(guidance_scale)):
        raise InvalidRequest(f"guidance_scale must be a finite number, got {guidance_scale!r}", "guidance_scale")
    try:
        return GenerationRequest(request_id=request_id, prompt=prompt, seed=seed)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else None
        raise InvalidRequest(f"{field}: {err['msg']}", field) from None


class ModelGroup(PublishesSummary):
    """Serve deployment body; wrapped by ``serve.deployment`` in ``deployments/app.py``.

    Args:
        model: registry name of the model.
        workers: size of the worker set (bundles of the placement group).
        plans: template shape key -> its plan entry (from the plan table).
        device: the kind of worker (``worker_set.WORKER_KINDS``: "cpu", "cuda", "emulated").
        weights_dir: local diffusers directory or None (random weights).
        residency: "per_template" (each batch's plan decides; a switch moves only the difference)
            or "shared" (one residency for the group).
        worker_cpus: CPUs per worker.
        wait_window_s, max_queue: dispatcher settings.
        jobs: the job store's config; None: no video jobs.
        layouts_dir: the plan table's layouts folder (plans with a layout_ref arm theirs).
        budget_bytes: device memory per worker (the plan table's budget): the static allocator's
            arena is sized for it (``xema_ray.runtime.arena``); None: not known.
        preemption: the step-level preemption policy; None: off.
        worker_set: makes the worker set from its spec (default: the device's own, Ray actors
            for "cpu" and "cuda"; tests give ``InProcessWorkerSet``).
        emulation: device "emulated": the templates' phases from the plan table (docs/emulated.md).
        admission: the SLO-aware admission policy the plan table chose for this group's load;
            None: plain EDF, every request served.
        phases: each template's phase shares on the plan table's hardware (``phase_shares``, as the
            simulator's): where its step boundaries fall until its first batch is measured; None:
            the fallback split (``PhaseEstimate.from_plan``).

    Each replica publishes a summary of its dispatcher for the request router and the autoscaler
    (``PublishesSummary``: ``record_routing_stats``, ``record_autoscaling_stats``, ``drain``).
    """

    def __init__(self, model: str, workers: int, plans: dict[str, PlanEntry], device: str = "cpu",
                 weights_dir: str | Path | None = None, worker_cpus: float = 0.25, wait_window_s: float = 0.05,
                 max_queue: int = 64, residency: Literal["per_template", "shared"] = "per_template",
                 jobs: JobStoreConfig | None = None, layouts_dir: str | Path | None = None,
                 preemption: PreemptionPolicy | None = None, worker_set: WorkerSetFactory = worker_set_for,
                 emulation: EmulationConfig | None = None, admission: AdmissionPolicy | None = None,
                 phases: dict[str, PhaseShares] | None = None, budget_bytes: int | None = None) -> None:
        from xema_ray.runtime.worker import ModelLoadConfig

        self.model = model
        self.n_workers = workers
        self.entries = dict(plans)
        #: per template: batches run with the layout armed, hits, fallbacks, reserved bytes; the workers' status
        self.layout_counters = LayoutCounters({k: e.config.layout_ref for k, e in self.entries.items()})
        self.policy = preemption
        dispatch_plans = {k: DispatchPlan.of_entry(e) for k, e in self.entries.items()}
        self.dispatcher: Dispatcher[_Ticket] = Dispatcher(dispatch_plans, workers, wait_window_s, max_queue, self.policy,
                                                          admission=admission)
        self.metrics = ServingMetrics(model)
        self.jobs_cfg = jobs
        self.owner = f"{model}-{uuid.uuid4().hex[:12]}"  # this replica, as job owner
        self._job_ids: set[str] = set()  # jobs queued or running here
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._beating = False  # the last heartbeat reached the store
        self._records: dict[str, JobRecord] = {}  # the jobs held here, as accepted (written back to a store that lost them)
        self._epoch: str | None = None  # the store's epoch as last seen
        self._unstored: dict[str, tuple[str, bytes, str]] = {}  # job -> result the store has not taken yet
        self._flush_task: asyncio.Task[None] | None = None
        self._store_lags_until = 0.0  # until then, a batch does not wait for its jobs' start marks
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self.estimates = {k: PhaseEstimate.from_shares(e.config.template.steps, e.prediction.latency_s, phases[k])
                          if phases is not None and k in phases else
                          PhaseEstimate.from_plan(e.config.template.steps, e.prediction.latency_s,
                                                  e.config.template.spec.kind == "video")
                          for k, e in self.entries.items()}
        for k, est in self.estimates.items():  # where each template's step boundaries fall (preemption)
            self._tell_phases(k, est)
        # every weight is placed once, at load, where the group's plans keep it (never whole on the device)
        load = ModelLoadConfig(model=model, weights_dir=Path(weights_dir) if weights_dir else None, residency=residency,
                               plans=tuple(e.config for _, e in sorted(self.entries.items())),
                               layouts_dir=Path(layouts_dir) if layouts_dir else None, emulation=emulation,
                               budget_bytes=budget_bytes)
        spec = WorkerSetSpec(
            device=device, size=workers, load=load, worker_cpus=worker_cpus,
            layouts=tuple(sorted({(e.config.ulysses, e.config.ring) for e in self.entries.values() if e.config.sp > 1})),
            concurrency=WORKER_CONCURRENCY if preemption is not None else 1,
            # a CUDA worker installs the static allocator when its plans carry layouts to arm
            static_allocator=device == "cuda" and any(e.config.layout_ref for e in self.entries.values()))
        self.workers = worker_set(spec)
        self.workers.on_loaded = lambda loaded: self.layout_counters.loaded(loaded.layout_status)
        self.runner = PreemptibleRunner(model, self.workers, self.dispatcher, self.policy, self.metrics)
        self.workers.start()

    async def _rebuild(self, failed_generation: int) -> None:
        """Replace the worker set once per failure (a dead rank breaks every SP group)."""
        try:
            if await self.workers.rebuild(failed_generation):
                self.metrics.worker_restarts.inc()
        except RebuildFailed as e:
            # the set stays at this generation, so the next batch tries again
            raise GroupUnavailable(
                f"{self.model}: the worker set is being rebuilt after a failure and the rebuild failed "
                f"({type(e.__cause__).__name__}); the request was not completed, retry later") from e

    # ------------------------------------------------------------------ requests
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._dispatch_loop())
        if self.jobs_cfg is not None and self._heartbeat_task is None:
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())

    def _store(self) -> JobStore:
        if self.jobs_cfg is None:
            raise RuntimeError(f"{self.model}: this model group was started without a job store")
        return open_store(self.jobs_cfg)

    async def _heartbeat(self) -> None:
        """Keep this replica's lease on its jobs alive (a lapsed lease gets them re-dispatched)."""
        assert self.jobs_cfg is not None
        while True:
            try:
                store = self._store()
                await store_call(self.jobs_cfg, store.heartbeat, self.owner)
                self._beating = True
                epoch = await store_call(self.jobs_cfg, store.epoch)
                if self._epoch is not None and epoch != self._epoch:
                    await self._restore_records(store)
                self._epoch = epoch
            except Exception as e:  # a store hiccup must not kill the loop; the next beat retries
                self._beating = False
                logger.warning("%s: job store heartbeat failed (%s: %s)", self.model, type(e).__name__, e)
            await asyncio.sleep(self.jobs_cfg.lease_s / 4)

    async def _restore_records(self, store: JobStore) -> None:
        """The store lost its data (a new epoch): write back every job held here, so that it
        runs (or goes on running) and is found again."""
        assert self.jobs_cfg is not None
        held = [r for j, r in self._records.items() if j in self._job_ids or j in self._unstored]
        n = 0
        for rec in held:
            n += bool(await store_call(self.jobs_cfg, store.restore, rec.model_copy(update={"owner": self.owner})))
        logger.warning("%s: the job store lost its data (new epoch); wrote back %d of the %d jobs held here",
                       self.model, n, len(held))

    async def submit_job(self, job_id: str, template: str, prompt: str, seed: int,
                         guidance_scale: float | None = None) -> bool:
        """Queue a stored job (idempotent). False: the job is gone or finished. Raises QueueFull."""
        self._ensure_loop()
        store = self._store()
        if job_id in self._job_ids:  # ours already; re-claim it in case a lapsed lease gave it away
            await store_call(self.jobs_cfg, store.accept, job_id, self.owner)  # type: ignore[arg-type]
            return True
        request = _validated(job_id, prompt, seed, guidance_scale)
        if template not in self.dispatcher.plans:
            raise InvalidRequest(f"{self.model} has no plan for template {template!r}", "size")
        self.note_arrival(template)
        # ours from here on: a second hand-over of the same job (two reconcilers saw it unowned)
        # arriving while this one awaits the store only re-claims it, it never queues it twice
        self._job_ids.add(job_id)
        try:
            if not self._beating:  # the lease must be live before the first job names this owner
                await store_call(self.jobs_cfg, store.heartbeat, self.owner)  # type: ignore[arg-type]
            accepted = await store_call(self.jobs_cfg, store.accept, job_id, self.owner)  # type: ignore[arg-type]
            if accepted is None:
                self._job_ids.discard(job_id)
                return False
            self._records[job_id] = accepted
            self.dispatcher.submit(template, job_id, time.monotonic(), _Ticket(request, guidance_scale, None, job_id))
        except OverflowError as e:
            self._job_ids.discard(job_id)
            self._records.pop(job_id, None)
            await store_call(self.jobs_cfg, store.requeue, job_id, self.owner)  # type: ignore[arg-type]
            self.metrics.rejected.inc(tags={"template": template})
            raise QueueFull(str(e), retry_after_s=max(1.0, self.dispatcher.plans[template].latency_s)) from None
        except BaseException:
            self._job_ids.discard(job_id)
            raise
        self.metrics.queue_depth.set(self.dispatcher.queue_depth(template), tags={"template": template})
        assert self._wake is not None
        self._wake.set()
        return True

    def _tell_phases(self, template: str, est: PhaseEstimate) -> None:
        total = max(est.total_s, 1e-9)
        tail = min(0.99, (est.decode_s + est.encode_s) / total)
        self.dispatcher.set_phases(template, min(1.0 - tail, est.steps * est.step_s / total), tail)

    async def cancel_job(self, job_id: str) -> bool:
        """Drop a queued job from the queue (a running one stops through its step observer)."""
        removed = self.dispatcher.cancel(job_id)
        if removed:
            self._job_ids.discard(job_id)
            self._records.pop(job_id, None)
        return removed

    async def estimate(self, template: str) -> float:
        """Predicted seconds of one batch of ``template`` (the plan, refined by measured batches)."""
        return self.estimates[template].total_s

    async def generate(self, template: str, request_id: str, prompt: str, seed: int,
                       guidance_scale: float | None = None) -> GenerateResult:
        """Queue one request and wait for its encoded output and where it ran."""
        self._ensure_loop()
        request = _validated(request_id, prompt, seed, guidance_scale)
        if template not in self.dispatcher.plans:
            raise InvalidRequest(f"{self.model} has no plan for template {template!r}", "size")
        self.note_arrival(template)
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        try:
            self.dispatcher.submit(template, request_id, time.monotonic(), _Ticket(request, guidance_scale, fut))
        except OverflowError as e:
            plan = self.dispatcher.plans[template]
            self.metrics.rejected.inc(tags={"template": template})
            raise QueueFull(str(e), retry_after_s=max(1.0, plan.latency_s)) from None
        self.metrics.queue_depth.set(self.dispatcher.queue_depth(template), tags={"template": template})
        assert self._wake is not None
        self._wake.set()
        return await fut

    async def _dispatch_loop(self) -> None:
        assert self._wake is not None
        while True:
            now = time.monotonic()
            for a in self.dispatcher.dispatch(now):
                if a.resume:
                    self.runner.state.resume(a.batch_id)  # its own _run continues it
                    continue
                for p in a.preempts:
                    self.runner.request_pause(p.batch_id, p.offload)
                asyncio.get_running_loop().create_task(self._run(a, now))
            for r in self.dispatcher.take_shed():
                await self._shed(r)
            wake = self.dispatcher.next_wakeup(now)
            timeout = None if wake is None else max(0.0, wake - time.monotonic())
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except TimeoutError:
                pass

    async def _execute(self, a: Assignment[_Ticket]) -> dict[str, GenerateResult]:
        """Run an assignment on its workers; requests with different guidance run as sub-batches."""
        from xema_ray.runtime.engine import Batch

        entry = self.entries[a.template]
        by_guidance: dict[float | None, list[Pending[_Ticket]]] = {}
        for r in a.requests:
            by_guidance.setdefault(_ticket(r).guidance_scale, []).append(r)
        outputs: dict[str, GenerateResult] = {}
        arrived = {r.request_id: r.arrival for r in a.requests}
        for guidance, reqs in by_guidance.items():
            jobs = [r.request_id for r in reqs if _ticket(r).job_id is not None]
            if jobs:  # a job deleted while queued is dropped here; the rest are in_progress from now
                started = await self._start_jobs(jobs, self.estimates[a.template].total_s)
                reqs = [r for r in reqs if _ticket(r).job_id is None or r.request_id in started]
                jobs = [j for j in jobs if j in started]
                if not reqs:
                    continue
            observer = JobProgress(self.jobs_cfg, jobs, len(reqs) - len(jobs), self.estimates[a.template]) \
                if jobs and self.jobs_cfg is not None else None
            batch = Batch(
                config=entry.config.for_batch(len(reqs)),
                requests=tuple(_ticket(r).request for r in reqs),
                guidance_scale=guidance,
            )
            t0 = time.monotonic()
            try:
                results = await self.runner.run_sub_batch(a, batch, observer, f"{a.batch_id}.{len(outputs)}")
            except BatchCancelled:
                continue  # every member was deleted: the workers stopped at a step boundary
            seconds = time.monotonic() - t0
            lead = next(r for r in results if r.sp_rank == 0)
            self.metrics.observe_batch(a.template, len(reqs), lead)
            self.layout_counters.observe(a.template, lead)
            self.estimates[a.template] = PhaseEstimate.from_timings(entry.config.template.steps, lead.timings)
            self._tell_phases(a.template, self.estimates[a.template])
            for out in lead.outputs:
                # where it ran travels with the result: the router exposes it as response headers
                outputs[out.request_id] = GenerateResult(**dict(out), batch_id=a.batch_id, batch_size=len(reqs),
                                                         workers=a.workers, batch_seconds=seconds,
                                                         queued_s=max(0.0, t0 - arrived[out.request_id]),
                                                         replica=self.owner)
        return outputs

    async def _run(self, a: Assignment[_Ticket], decided: float | None = None) -> None:
        started = time.monotonic()
        try:
            for p in a.preempts:  # the paused batches' workers must have parked before this starts
                await self.runner.state.wait_parked(p.batch_id)
            if a.preempts:  # the pause handshake: what the dispatcher's prediction leaves out
                self.runner.state.observe_park(time.monotonic() - (decided or started) - a.park_wait_s)
            for attempt in (1, 2):
                generation = self.workers.generation
                try:
                    outputs = await self._execute(a)
                    break
                except WorkerDied as e:
                    if attempt == 2:
                        raise GroupUnavailable(
                            f"{self.model}: the worker set failed twice running {a.template} ({e.__class__.__name__}); "
                            "the request was not completed, retry later") from e
                    self.metrics.retries.inc(tags={"template": a.template})
                    await self._rebuild(generation)
            for r in a.requests:
                t = _ticket(r)
                if t.job_id is not None:
                    if r.request_id in outputs:  # absent: deleted while queued or running
                        await self._store_result(t.job_id, outputs[r.request_id])
                elif t.future is not None and not t.future.done():
                    # its time in this group (queue + batch): the rest of its latency is the front end's
                    t.future.set_result(outputs[r.request_id].model_copy(update={"group_seconds": time.monotonic() - r.arrival}))
                now = time.monotonic()
                self.metrics.observe_request(a.template, now - r.arrival, now <= r.deadline)
        except Exception as e:  # every request of the batch gets the error; none is dropped
            for r in a.requests:
                t = _ticket(r)
                if t.job_id is not None:
                    await self._job_failed(t.job_id, e)
                elif t.future is not None and not t.future.done():
                    t.future.set_exception(e)
            self.metrics.failed.inc(len(a.requests), tags={"template": a.template})
        finally:
            self.runner.state.finished(a.batch_id)  # a batch that ends instead of parking frees its preemptor
            for r in a.requests:
                self._job_ids.discard(r.request_id)
                if r.request_id not in self._unstored:
                    self._records.pop(r.request_id, None)
            self.dispatcher.complete(a.batch_id)
            self.metrics.batch_seconds.observe(time.monotonic() - started, tags={"template": a.template})
            if self._wake is not None:
                self._wake.set()

    async def _shed(self, r: Pending[_Ticket]) -> None:
        """A request the admission policy shed (it can no longer meet its SLO and others wait): 503."""
        plan = self.dispatcher.plans[r.template]
        e = QueueFull(f"{r.template}: request {r.request_id} can no longer finish within its SLO "
                      f"({plan.slo_s:.1f} s) and was shed so that others meet theirs", retry_after_s=max(1.0, plan.latency_s))
        self.metrics.rejected.inc(tags={"template": r.template})
        t = r.payload
        assert t is not None
        if t.job_id is not None:
            self._job_ids.discard(t.job_id)
            try:
                await asyncio.to_thread(self._store().fail, t.job_id, "shed", str(e))
            except Exception:
                logger.exception("%s: could not record shedding %s; its lease will lapse", self.model, t.job_id)
        elif t.future is not None and not t.future.done():
            t.future.set_exception(e)

    async def _store_result(self, job_id: str, out: GenerateResult) -> None:
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

    async def _start_jobs(self, jobs: list[str], predicted_s: float) -> set[str]:
        """Mark the jobs started; the ones the store says were deleted are left out. The workers
        wait for that at most ``START_WAIT_S`` (not at all while the store lags): a job whose
        answer is late runs, its mark lands when the store answers."""
        store = self._store()
        calls = {j: asyncio.ensure_future(self._job_call(store.start, j, self.owner, predicted_s)) for j in jobs}
        if time.monotonic() >= self._store_lags_until:
            await asyncio.wait(calls.values(), timeout=START_WAIT_S)
        started = set()
        for j, call in calls.items():
            if not call.done():  # late: it runs; the store hears of it when it answers
                self._store_lags_until = time.monotonic() + self.jobs_cfg.lease_s  # type: ignore[union-attr]
                call.add_done_callback(lambda c: c.cancelled() or c.exception())  # nothing waits for it now
                started.add(j)
            elif call.exception() is not None:
                if not isinstance(call.exception(), store_faults()):
                    raise call.exception()  # type: ignore[misc]
                started.add(j)  # the store is down: run it anyway (it is ours), record it later
            elif call.result():
                started.add(j)
        return started

    async def _job_call(self, fn: Any, job_id: str, *args: Any) -> Any:
        """A store update of a job held here; if it fails because the store lost the record (it
        came back empty and this replica has not written its jobs back yet), the record is
        written back and the update tried once more."""
        assert self.jobs_cfg is not None
        store = self._store()
        done = await store_call(self.jobs_cfg, fn, job_id, *args)
        rec = self._records.get(job_id)
        if done or rec is None or await store_call(self.jobs_cfg, store.get, job_id, True) is not None:
            return done
        await store_call(self.jobs_cfg, store.restore, rec.model_copy(update={"owner": self.owner}))
        return await store_call(self.jobs_cfg, fn, job_id, *args)

    async def _flush_results(self) -> None:
        assert self.jobs_cfg is not None
        delay = 0.0
        while self._unstored:
            await asyncio.sleep(delay)
            for job_id, (name, data, media) in list(self._unstored.items()):
                try:
                    await self._job_call(self._store().complete, job_id, {name: (data, media)})
                except store_faults() as e:
                    logger.warning("%s: the result of %s waits for the job store (%s)", self.model, job_id,
                                   type(e).__name__)
                    delay = min(5.0, max(0.5, 2 * delay))
                    break
                except Exception as e:  # not a store fault: the job fails with the reason
                    self._unstored.pop(job_id, None)
                    await self._job_failed(job_id, e)
                else:
                    self._unstored.pop(job_id, None)
                    self._records.pop(job_id, None)

    async def _job_failed(self, job_id: str, e: Exception) -> None:
        """A fault (the worker set or the store) re-dispatches the job, up to MAX_JOB_ATTEMPTS
        runs; any other error fails it with its message."""
        store, cfg = self._store(), self.jobs_cfg
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

    # ------------------------------------------------------------------ introspection
    async def status(self) -> dict[str, Any]:
        """The group's state for ``/healthz`` (a ``GroupStatus``): ``ok``, or ``degraded`` while its
        worker set is being rebuilt or after a worker died or a rebuild failed (with the reason)."""
        health = self.workers.health()
        return GroupStatus(
            model=self.model, status="ok" if health.state == "ok" else "degraded", reason=health.reason,
            workers=self.n_workers, generation=health.generation, queued=self.dispatcher.queue_depth(),
            static_layouts=self.layout_counters.snapshot(), running=len(self.dispatcher.running),
            paused=len(self.dispatcher.paused), jobs=len(self._job_ids), owner=self.owner,
        ).model_dump()

    def check_health(self) -> None:
        """Serve's own health check of this replica: it fails only when the replica can no longer
        serve (its dispatch loop ended: a bug), so that Serve replaces it. A dead worker is not a
        failure here: the group rebuilds its worker set itself."""
        task = self._loop_task
        if task is not None and task.done():
            cause = None if task.cancelled() else task.exception()
            raise RuntimeError(f"{self.model}: the dispatch loop ended ({cause!r})")

    async def preemption_stats(self) -> PreemptionReport:
        """Step-level preemption so far (``/v1/stats``): per template, batches paused, the bytes
        the paused ones hold now, seconds spent paused; and the dispatcher's decisions."""
        return self.runner.state.report(self.policy is not None, self.dispatcher.decisions, self.dispatcher.preemptions_total)

    async def layout_stats(self) -> GroupLayoutStats:
        """The static allocator's counters per template, for ``/v1/stats``."""
        return self.layout_counters.snapshot()

    async def probe_workers(self, timeout_s: float = 1.0) -> list[str]:
        """Each worker's state now (``WorkerState``: dead only when its process is gone)."""
        return list(await self.workers.probe(timeout_s))

    async def kill_worker(self, index: int) -> None:
        """Fault injection for tests and drills: kill one worker."""
        if not 0 <= index < self.n_workers:
            raise ValueError(f"worker index must be in [0, {self.n_workers}), got {index}")
        self.workers.kill(index)
