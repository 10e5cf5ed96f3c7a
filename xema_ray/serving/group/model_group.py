"""ModelGroup: one model's worker set behind a Ray Serve deployment (paper §4, Figure 3).

The group connects three things: the ``Dispatcher`` (``xema_ray.scheduling``, shared with the
simulator), which forms batches per template, orders them by deadline and places each on a free
SP group (DP is how many groups run at once); the ``WorkerSet`` (``xema_ray.serving.group.worker_set``),
which starts, calls and rebuilds the workers — Ray actors in the replica's placement group when
deployed, or in-process workers in tests, given by injection; and the video jobs' lifecycle in the
job store (``xema_ray.serving.jobs.lifecycle.JobLifecycle``). Each request goes schedule
(``generate`` / ``submit_job`` -> ``_dispatch_loop``) -> execute (``_run`` -> ``_execute`` on the
workers) -> complete (``_run``: results, failures, the dispatcher told). A worker that dies takes
its set's process groups with it, so the set is rebuilt (weights reloaded) and the batch is
retried once; if that fails too, its requests fail with a clear error — never silently.

Video jobs (``submit_job``) go through the same dispatcher as synchronous requests; their state
lives in the job store: the group marks a job accepted, started, its progress after every step
and its result through ``JobLifecycle``, which never makes the workers wait for the store. A job
deleted while it runs stops counting at the next step; a batch whose members are all deleted stops
there and frees its workers.

Step-level preemption (``preemption``, the dispatcher's ``PreemptionPolicy``): when the
dispatcher pauses a running batch for a more urgent one, the group's ``PreemptibleRunner`` asks
the batch's workers to park it at the next step boundary (its state kept on the device or moved
to the host, as the dispatcher decided), starts the urgent batch once they have, and resumes the
paused one when the dispatcher says so. Workers then serve several calls at once, so a pause
reaches a busy worker. A paused video job stays ``in_progress``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from xema_ray.plan import ExecutionConfig, PlanEntry
from xema_ray.scheduling.batch import Assignment, DispatchPlan, Pending
from xema_ray.scheduling.batch_key import BatchKey, sub_batches
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.scheduling.quality import choose_auto
from xema_ray.serving.group.adapter_registry import RegistryClient
from xema_ray.serving.group.adapters import GroupAdapters, folder_sources
from xema_ray.serving.group.decode_pool import pool_for
from xema_ray.serving.group.isolation import run_isolating
from xema_ray.serving.group.layout_stats import LayoutCounters
from xema_ray.serving.messages import (GenerateResult, GroupLayoutStats, GroupRequest, GroupStatus, GroupUnavailable,
                                       InvalidRequest, QueueFull)
from xema_ray.serving.group.metrics import ServingMetrics
from xema_ray.serving.group.quality import served_quality
from xema_ray.vocabulary import QualityTier
from xema_ray.serving.group.plan_reload import GroupPlans, PlanReload, plans_hash
from xema_ray.serving.group.preemption import PreemptibleRunner, PreemptionReport
from xema_ray.serving.group.settings import GroupSettings, ModelGroupConfig
from xema_ray.serving.group.worker_set import RebuildFailed, WorkerDied, WorkerSetFactory, WorkerSetSpec, worker_set_for
from xema_ray.serving.jobs.lifecycle import JobLifecycle
from xema_ray.serving.jobs.progress import PhaseEstimate
from xema_ray.serving.group.replica_stats import SummaryPublisher
from xema_ray.serving.scale.replica_summary import ReplicaSummary

if TYPE_CHECKING:  # torch, diffusers and the model code stay out of the import: the app's builder imports this
    from ray.serve.handle import DeploymentHandle

    from xema_ray.lora import AdapterInfo, AdapterSource, PoolStats

    from xema_ray.platforms.host_memory import SegmentHolder
    from xema_ray.runtime.decode_worker import HandedLatents
    from xema_ray.runtime.engine import GenerationRequest, RequestOutput
    from xema_ray.runtime.worker import LoadedModel
    from xema_ray.serving.group.load_metrics import GroupLoad

__all__ = ["GroupSettings", "ModelGroup"]  # GroupSettings: group/settings.py

#: concurrent calls a worker serves with preemption on (a running batch, a pause, a
#: preempting batch, a resume)
WORKER_CONCURRENCY = 4


@dataclass
class _Ticket:
    request: GenerationRequest  # validated on arrival (its guidance, steps and tier: its ``Pending.key``)
    future: asyncio.Future[GenerateResult] | None  # None for a job: its result goes to the job store
    job_id: str | None = None


def _ticket(r: Pending[_Ticket]) -> _Ticket:
    assert r.payload is not None  # every live request carries its ticket (only the simulator's carry none)
    return r.payload


def replica_app_name() -> str:
    """The Serve application this replica belongs to (its workers' shared host segments are that
    app's); ``DEFAULT_APP`` outside a Serve replica (in-process tests)."""
    from xema_ray.platforms.host_memory import DEFAULT_APP

    try:
        from ray import serve

        return serve.get_replica_context().app_name or DEFAULT_APP
    except Exception:  # noqa: BLE001 — not inside a Serve replica
        return DEFAULT_APP


class ModelGroup:
    """Serve deployment body; wrapped by ``serve.deployment`` in ``deployments/app.py``.

    Args:
        config: the group's part of the app's YAML (model, workers, wait_window_s, max_queue,
            weights_dir, residency: "per_template" — each batch's plan decides, a switch moves only
            the difference — or "shared", one residency for the group; None: per_template).
        plans: template shape key -> its plan entry (from the plan table).
        settings: the app's settings and the plan table's choices for the group (``GroupSettings``).
        worker_set: makes the worker set from its spec (default: the device's own, Ray actors
            for "cpu" and "cuda"; tests give ``InProcessWorkerSet``).
        adapter_registry: the handle of the app's ``AdapterRegistry`` (replicated groups with adapters
            follow it).
        host_holder: the node-level process that keeps the model's host copy (``host_copy``) after
            the group's last worker on the node is gone (a group scaled to zero wakes warm); None:
            the last worker out removes it.
        wait_decode: wait for the decode pool's workers to load before returning; False: the
            caller calls ``wait_started`` (a shared replica, once every member is built, so that
            the decode workers load while the other members build).

    Its collaborators: ``adapters`` (``GroupAdapters``: the LoRA adapters, the admin calls, the
    replicas' sync) and ``publisher`` (``SummaryPublisher``: the replica's summary for the request
    router and the autoscaler, and its drain); the methods Serve and the Router call by name
    (``record_routing_stats``, ``add_adapter``, ``drain``, ...) hand over to them.
    """

    def __init__(self, config: ModelGroupConfig, plans: dict[str, PlanEntry], settings: GroupSettings | None = None,
                 worker_set: WorkerSetFactory = worker_set_for, adapter_registry: DeploymentHandle | None = None,
                 host_holder: SegmentHolder | None = None, wait_decode: bool = True) -> None:
        s = settings if settings is not None else GroupSettings()
        self.host_holder = host_holder
        self._settings = s
        self.config = config
        self.model = model = config.model
        self.n_workers = workers = config.workers
        self.entries = dict(plans)
        #: per template: batches run with the layout armed, hits, fallbacks, reserved bytes; the workers' status
        self.layout_counters = LayoutCounters({k: e.config.layout_ref for k, e in self.entries.items()})
        self.policy = s.preemption
        dispatch_plans = {k: DispatchPlan.of_entry(e) for k, e in self.entries.items()}
        self.dispatcher: Dispatcher[_Ticket] = Dispatcher(dispatch_plans, workers, config.wait_window_s,
                                                          config.max_queue, self.policy, admission=s.admission,
                                                          batching=config.batching)
        self.owner = f"{model}-{uuid.uuid4().hex[:12]}"  # this replica, as job owner
        self.jobs = JobLifecycle(model, self.owner, s.jobs)  # video jobs: accepted, started, stored, failed
        self.publisher = SummaryPublisher(model, self.owner, self.dispatcher, self.jobs)
        self.metrics = ServingMetrics(model, lambda: (self.entries, self._settings.budget_bytes), self.publisher.summary)
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        phases = s.phases
        self.estimates = {k: PhaseEstimate.from_shares(e.config.template.steps, e.prediction.latency_s, phases[k])
                          if phases is not None and k in phases else
                          PhaseEstimate.from_plan(e.config.template.steps, e.prediction.latency_s,
                                                  e.config.template.spec.kind == "video")
                          for k, e in self.entries.items()}
        for k, est in self.estimates.items():  # where each template's step boundaries fall (preemption)
            self._tell_phases(k, est)
        self.plans_hash = plans_hash(self.entries)
        self.reload = PlanReload()
        #: the decode pool (``decode:``; decode_pool.py): batch id -> request id -> its decode
        self.decode_pool = pool_for(config, s)
        self._decodes: dict[int, dict[str, asyncio.Task[GenerateResult]]] = {}
        self._freed: dict[int, float] = {}  # batches whose DiT workers were freed at the hand-over
        if self.decode_pool is not None:  # its workers' processes start first, beside this group's own
            self.decode_pool.spawn()      # imports and load (the worker spec imports the model code)
        self.workers = worker_set(self._worker_spec(self.entries, s, folder_sources(model, config.adapters)))
        self.adapters = GroupAdapters(model, self.owner, config.adapters, self.workers, self._paused_with,
                                      RegistryClient(adapter_registry) if adapter_registry is not None else None)
        self.workers.on_loaded = self._loaded
        self.runner = PreemptibleRunner(model, self.workers, self.dispatcher, self.policy, self.metrics)
        self.workers.start()
        if wait_decode:
            self.wait_started()

    def wait_started(self) -> None:
        """Block until the decode pool's workers have loaded (a group built with ``wait_decode=False``
        is started once this returns)."""
        if self.decode_pool is not None:
            self.decode_pool.wait_started()

    def _loaded(self, loaded: LoadedModel) -> None:
        """A worker set loaded (its ``on_loaded``): its layouts' status, the adapters it holds."""
        self.layout_counters.loaded(loaded.layout_status)
        self.adapters.loaded(loaded)

    def _worker_spec(self, entries: dict[str, PlanEntry], s: GroupSettings,
                     adapters: tuple[AdapterSource, ...]) -> WorkerSetSpec:
        """The worker set that runs ``entries`` (every weight placed once, at load, where the plans
        keep it; never whole on the device) and loads ``adapters``."""
        from xema_ray.runtime.worker import ModelLoadConfig

        c = self.config
        load = ModelLoadConfig(model=self.model, weights_dir=c.weights_dir, residency=c.residency or "per_template",
                               dtype=c.dtype, component_dtypes=c.component_dtypes,
                               share_host_weights=c.share_host_weights,
                               plans=tuple(e.config for _, e in sorted(entries.items())),
                               weight_formats=tuple(sorted({t.weights for e in entries.values() for t in e.tiers.values()
                                                            if t.weights != "model"})),  # type: ignore[misc]
                               layouts_dir=s.layouts_dir, emulation=s.emulation, budget_bytes=s.budget_bytes,
                               adapters=c.adapters, adapter_sources=adapters, app=s.app or replica_app_name(),
                               host_copy=c.wants_host_copy() and s.emulation is None, host_copy_holder=self.host_holder)
        return WorkerSetSpec(
            device=s.device, size=self.n_workers, load=load, worker_cpus=s.worker_cpus, backend=s.worker_set,
            layouts=tuple(sorted({(e.config.ulysses, e.config.ring) for e in entries.values() if e.config.sp > 1})),
            concurrency=WORKER_CONCURRENCY if self.policy is not None else 1,
            # a CUDA worker installs the static allocator when its plans carry layouts to arm
            static_allocator=s.device == "cuda" and any(e.config.layout_ref for e in entries.values()))

    # ------------------------------------------------------------------ a new plan table (plan_reload)
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's in-place config update (``xema serve --reload-plans``): the group's ``GroupPlans``.
        Returns at once (the replica stays RUNNING and keeps admitting); a change of plans is
        swapped in on the replica's loop (``_swap_plans``), an unchanged one is nothing to do."""
        new = GroupPlans.model_validate(user_config)
        unknown = sorted(set(new.plans) ^ set(self.entries))
        if unknown:  # ``xema serve --reload-plans`` checks this before it deploys
            raise ValueError(f"{self.model}: a new plan table must plan exactly the served templates; differs in {unknown}")
        if new.hash == self.reload.target_hash(self.plans_hash):
            return
        self.reload.target = new
        self.reload.start(asyncio.get_running_loop(), self._swap_plans)

    async def _swap_plans(self, new: GroupPlans) -> None:
        """Serve ``new``'s plans: hold new batches, let the running ones finish, replace the worker
        set with one loaded for the new plans, hand the dispatcher the new plans (queued requests
        kept), dispatch again."""
        self._ensure_loop()
        self.reload.holding = True
        try:
            while self.dispatcher.running or self.dispatcher.paused:
                await self.reload.batch_done.wait()
                self.reload.batch_done.clear()
            settings = self._settings.model_copy(update={
                "layouts_dir": Path(new.layouts_dir) if new.layouts_dir else None, "budget_bytes": new.budget_bytes,
                "admission": new.admission})
            # the new set reports its layouts' status to these on load
            old_spec, old_counters = self.workers.spec, self.layout_counters
            self.layout_counters = LayoutCounters({k: e.config.layout_ref for k, e in new.plans.items()})
            try:
                async with self.adapters.lock:  # an adapter added meanwhile is in the spec the new set loads
                    await self.workers.replace(self._worker_spec(new.plans, settings, self.adapters.sources()))
            except RebuildFailed:
                # the new plans cannot load (a layout file missing, ...): back to the plans it served,
                # so that the queued requests run; the failure is reported (/healthz plans_reload_error)
                self.layout_counters = old_counters
                try:
                    await self.workers.replace(old_spec)
                except RebuildFailed:
                    pass  # the next batch's rebuild tries the old plans again
                raise
            added = sorted(set(new.plans) - set(self.entries))
            self._settings, self.entries = settings, dict(new.plans)
            self.metrics.start_at_zero(added)  # the new templates' counters at 0, as at start-up
            self.dispatcher.replace_plans({k: DispatchPlan.of_entry(e) for k, e in self.entries.items()}, new.admission)
            for k, e in self.entries.items():
                t = e.config.template
                self.estimates[k] = PhaseEstimate.from_plan(t.steps, e.prediction.latency_s, t.spec.kind == "video")
                self._tell_phases(k, self.estimates[k])
            self.plans_hash = new.hash
            self.reload.swapped(new)
        finally:
            self.reload.holding = False
            if self._wake is not None:
                self._wake.set()

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

    # ------------------------------------------------------------------ schedule
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._dispatch_loop())
        self.jobs.start_heartbeat()

    def _admit(self, req: GroupRequest) -> GenerationRequest:
        """``req`` checked (``InvalidRequest``, HTTP 422, if it cannot run here) and counted as an arrival."""
        request = self.adapters.check(req.validated())
        if req.template not in self.dispatcher.plans:
            raise InvalidRequest(f"{self.model} has no plan for template {req.template!r}", "size")
        req.check_references(self.entries[req.template].config.template.references)
        self.publisher.note_arrival(req.template)
        return request

    def _key_of(self, req: GroupRequest) -> BatchKey:
        """``req``'s batch key with its tier resolved: its own, or for ``auto`` the one its queue
        allows (``xema_ray.scheduling.quality.choose_auto``)."""
        if req.quality != QualityTier.AUTO:
            return req.batch_key
        entry = self.entries[req.template]
        groups = max(1, self.n_workers // max(1, entry.config.sp))
        tier = choose_auto(entry, self.dispatcher.queue_depth(req.template), groups)
        return replace(req.batch_key, quality=tier)

    def _queue_full(self, template: str, e: OverflowError) -> QueueFull:
        self.metrics.rejected.inc(tags={"template": template})
        return QueueFull(str(e), retry_after_s=max(1.0, self.dispatcher.plans[template].latency_s))

    def _queued(self, template: str) -> None:
        self.metrics.observe_queued(template, self.dispatcher.queue_depth(template))
        assert self._wake is not None
        self._wake.set()

    async def generate(self, req: GroupRequest) -> GenerateResult:
        """Queue one request and wait for its encoded output and where it ran."""
        self._ensure_loop()
        await self.adapters.synced_for(req.lora)
        request = self._admit(req)
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        try:
            self.dispatcher.submit(req.template, req.request_id, time.monotonic(),
                                   _Ticket(request, fut), key=self._key_of(req))
        except OverflowError as e:
            raise self._queue_full(req.template, e) from None
        self._queued(req.template)
        return await fut

    async def submit_job(self, req: GroupRequest) -> bool:
        """Queue a stored job, ``req.request_id`` (idempotent). False: the job is gone or finished.
        Raises QueueFull."""
        self._ensure_loop()
        job_id = req.request_id
        if await self.jobs.reclaim(job_id):  # ours already
            return True
        await self.adapters.synced_for(req.lora)
        request = self._admit(req)
        ticket = _Ticket(request, None, job_id)
        try:
            if not await self.jobs.accept(job_id, lambda: self.dispatcher.submit(req.template, job_id, time.monotonic(),
                                                                                 ticket, key=self._key_of(req))):
                return False
        except OverflowError as e:  # the job went back to the store
            raise self._queue_full(req.template, e) from None
        self._queued(req.template)
        return True

    async def cancel_job(self, job_id: str) -> bool:
        """Drop a queued job from the queue (a running one stops through its step observer)."""
        removed = self.dispatcher.cancel(job_id)
        if removed:
            self.jobs.cancelled(job_id)
        return removed

    async def estimate(self, template: str) -> float:
        """Predicted seconds of one batch of ``template`` (the plan, refined by measured batches)."""
        return self.estimates[template].total_s

    def _tell_phases(self, template: str, est: PhaseEstimate) -> None:
        total = max(est.total_s, 1e-9)
        decode_encode = min(0.99, (est.decode_s + est.encode_s) / total)
        self.dispatcher.set_phases(template, min(1.0 - decode_encode, est.steps * est.denoise_step_s / total), decode_encode)

    async def _dispatch_loop(self) -> None:
        assert self._wake is not None
        while True:
            now = time.monotonic()
            # a plan swap holds new batches (requests still queue; paused ones resume) until the workers are replaced
            held = self.reload.holding
            for a in (self.dispatcher.dispatch(now, start_new=False) if held else self.dispatcher.dispatch(now)):
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

    async def _shed(self, r: Pending[_Ticket]) -> None:
        """A request the admission policy shed (it can no longer meet its SLO and others wait): 503."""
        plan = self.dispatcher.plans[r.template]
        e = QueueFull(f"{r.template}: request {r.request_id} can no longer finish within its SLO "
                      f"({plan.slo_s:.1f} s) and was shed so that others meet theirs", retry_after_s=max(1.0, plan.latency_s))
        self.metrics.observe_shed(r.template)
        t = r.payload
        assert t is not None
        if t.job_id is not None:
            await self.jobs.shed(t.job_id, str(e))
        elif t.future is not None and not t.future.done():
            t.future.set_exception(e)

    # ------------------------------------------------------------------ execute
    async def _execute(self, a: Assignment[_Ticket]) -> tuple[dict[str, GenerateResult], dict[str, Exception]]:
        """Run an assignment on its workers, one sub-batch per ``BatchKey`` (``batch_key.sub_batches``,
        as the dispatcher priced it): the outputs, and the requests at fault with their errors
        (``isolation``: the others re-ran)."""
        entry, runs = self.entries[a.template], itertools.count()  # sub-batch labels, re-runs included
        outputs: dict[str, GenerateResult] = {}
        failed: dict[str, Exception] = {}
        parts = self.adapters.fit_pool(dict(sub_batches(a.requests, lambda r: r.key)), lambda r: _ticket(r).request.lora,
                                       failed, lambda r: r.request_id)
        for i, (key, reqs) in enumerate(parts):
            later_s = sum(a.plan.latency_for(len(rs)) for _, rs in parts[i + 1:])  # a re-run holds the workers for these too
            failed.update(await run_isolating(reqs, lambda rs, rerun, k=key: self._execute_sub_batch(
                a, entry, k, rs, outputs, f"{a.batch_id}.{next(runs)}", rerun), a.plan.latency_for,
                lambda why, n, more_s, later_s=later_s: self._rerun(a, why, n, more_s + later_s),
                f"{self.model} batch {a.batch_id}"))
        return outputs, failed

    def _rerun(self, a: Assignment[_Ticket], why: str, n: int, more_s: float) -> None:
        """``n`` sub-batches of ``a`` run again (``isolation``): counted, and the dispatcher told
        that its workers stay busy ``more_s`` longer (the plan's prediction of the pending runs and
        of the batch's sub-batches still to come)."""
        self.metrics.reruns.inc(n, tags={"template": a.template, "reason": why})
        self.dispatcher.extend(a.batch_id, more_s, time.monotonic())

    async def _execute_sub_batch(self, a: Assignment[_Ticket], entry: PlanEntry, key: BatchKey, reqs: list[
                                 Pending[_Ticket]], outputs: dict[str, GenerateResult], label: str, rerun: bool) -> bool:
        """One sub-batch (one ``BatchKey``: one guidance, one step count) into ``outputs``; ``rerun``:
        its jobs started before. False: nothing ran (every member deleted meanwhile): no neighbour was served."""
        from xema_ray.runtime.engine import Batch
        from xema_ray.runtime.progress import BatchCancelled

        arrived = {r.request_id: r.arrival for r in reqs}
        steps = key.steps  # the dispatcher batched one step count (``DispatchPlan.for_steps``)
        estimate = replace(self.estimates[a.template], steps=steps)
        jobs = [r.request_id for r in reqs if _ticket(r).job_id is not None]
        bases: dict[str, float] | None = None
        if jobs:  # a job deleted meanwhile is dropped here; the rest are in_progress from now
            if rerun:  # run again for a neighbour's fault: its progress kept, what remains this run's
                started = set(bases := await self.jobs.rerun(jobs, estimate.total_s))
            else:
                started = await self.jobs.start(jobs, estimate.total_s)  # at the batch's own step count
            reqs = [r for r in reqs if _ticket(r).job_id is None or r.request_id in started]
            jobs = [j for j in jobs if j in started]
            if not reqs:
                return False
        observer = self.jobs.observer(jobs, len(reqs) - len(jobs), estimate, bases)
        quality = key.quality  # one tier per batch (``BatchKey``: tiers never mix)
        batch = Batch(config=entry.tier_config(quality).for_batch(len(reqs)),
                      requests=tuple(_ticket(r).request for r in reqs),
                      guidance_scale=key.guidance[0], guidance_scale_2=key.guidance[1], steps=steps)
        t0 = time.monotonic()
        try:
            results = await self.runner.run_sub_batch(a, batch, observer, label)
        except BatchCancelled:
            return False  # every member was deleted: the workers stopped at a step boundary
        seconds = time.monotonic() - t0
        lead = next(r for r in results if r.sp_rank == 0)
        self.metrics.observe_batch(a.template, len(reqs), lead, a.workers, results, seconds, steps=steps)
        self.layout_counters.observe(a.template, lead, dict(zip(a.workers, results, strict=False)))
        # measured at the batch's step count, kept at the template's (the time per step is the same)
        self.estimates[a.template] = replace(PhaseEstimate.from_timings(steps, lead.timings),
                                             steps=entry.config.template.steps)
        self._tell_phases(a.template, self.estimates[a.template])
        def result(out: RequestOutput) -> GenerateResult:  # where it ran: the router's response headers
            return GenerateResult(**dict(out), batch_id=a.batch_id, batch_size=len(reqs), workers=a.workers,
                                  batch_seconds=seconds, queued_s=max(0.0, t0 - arrived[out.request_id]),
                                  replica=self.owner, **served_quality(quality, steps, lead, batch.config.step_cache is not None))

        outputs.update((out.request_id, result(out)) for out in lead.outputs)
        if lead.handed:  # the decode pool's: decoded after the DiT workers are freed (``_run``)
            await self._hand_over(a.batch_id, lead.handed, batch.config, result, jobs)
        return True

    async def _hand_over(self, batch_id: int, handed: list[HandedLatents], config: ExecutionConfig,
                         result: Callable[[RequestOutput], GenerateResult], jobs: list[str]) -> None:
        """Each request's latents into Ray's object store and onto the decode pool (its reference
        held by its task until the video is written: a lost decode worker decodes it again)."""
        pool = self.decode_pool
        if pool is None:
            raise RuntimeError(f"{self.model}: a plan hands its decode to a pool, the group has none")
        mitigations = config.decode.mitigations if config.decode is not None else ()

        async def one(ref: Any) -> GenerateResult:
            return result(await pool.decode(ref, mitigations))

        tasks = self._decodes.setdefault(batch_id, {})
        for h in handed:
            tasks[h.request_id] = asyncio.ensure_future(one(pool.put(h)))
        await self.jobs.decoding([j for j in jobs if j in tasks])

    async def _fail(self, t: _Ticket, e: Exception) -> None:
        if t.job_id is not None:
            await self.jobs.failed(t.job_id, e)
        elif t.future is not None and not t.future.done():
            t.future.set_exception(e)

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
                    outputs, failed = await self._execute(a)
                    await self._decoded(a, outputs, failed)
                    break
                except WorkerDied as e:
                    if attempt == 2:
                        raise GroupUnavailable(
                            f"{self.model}: the worker set failed twice running {a.template} ({e.__class__.__name__}); "
                            "the request was not completed, retry later") from e
                    self.metrics.retries.inc(tags={"template": a.template})
                    await self._rebuild(generation)
            # complete: each result to its caller (or the job store); the dispatcher is told below
            for r in a.requests:
                t = _ticket(r)
                if r.request_id in failed:  # it failed (its own input: 422; alone: see isolation); its neighbours were served
                    self.metrics.observe_failed(a.template, 1)  # missed its SLO too (xema_slo_attainment)
                    await self._fail(t, failed[r.request_id])
                    continue
                if t.job_id is not None:
                    if r.request_id in outputs:  # absent: deleted while queued or running
                        await self.jobs.store_result(t.job_id, outputs[r.request_id])
                elif t.future is not None and not t.future.done():
                    # its time in this group (queue + batch): the rest of its latency is the front end's
                    t.future.set_result(outputs[r.request_id].model_copy(update={"group_seconds": time.monotonic() - r.arrival}))
                now = time.monotonic()
                served = outputs[r.request_id].quality if r.request_id in outputs else r.key.quality
                self.metrics.observe_request(a.template, now - r.arrival, now <= r.deadline, served)
        except Exception as e:  # every request of the batch gets the error; none is dropped
            from xema_ray.runtime.out_of_memory import DeviceOutOfMemory

            if isinstance(e, DeviceOutOfMemory):  # this batch alone failed (a JSON 503); the workers serve on
                cause = getattr(e, "cause", e)  # a Ray actor's error: RayTaskError.as_instanceof_cause()
                self.metrics.out_of_memory.inc(tags={"template": a.template})
                self.layout_counters.out_of_memory(a.template, str(cause))
            for r in a.requests:
                await self._fail(_ticket(r), e)
            self.metrics.observe_failed(a.template, len(a.requests))
        finally:
            self.runner.state.finished(a.batch_id)  # a batch that ends instead of parking frees its preemptor
            self.jobs.finished(r.request_id for r in a.requests)
            for task in self._decodes.pop(a.batch_id, {}).values():
                task.cancel()  # a batch that failed after its hand-over: nothing waits for its decodes
            if self._freed.pop(a.batch_id, None) is None:  # not freed at its hand-over
                self._free(a, started)

    def _free(self, a: Assignment[_Ticket], started: float) -> None:
        """The batch's DiT workers are free: the dispatcher told, the loop woken."""
        self.dispatcher.complete(a.batch_id)
        self.metrics.batch_seconds.observe(time.monotonic() - started, tags={"template": a.template})
        self.reload.batch_done.set()
        if self._wake is not None:
            self._wake.set()

    async def _decoded(self, a: Assignment[_Ticket], outputs: dict[str, GenerateResult],
                       failed: dict[str, Exception]) -> None:
        """A batch whose latents went to the decode pool: its DiT workers freed at once (the next
        batch starts while this one decodes), then each request's video into ``outputs`` or its
        error into ``failed`` (a decode failure fails that request alone)."""
        tasks = self._decodes.get(a.batch_id)
        if not tasks:
            return
        self._freed[a.batch_id] = time.monotonic()
        self._free(a, time.monotonic())
        for rid, task in tasks.items():
            try:
                outputs[rid] = await task
            except Exception as e:  # noqa: BLE001 — this request's decode alone
                failed[rid] = e
        self._decodes.pop(a.batch_id, None)

    def _paused_with(self, name: str) -> bool:
        """A batch paused at a step boundary (step-level preemption) has a request stacking ``name``."""
        return any(u.name == name for a in self.dispatcher.paused for r in a.requests for u in _ticket(r).request.lora)

    # ------------------------------------------------------------------ adapters (the Router's admin endpoints)
    async def add_adapter(self, source: AdapterSource) -> AdapterInfo:
        """``GroupAdapters.add``: on every worker (and replica), or on none."""
        return await self.adapters.add(source)

    async def remove_adapter(self, name: str) -> bool:
        """``GroupAdapters.remove``; False: not loaded."""
        return await self.adapters.remove(name)

    async def list_adapters(self) -> list[AdapterInfo]:
        return await self.adapters.info()

    async def adapter_stats(self) -> list[PoolStats]:
        return await self.adapters.pool_stats()

    # ------------------------------------------------------------------ the replica's summary (scale/)
    def summary(self) -> ReplicaSummary:
        return self.publisher.summary()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's tick (0.5 s, replicated groups): also when the other replicas' adapter changes are followed."""
        self.adapters.tick()
        return self.publisher.routing_stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return self.publisher.autoscaling_stats()

    async def replica_summary(self) -> dict[str, Any]:
        """The summary as JSON (for ``/v1/stats``, tests and the bench)."""
        return self.summary().model_dump(mode="json")

    async def load_stats(self) -> GroupLoad:
        """The load figures of the Prometheus endpoint as one typed answer (``LoadMetrics.snapshot``:
        predicted waits, attainment, memory per worker), for JSON readers such as the operator view."""
        return self.metrics.load.snapshot().model_copy(update={"replica": self.owner})

    async def drain(self, budget_s: float) -> dict[str, int]:
        """``SummaryPublisher.drain`` (Serve scales the replica down)."""
        return await self.publisher.drain(budget_s)

    # ------------------------------------------------------------------ introspection

    async def status(self) -> dict[str, Any]:
        """The group's state for ``/healthz`` (a ``GroupStatus``): ``ok``, or ``degraded`` while its
        worker set is being rebuilt or after a worker died or a rebuild failed (with the reason)."""
        health = self.workers.health()
        return GroupStatus(
            model=self.model, status="ok" if health.state == "ok" else "degraded", reason=health.reason,
            workers=self.n_workers, generation=health.generation, queued=self.dispatcher.queue_depth(),
            static_layouts=self.layout_counters.snapshot(), running=len(self.dispatcher.running),
            paused=len(self.dispatcher.paused), jobs=len(self.jobs.held), owner=self.owner,
            plans_hash=self.plans_hash, plans_swapping=self.reload.holding or self.reload.pending,
            plans_swapped=self.reload.swaps, plans_reload_error=self.reload.failed,
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

    async def decode_pool_report(self) -> dict[str, Any] | None:
        """The decode pool's workers, GPU share and counters (decoded, retried, replaced); None: none."""
        return self.decode_pool.report() if self.decode_pool is not None else None

    async def kill_decode_worker(self, index: int) -> None:
        """Fault injection for tests and drills: kill one decode worker of the pool."""
        if self.decode_pool is None or not 0 <= index < len(self.decode_pool.slots):
            raise ValueError(f"{self.model}: no decode worker {index}")
        self.decode_pool.kill(index)
