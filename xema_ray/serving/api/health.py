"""The Router's view of its model groups, built from facts only: what each group answers about
itself, what Ray says when a call to it fails (its replica or node died), and what Serve's
controller says about its replicas. A slow answer is never read as death.

Each group is probed by its own background task, one ``status`` call at a time, never cancelled
and never timed out: under load a group answers late, and late is not dead. While a probe is
pending the last answer stands, unless a fact contradicts it:

* the call raises one of Ray's death errors (``RayActorError``/``ActorDiedError``, a dead node,
  ``DeploymentUnavailableError``): the replica is gone;
* the probe has been pending for ``pending_check_s`` and Serve's controller reports no running
  replica of the group's deployment (it is being replaced, or it cannot be placed: its node is
  gone).

States (``/healthz``): ``starting`` (the group never answered yet: it is loading its model),
``degraded`` (a fact says its replica is gone, or the group itself reports a degraded worker
set), ``ok``, and for a group that scales to zero (``sleepers``) ``asleep``: Serve's controller
reports no running replica of it. An asleep group is ready (a request wakes it and is held
meanwhile, ``wake.WakeGate``) and is never probed: a status call queued at its handle would wake
it (Serve scales a deployment at zero up for any request), so its probe asks the controller
first, and a probe left pending when its replica went away is cancelled, not read as a death. New requests are refused (HTTP 503, Retry-After) only on a fact: the group's
replica is known gone or not running yet, or the group says it is starting. A group that simply
has not answered yet is not ready, but a request for it is forwarded (Serve holds it until a
replica runs). A request already accepted is never given up by the Router: it gets its answer,
or the error Ray raises when its replica dies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.serving.messages import GroupUnavailable

if TYPE_CHECKING:
    from xema_ray.serving.group.handle import GroupHandle

logger = logging.getLogger("xema_ray.serving")

#: pause between two probes of one group (a probe starts only once the previous one answered)
PROBE_INTERVAL_S = 1.0
#: a probe pending this long makes the Router ask Serve's controller whether the group still
#: has a running replica (the answer, not the wait, decides)
PENDING_CHECK_S = 0.5
#: how long /healthz waits for fresh answers before it reports what is known
HEALTHZ_FRESH_S = 1.0
#: longest wait for the controller's answer; without one nothing is concluded
CONTROLLER_TIMEOUT_S = 5.0
#: Retry-After of a 503 for a group that is starting or whose replica is being replaced
STARTING_RETRY_AFTER_S = 5

GroupState = Literal["starting", "degraded", "ok", "asleep"]
#: model name -> running replicas of its group's deployment (Serve's controller), or None: unknown
ReplicaCounter = Callable[[], Awaitable[dict[str, int] | None]]


def is_death(e: BaseException) -> bool:
    """Ray's word that the callee is gone: its actor or node died, or Serve has no deployment."""
    from ray.exceptions import ActorUnavailableError, NodeDiedError, OwnerDiedError, RayActorError, WorkerCrashedError
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(e, RayActorError | ActorUnavailableError | NodeDiedError | OwnerDiedError | WorkerCrashedError
                      | DeploymentUnavailableError)


class GroupReport(BaseModel):
    """One group in ``/healthz``: its state here, then the fields of its own last status answer
    (``queued``, ``running``, ``paused``, ``generation``, ...)."""

    model_config = ConfigDict(extra="allow")

    model: str
    status: GroupState = Field(description="starting | degraded | ok | asleep (scaled to zero: a request wakes it)")
    reason: str | None = Field(default=None, description="why it is not ok")
    accepting: bool = Field(description="new requests are admitted: refused only on a fact (its replica is gone or "
                                        "not running yet, or the group says it is starting)")
    answered_s_ago: float | None = Field(default=None, description="seconds since its last status answer")
    probe_pending_s: float | None = Field(default=None, description="seconds the current status call has waited")


