"""Load metrics a router or an autoscaler outside the app can act on, per model group replica,
exported through Ray Serve's Prometheus endpoint (``ray.serve.metrics``; docs/metrics.md has the
table: names, types, tags, how each is meant to be used).

* what the dispatcher predicts: the queue wait and completion of one more request per template,
  and the attainment of the next window's requests — the replay of the dispatcher's own policy on
  the replica's summary (``replica_summary.probe`` / ``predict_attainment``), the same
  numbers the app's own request router and autoscaler decide on, not a second estimate;
* what happened: SLO attainment over the last ``window_s`` seconds (at most ``window_requests``
  requests) per template, measured seconds per denoising step, the realtime factor of video
  templates (seconds of video per second of batch), running and paused batches;
* device memory per worker against the plan: the last batch's peak and in-use bytes, the budget
  each worker's plans were made for, and the headroom between them.

Every gauge of the group is sent again each ``REFRESH_S`` (``KeptGauge``: Ray drops a gauge
series not set for ~20 s). Tags stay low-cardinality: ``model`` and ``template`` (the configured templates' shape keys) and
``worker`` (the worker's index in its group, 0 .. workers-1); Serve adds its deployment, replica
and application tags. Values are recomputed at most every ``MIN_REFRESH_S`` after a change
(``changed``: a request queued or a batch ended) and every ``REFRESH_S`` regardless, so that the
window's attainment and the predictions age while nothing happens.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field
from ray.serve import metrics

from xema_ray.plan import PlanEntry
from xema_ray.serving.frame_rate import video_fps
from xema_ray.serving.scale.replica_summary import ReplicaSummary, predict_attainment, probe

if TYPE_CHECKING:  # a type only: the Router's console reads this module, and its process runs no model
    from xema_ray.runtime.engine import BatchResult

logger = logging.getLogger("xema_ray.serving")

#: seconds between refreshes while nothing changes (the window ages, the predictions with it)
REFRESH_S = 1.0
#: shortest time between two refreshes (a burst of submissions costs one replay per interval)
MIN_REFRESH_S = 0.1
#: the predicted attainment's look-ahead, as the autoscaler's default (``AutoscalingSpec.window_s``)
PREDICTION_WINDOW_S = 60.0


class KeptGauge:
    """A Serve gauge that keeps its last value per tag set and sends it again on ``republish``.

    Seen on Ray 2.60 (Serve replicas, ``metrics_report_interval_ms`` 500): a gauge series that is
    not set again leaves the Prometheus endpoint about 20 s after its last value — a plan's peak
    set once at start-up, the last batch's size on an idle group — while counters stay. The group
    republishes its gauges every second (``LoadMetrics``), so a figure stays until it changes.

    Example:
        >>> g = KeptGauge("xema_doc_example", "an example", ("template", "model"), {"model": "m"})
        >>> g.set(3.0, tags={"template": "t"}); g.last()
        {(('template', 't'),): 3.0}
    """

    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...], default_tags: dict[str, str]) -> None:
        self._gauge = metrics.Gauge(name, description, tag_keys=tag_keys)
        self._gauge.set_default_tags(dict(default_tags))  # Serve adds keys to the dict it gets
        self._last: dict[tuple[tuple[str, str], ...], tuple[float, dict[str, str] | None]] = {}

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._last[tuple(sorted((tags or {}).items()))] = (value, tags)
        self._gauge.set(value, tags=tags)

    def republish(self) -> None:
        for value, tags in list(self._last.values()):
            self._gauge.set(value, tags=tags)

    def last(self) -> dict[tuple[tuple[str, str], ...], float]:
        """The last value of each tag set."""
        return {k: v for k, (v, _) in self._last.items()}


class SloWindow:
    """Requests that met or missed their SLO over the last ``window_s`` seconds, at most the last
    ``max_requests`` per template: attainment as it is now, not since start-up.

    Example:
        >>> w = SloWindow(window_s=10.0, max_requests=100)
        >>> w.add("t", now=0.0, met=True); w.add("t", now=5.0, met=False)
        >>> w.attainment("t", now=6.0), w.attainment("t", now=12.0), w.attainment("t", now=20.0)
        ((1, 2), (0, 1), (0, 0))
    """

    def __init__(self, window_s: float = 60.0, max_requests: int = 1000) -> None:
        if window_s <= 0 or max_requests < 1:
            raise ValueError(f"window_s must be > 0 and max_requests >= 1, got {window_s} and {max_requests}")
        self.window_s = window_s
        self.max_requests = max_requests
        self._done: dict[str, collections.deque[tuple[float, bool]]] = {}

    def add(self, template: str, now: float, met: bool) -> None:
        q = self._done.setdefault(template, collections.deque(maxlen=self.max_requests))
        q.append((now, met))

    def attainment(self, template: str, now: float) -> tuple[int, int]:
        """(met, finished) for ``template`` within the window ending at ``now``."""
        q = self._done.get(template)
        if q is None:
            return 0, 0
        while q and q[0][0] < now - self.window_s:
            q.popleft()
        return sum(met for _, met in q), len(q)

    def templates(self) -> list[str]:
        return list(self._done)


def realtime_factor(video_s: float, requests: int, batch_seconds: float) -> float:
    """Seconds of video a batch made per second it ran (``requests`` videos of ``video_s`` each).

    Example:
        >>> realtime_factor(6.0, 2, 4.0)
        3.0
    """
    if batch_seconds <= 0:
        raise ValueError(f"batch_seconds must be positive, got {batch_seconds}")
    return video_s * requests / batch_seconds


class TemplateLoad(BaseModel):
    """One template's load figures (as on the Prometheus endpoint; None: not recorded yet)."""

    predicted_queue_wait_s: float | None = None
    predicted_completion_s: float | None = None
    slo_attainment: float | None = None
    slo_window_requests: int | None = None
    step_seconds: float | None = None
    video_realtime_factor: float | None = None
    plan_peak_bytes: int | None = None
    window_met: int = Field(default=0, ge=0, description="requests finished within the attainment window that "
                                                          "met their SLO (counted when the answer was made)")
    window_finished: int = Field(default=0, ge=0, description="requests finished within the attainment window: "
                                                               "synchronous and video jobs; failed and shed count")


class WorkerMemory(BaseModel):
    """One worker's memory after its last batch, against the plans' budget."""

    peak_bytes: int
    in_use_bytes: int | None = None
    headroom_bytes: int | None = Field(default=None, description="budget - peak (None: no budget known)")


class GroupLoad(BaseModel):
    """A replica's load figures in one typed answer (``ModelGroup.load_stats``: the same numbers
    its gauges carry, for JSON readers such as the operator view)."""

    model: str
    replica: str | None = Field(default=None, description="the replica that answered (its job-store owner id)")
    window_s: float = Field(default=60.0, gt=0, description="the attainment window (seconds)")
    predicted_attainment: float | None = None
    budget_bytes: int | None = None
    running_batches: int = 0
    paused_batches: int = 0
    templates: dict[str, TemplateLoad] = Field(default_factory=dict)
    workers: dict[int, WorkerMemory] = Field(default_factory=dict)


class LoadMetrics:
    """The load metrics of one model group replica (see the module docstring).

    Args:
        model: the group's model.
        plans: the plans served now: template shape key -> its plan entry (predicted peak, steps,
            frames), and the device memory per worker they were made for (None: not known; no
            headroom is exported then); read at every refresh (a new plan table is taken up).
        window_s / window_requests: the attainment window.
        keep: other gauges of the group to republish with these (``ServingMetrics.gauges``).
        summary: the replica's summary now (``SummaryPublisher.summary``), refreshed from on the
            running loop (``start``; None: ``refresh`` is called by hand, as in tests).
    """

    def __init__(self, model: str, plans: Callable[[], tuple[Mapping[str, PlanEntry], int | None]],
                 window_s: float = 60.0, window_requests: int = 1000, keep: Sequence[KeptGauge] = (),
                 summary: Callable[[], ReplicaSummary] | None = None) -> None:
        self.model = model
        self.window = SloWindow(window_s, window_requests)
        tags = ("template", "model")
        self._kept: list[KeptGauge] = list(keep)

        def gauge(name: str, doc: str, keys: tuple[str, ...] = tags) -> KeptGauge:
            g = KeptGauge(name, doc, keys, {"model": model})
            self._kept.append(g)
            return g

        self.queue_wait = gauge("xema_predicted_queue_wait_s", "predicted seconds one more request would wait to start")
        self.completion = gauge("xema_predicted_completion_s", "predicted seconds until one more request would finish")
        self.predicted_attainment = gauge("xema_predicted_attainment", "predicted SLO attainment of the queued and "
                                          "next window's requests", ("model",))
        self.attainment = gauge("xema_slo_attainment", "fraction of the window's finished requests that met their SLO")
        self.window_requests = gauge("xema_slo_window_requests", "requests finished within the attainment window")
        self.step_seconds = gauge("xema_step_seconds", "seconds per denoising step of the last batch")
        self.realtime = gauge("xema_video_realtime_factor", "seconds of video per second of batch time (last batch)")
        self.plan_peak = gauge("xema_plan_peak_bytes", "the plan's predicted device memory peak per worker")
        self.budget = gauge("xema_device_budget_bytes", "device memory per worker the plans were made for", ("model",))
        self.peak = gauge("xema_device_peak_bytes", "device memory peak of the worker's last batch", ("worker", "model"))
        self.in_use = gauge("xema_device_in_use_bytes", "device memory in use after the worker's last batch",
                            ("worker", "model"))
        self.headroom = gauge("xema_device_headroom_bytes", "budget minus the worker's last batch peak",
                              ("worker", "model"))
        self.running = gauge("xema_running_batches", "batches running now", ("model",))
        self.paused = gauge("xema_paused_batches", "batches paused at a step boundary now", ("model",))
        self._entries: dict[str, PlanEntry] = {}
        self._budget: int | None = None
        self._peaks: dict[int, int] = {}
        self._plans = plans
        self._plans_seen: tuple[int, int | None] = (0, None)
        self._take_plans()
        self._changed = True
        self._last = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._summary = summary
        if summary is not None:
            self.start()

    def _take_plans(self) -> None:
        entries, budget = self._plans()
        if (id(entries), budget) != self._plans_seen:
            self._plans_seen = (id(entries), budget)
            self.set_plans(entries, budget)

    def set_plans(self, entries: Mapping[str, PlanEntry], budget_bytes: int | None) -> None:
        """The plans served (at start and after a plan swap): their predicted peaks and budget."""
        self._entries = dict(entries)
        self._budget = budget_bytes
        for key, e in self._entries.items():
            self.plan_peak.set(float(e.prediction.peak_bytes), tags={"template": key})
        if budget_bytes is not None:
            self.budget.set(float(budget_bytes))
            for w, peak in self._peaks.items():
                self.headroom.set(float(budget_bytes - peak), tags={"worker": str(w)})

    # ------------------------------------------------------------------ what happened
    def observe_request(self, template: str, met: bool, now: float | None = None) -> None:
        self.window.add(template, time.monotonic() if now is None else now, met)
        self._changed = True

    def observe_missed(self, template: str, n: int = 1) -> None:
        """``n`` requests of ``template`` failed or were shed: missed, as the planner counts them."""
        now = time.monotonic()
        for _ in range(n):
            self.window.add(template, now, False)
        self._changed = True

    def observe_batch(self, template: str, workers: Sequence[int], results: Sequence[BatchResult],
                      requests: int, batch_seconds: float, steps: int) -> None:
        """A (sub-)batch of ``requests`` ran on ``workers`` (ranks in SP order) in ``batch_seconds``
        with ``steps`` denoising steps; ``results`` has one per rank (its memory and timings)."""
        t = {"template": template}
        entry = self._entries.get(template)
        for r in results:
            if not 0 <= r.sp_rank < len(workers):
                continue
            w = workers[r.sp_rank]
            self._peaks[w] = r.memory.peak_bytes
            wt = {"worker": str(w)}
            self.peak.set(float(r.memory.peak_bytes), tags=wt)
            self.in_use.set(float(r.memory.current_bytes), tags=wt)
            if self._budget is not None:
                self.headroom.set(float(self._budget - r.memory.peak_bytes), tags=wt)
        lead = next((r for r in results if r.sp_rank == 0), None)
        if entry is None or lead is None:
            return
        tpl = entry.config.template
        self.step_seconds.set(lead.timings.denoise_s / steps, tags=t)
        if tpl.spec.kind == "video" and batch_seconds > 0:
            self.realtime.set(realtime_factor((tpl.frames - 1) / video_fps(tpl), requests, batch_seconds), tags=t)
        self._changed = True

    def snapshot(self, now: float | None = None) -> GroupLoad:
        """The figures last set, as one typed answer; the attainment window's counts as of ``now``
        (monotonic; None: now)."""
        def by(g: KeptGauge, key: str) -> dict[str, float]:
            return {dict(k)[key]: v for k, v in g.last().items() if key in dict(k)}

        def one(g: KeptGauge) -> float | None:
            return next(iter(g.last().values()), None)

        per = {name: by(g, "template") for name, g in (
            ("predicted_queue_wait_s", self.queue_wait), ("predicted_completion_s", self.completion),
            ("slo_attainment", self.attainment), ("slo_window_requests", self.window_requests),
            ("step_seconds", self.step_seconds), ("video_realtime_factor", self.realtime),
            ("plan_peak_bytes", self.plan_peak))}
        now = time.monotonic() if now is None else now
        counts = {k: self.window.attainment(k, now) for k in self.window.templates()}
        keys = sorted({k for values in per.values() for k in values} | set(counts))
        peaks, in_use, headroom = by(self.peak, "worker"), by(self.in_use, "worker"), by(self.headroom, "worker")
        running, paused = one(self.running), one(self.paused)
        return GroupLoad(
            model=self.model, window_s=self.window.window_s, predicted_attainment=one(self.predicted_attainment),
            budget_bytes=self._budget, running_batches=int(running or 0), paused_batches=int(paused or 0),
            templates={k: TemplateLoad(**{name: values[k] for name, values in per.items() if k in values},
                                       window_met=counts.get(k, (0, 0))[0], window_finished=counts.get(k, (0, 0))[1])
                       for k in keys},
            workers={int(w): WorkerMemory(peak_bytes=int(p), in_use_bytes=int(in_use[w]) if w in in_use else None,
                                          headroom_bytes=int(headroom[w]) if w in headroom else None)
                     for w, p in peaks.items()})

    # ------------------------------------------------------------------ predictions
    def changed(self) -> None:
        """A request was queued or a batch ended: refresh within ``MIN_REFRESH_S``."""
        self._changed = True

    def refresh(self, summary: ReplicaSummary, now: float | None = None) -> None:
        """Recompute the predictions and the window's attainment from ``summary`` (taken at the
        monotonic time ``now``)."""
        now = time.monotonic() if now is None else now
        self._take_plans()
        wall = summary.t
        for key in summary.plans:
            t = {"template": key}
            o = probe(summary, key, wall)  # ``predict_wait`` and ``predict_completion`` in one replay
            if o.start is not None:  # a draining replica takes nothing: its last figures stand
                self.queue_wait.set(max(0.0, o.start), tags=t)
                self.completion.set(o.completion, tags=t)
        for key in {*summary.plans, *self.window.templates()}:
            met, total = self.window.attainment(key, now)
            self.attainment.set(met / total if total else 1.0, tags={"template": key})
            self.window_requests.set(float(total), tags={"template": key})
        self.predicted_attainment.set(predict_attainment(summary, PREDICTION_WINDOW_S, running=False).fraction)
        self.running.set(float(sum(not b.paused for b in summary.running)))
        self.paused.set(float(sum(b.paused for b in summary.running)))
        self._changed = False
        self._last = now

    def due(self, now: float) -> bool:
        return now - self._last >= (MIN_REFRESH_S if self._changed else REFRESH_S)

    def start(self) -> bool:
        """Refresh from the summary on the running event loop from now on (once). False: no loop
        runs in this thread (a group built outside one, as in tests): call again from the loop."""
        if self._summary is None:
            raise ValueError(f"{self.model}: LoadMetrics was made without a summary to refresh from")
        if self._task is None:
            try:
                self._task = asyncio.get_running_loop().create_task(self._loop(self._summary))
            except RuntimeError:
                return False
        return True

    async def _loop(self, summary: Callable[[], ReplicaSummary]) -> None:
        while True:
            if self.due(time.monotonic()):
                try:
                    self.refresh(summary())
                    for g in self._kept:  # figures that did not change stay on the endpoint (``KeptGauge``)
                        g.republish()
                except Exception:  # a bug here must not stop the figures for good, nor go unseen
                    logger.exception("%s: refreshing the load metrics failed", self.model)
                    self._last = time.monotonic()
            await asyncio.sleep(MIN_REFRESH_S)