class HealthResponse(BaseModel):
    """The body of ``/healthz`` (200 when ready, else 503 with Retry-After)."""

    status: GroupState = Field(description="ok when every group is; else starting or degraded")
    ready: bool = Field(description="every group can take a request")
    degraded: list[str] = Field(description="the groups that are not ok")
    groups: dict[str, GroupReport]
    plan_hardware: str


class _Group:
    """What is known of one group (mutated only on the event loop)."""

    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None  # the group's last status answer
        self.answered_at: float | None = None
        self.asked_at: float | None = None  # when the probe that gave ``last`` was sent
        self.gone: str | None = None  # a death fact since the last answer
        self.gone_at: float | None = None
        self.pending_since: float | None = None
        self.gone_event = asyncio.Event()  # set while a death fact stands (requests waiting on the group end)
        self.asleep = False  # a group that scales to zero: Serve's controller reports no running replica
        self.serving = asyncio.Event()  # set while its last answer says it serves (not starting, not asleep)


class GroupHealth:
    """Every model group's state, kept by background probes (``/healthz`` and request admission).

    Args:
        groups: model name -> its ModelGroup's handle (``status`` is what a probe calls).
        replica_counts: asks Serve's controller for the running replicas of every group (None:
            no such fact is consulted).
        interval_s: pause between two probes of one group.
        pending_check_s: a probe pending this long makes it consult ``replica_counts``.
        sleepers: the groups that scale to zero (``autoscaling.min_replicas: 0``).
    """

    def __init__(self, groups: Mapping[str, GroupHandle], replica_counts: ReplicaCounter | None = None,
                 interval_s: float = PROBE_INTERVAL_S, pending_check_s: float = PENDING_CHECK_S,
                 sleepers: frozenset[str] = frozenset()) -> None:
        self.groups = groups
        self.replica_counts = replica_counts
        self.sleepers = sleepers
        self.interval_s = interval_s
        self.pending_check_s = pending_check_s
        self._known = {m: _Group() for m in groups}
        self._tasks: dict[str, asyncio.Task] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._counts: tuple[float, dict[str, int] | None] | None = None  # (when, Serve's answer)
        self._counts_call: asyncio.Future | None = None
        self._counts_asked = 0.0  # when the current controller call was made

    # ------------------------------------------------------------------ facts
    def answered(self, model: str, status: dict[str, Any], asked_at: float | None = None) -> None:
        g = self._known[model]
        g.last, g.answered_at, g.gone, g.gone_at = status, time.monotonic(), None, None
        g.asked_at = g.answered_at if asked_at is None else asked_at
        g.gone_event.clear()
        g.asleep = False
        if str(status.get("status", "ok")) == "starting":
            g.serving.clear()
        else:
            g.serving.set()

    def fell_asleep(self, model: str) -> None:
        """A group that scales to zero has no running replica: asleep, not gone."""
        g = self._known[model]
        if not g.asleep:
            logger.info("%s: scaled to zero", model)
        g.asleep, g.gone, g.gone_at = True, None, None
        g.gone_event.clear()
        g.serving.clear()

    def serves(self, model: str) -> bool:
        """Whether ``model``'s group's last answer says it serves (not asleep, starting or gone)."""
        g = self._known[model]
        return g.serving.is_set() and g.gone is None

    def quiet(self, model: str) -> bool:
        """Whether ``model``'s group is not to be called but for a request: it scales to zero and does
        not serve now (asleep, or waking). Any call waiting at its handle makes Serve wake it, and
        waits for the wake: the stats and the console leave it out."""
        return model in self.sleepers and not self.serves(model)

    async def wait_serving(self, model: str) -> None:
        """Returns once ``model``'s group answers that it serves (a group waking from zero)."""
        await self._known[model].serving.wait()

    def died(self, model: str, reason: str) -> None:
        g = self._known[model]
        if g.gone is None:
            logger.warning("%s: %s", model, reason)
            g.gone_at = time.monotonic()
        g.gone = reason
        g.gone_event.set()
        g.serving.clear()

    async def wait_gone(self, model: str) -> str:
        """Returns (the reason) once a death fact about ``model``'s group stands: a request waiting
        on a group whose replica is gone, or cannot be placed because its node is gone, would
        otherwise wait in Serve's queue for a replica that may never come."""
        g = self._known[model]
        await g.gone_event.wait()
        return g.gone or "its replica is gone"

    # ------------------------------------------------------------------ probing
    def ensure_started(self) -> None:
        """Start the background probes (needs the running event loop, hence not in ``__init__``)."""
        for m in self.groups:
            task = self._tasks.get(m)
            if task is None or task.done():
                self._wake[m] = asyncio.Event()
                self._tasks[m] = asyncio.get_running_loop().create_task(self._probe_loop(m))

    async def fresh(self, wait_s: float) -> None:
        """Probe every group now (not at its next turn), ask Serve's controller at the same time,
        and wait up to ``wait_s`` for news of each group: an answer or a fact newer than this
        call. A group with neither keeps what is known of it."""
        self.ensure_started()
        start = time.monotonic()
        for e in self._wake.values():
            e.set()
        counts = asyncio.ensure_future(self._replica_counts(newer_than=start))

        def news(m: str) -> bool:
            # an answer counts only if its probe was sent after this call: under load the Router's
            # loop may read, after ``start``, an answer a replica gave just before it was killed
            g = self._known[m]
            return any(t is not None and t >= start for t in (g.asked_at, g.gone_at)) or g.gone is not None or g.asleep

        while not all(news(m) for m in self.groups) and time.monotonic() - start < wait_s:
            got = counts.result() if counts.done() else None
            for m in self.groups:  # a probe the handle holds, for a group Serve has no replica of
                if got is not None and got.get(m, 1) == 0 and self._known[m].pending_since is not None:
                    self._no_replica(m)
            await asyncio.sleep(0.02)

    def check(self) -> None:
        """Raise if a probe task ended (it only ends on a bug): Serve's ``check_health`` hook."""
        for m, task in self._tasks.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"{m}: the health probe died: {task.exception()!r}")

    async def _status(self, model: str) -> dict[str, Any]:
        return await self.groups[model].status()

    async def _probe_loop(self, model: str) -> None:
        wake = self._wake[model]
        while True:
            wake.clear()
            await self.probe_once(model)
            try:  # the next turn, or sooner when /healthz wants fresh news
                await asyncio.wait_for(wake.wait(), timeout=self.interval_s)
            except TimeoutError:
                pass

    async def probe_once(self, model: str) -> None:
        """One status call, waited for as long as it takes; while it waits, Serve's controller is
        asked (every ``pending_check_s``) whether the group still has a running replica."""
        g = self._known[model]
        if model in self.sleepers:  # asked now, not a cached answer: the group may have just scaled to zero
            counts = await self._replica_counts(newer_than=time.monotonic())
            if counts is not None and counts.get(model, 1) == 0:
                self.fell_asleep(model)  # not probed: a status call would wake it
                return
        g.pending_since = asked_at = time.monotonic()
        call = asyncio.ensure_future(self._status(model))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=self.pending_check_s)
                if done:
                    break
                await self._check_replicas(model)
                if self._known[model].asleep:
                    return  # its replica went away while asked (scaled to zero): the call is cancelled below
            try:
                self.answered(model, call.result(), asked_at)
            except Exception as e:
                if is_death(e):
                    self.died(model, f"its replica died ({type(e).__name__}); Serve is replacing it")
                else:  # a bug in status, not a fact about the group's life
                    logger.warning("%s: status failed: %s: %s", model, type(e).__name__, e)
        finally:
            g.pending_since = None
            if not call.done():
                call.cancel()

    async def _check_replicas(self, model: str) -> None:
        counts = await self._replica_counts()
        if counts is not None and counts.get(model, 1) == 0:
            self._no_replica(model)

    def _no_replica(self, model: str) -> None:
        if model in self.sleepers:
            self.fell_asleep(model)
            return
        self.died(model, "Serve reports no running replica of its group (starting, being replaced, or its node is gone)")

    async def _replica_counts(self, newer_than: float | None = None) -> dict[str, int] | None:
        """Serve's controller's answer, shared by every group's probe (at most one call at a time,
        reused for ``pending_check_s``, or only if asked after ``newer_than``); None when it does
        not answer: nothing is concluded."""
        if self.replica_counts is None:
            return None
        now = time.monotonic()
        if self._counts is not None and (self._counts[0] >= newer_than if newer_than is not None
                                         else now - self._counts[0] < self.pending_check_s):
            return self._counts[1]
        if self._counts_call is None or self._counts_call.done() or (
                newer_than is not None and self._counts_asked < newer_than):
            self._counts_asked = now
            self._counts_call = asyncio.ensure_future(asyncio.wait_for(self.replica_counts(),
                                                                       timeout=CONTROLLER_TIMEOUT_S))
        call, asked = self._counts_call, self._counts_asked
        try:
            counts = await asyncio.shield(call)
        except Exception:
            return None
        self._counts = (asked, counts)
        return counts

    # ------------------------------------------------------------------ reading
    def report(self, model: str) -> GroupReport:
        """``model``'s state: the facts first, then the group's own word."""
        g = self._known[model]

        def make(**fields: Any) -> GroupReport:
            return GroupReport(**{**(g.last or {}), **fields})

        now = time.monotonic()
        ago = None if g.answered_at is None else round(now - g.answered_at, 2)
        pending = None if g.pending_since is None else round(now - g.pending_since, 2)
        if g.gone is not None:
            state: GroupState = "degraded" if g.last is not None else "starting"
            return make(model=model, status=state, reason=g.gone, accepting=False, answered_s_ago=ago,
                               probe_pending_s=pending)
        if g.asleep:
            return make(model=model, status="asleep", reason="scaled to zero: the next request wakes it",
                        accepting=True, answered_s_ago=ago, probe_pending_s=pending)
        if g.last is None:
            # no fact yet: not ready, but a request is forwarded (Serve holds it until a replica is up)
            return make(model=model, status="starting", reason="no status answer yet (loading its model)",
                        accepting=True, probe_pending_s=pending)
        own = str(g.last.get("status", "ok"))
        if own == "starting":
            return make(model=model, status="starting", reason=g.last.get("reason") or "starting its workers",
                               accepting=False, answered_s_ago=ago, probe_pending_s=pending)
        state = "ok" if own == "ok" else "degraded"
        return make(model=model, status=state, reason=g.last.get("reason"), accepting=True,
                           answered_s_ago=ago, probe_pending_s=pending)

    def health(self, plan_hardware: str) -> HealthResponse:
        reports = {m: self.report(m) for m in sorted(self.groups)}
        not_ok = [m for m, r in reports.items() if r.status not in ("ok", "asleep")]  # asleep: a request wakes it
        if not not_ok:
            status: GroupState = "ok"
        elif any(reports[m].status == "degraded" for m in not_ok):
            status = "degraded"
        else:
            status = "starting"
        return HealthResponse(status=status, ready=not not_ok, degraded=not_ok, groups=reports,
                              plan_hardware=plan_hardware)

    def admit(self, model: str) -> None:
        """Raise ``GroupUnavailable`` (HTTP 503) if ``model``'s group cannot take a request now."""
        r = self.report(model)
        if not r.accepting:
            raise GroupUnavailable(f"{model}: its model group is {r.status}: {r.reason}; retry later")


async def serve_replica_counts(app_name: str, deployments: Mapping[str, str]) -> dict[str, int] | None:
    """Running replicas of the deployment that runs each model's group (``deployments``: model ->
    ``ModelGroup:<model>``, or the ``SharedReplica`` holding it) in ``app_name``, as Serve's controller
    reports them (``serve.status()``, in a thread: it blocks)."""
    from ray import serve

    status = await asyncio.to_thread(serve.status)
    app = status.applications.get(app_name)
    if app is None:
        return None
    out = {}
    for m, name in deployments.items():
        d = app.deployments.get(name)
        if d is not None:
            out[m] = sum(n for state, n in d.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")
    return out
