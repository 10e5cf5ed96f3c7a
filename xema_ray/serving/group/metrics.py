"""Serving metrics, exported through Ray Serve's Prometheus endpoint (``ray.serve.metrics``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ray.serve import metrics

from xema_ray.serving.group.load_metrics import KeptGauge, LoadMetrics

if TYPE_CHECKING:
    from xema_ray.plan import PlanEntry
    from xema_ray.runtime.engine import BatchResult
    from xema_ray.serving.scale.replica_summary import ReplicaSummary

logger = logging.getLogger("xema_ray.serving")

_LATENCY_BOUNDS = [0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640]


class ServingMetrics:
    """Per model group: requests, latency, queue depth, batch size, SLO met/missed, memory peak per
    batch and the static allocator's fallback allocations, tagged by template; and ``load``, the
    figures for routers and autoscalers (``LoadMetrics``: ``plans`` and ``summary`` are its own).
    """

    def __init__(self, model: str, plans: Callable[[], tuple[Mapping[str, PlanEntry], int | None]] = lambda: ({}, None),
                 summary: Callable[[], ReplicaSummary] | None = None) -> None:
        tags = ("template",)
        self.requests = metrics.Counter("xema_requests", "requests completed", tag_keys=(*tags, "model", "quality"))
        self.requests.set_default_tags({"model": model, "quality": "lossless"})  # Serve adds keys to the dict it gets
        self.slo_met = metrics.Counter("xema_slo_met", "requests finished within their SLO",
                                     tag_keys=(*tags, "model", "quality"))
        self.slo_met.set_default_tags({"model": model, "quality": "lossless"})
        self.slo_missed = metrics.Counter("xema_slo_missed", "requests finished after their SLO", tag_keys=(*tags, "model", "quality"))
        self.slo_missed.set_default_tags({"model": model, "quality": "lossless"})
        self.failed = metrics.Counter("xema_requests_failed", "requests that failed after retry", tag_keys=(*tags, "model"))
        self.failed.set_default_tags({"model": model})
        self.rejected = metrics.Counter("xema_requests_rejected", "requests refused: queue full", tag_keys=(*tags, "model"))
        self.rejected.set_default_tags({"model": model})
        self.retries = metrics.Counter("xema_batch_retries", "batches retried after a worker failure", tag_keys=(*tags, "model"))
        self.retries.set_default_tags({"model": model})
        self.reruns = metrics.Counter("xema_batch_reruns", "sub-batches run again without a request that failed them",
                                      tag_keys=(*tags, "model", "reason"))
        self.reruns.set_default_tags({"model": model})
        self.worker_restarts = metrics.Counter("xema_worker_set_restarts", "worker sets rebuilt", tag_keys=("model",))
        self.worker_restarts.set_default_tags({"model": model})
        self.latency = metrics.Histogram("xema_request_latency_s", "arrival to result", boundaries=_LATENCY_BOUNDS,
                                         tag_keys=(*tags, "model", "quality"))
        self.latency.set_default_tags({"model": model, "quality": "lossless"})
        self.batch_seconds = metrics.Histogram("xema_batch_seconds", "batch execution time", boundaries=_LATENCY_BOUNDS,
                                               tag_keys=(*tags, "model"))
        self.batch_seconds.set_default_tags({"model": model})
        own = {"model": model}
        self.queue_depth = KeptGauge("xema_queue_depth", "requests waiting", (*tags, "model"), own)
        self.batch_size = KeptGauge("xema_batch_size", "requests in the last batch", (*tags, "model"), own)
        self.peak_bytes = KeptGauge("xema_batch_peak_bytes", "device memory peak of the last batch", (*tags, "model"), own)
        self.residency_switches = metrics.Counter(
            "xema_residency_switches", "batches that first moved weights between host and device", tag_keys=(*tags, "model"))
        self.residency_switches.set_default_tags({"model": model})
        self.residency_bytes = metrics.Counter(
            "xema_residency_bytes_moved", "weight bytes moved by residency switches", tag_keys=(*tags, "model"))
        self.residency_bytes.set_default_tags({"model": model})
        self.host_weight_bytes = KeptGauge(
            "xema_host_weight_bytes", "weight bytes homed on pinned host memory per worker", (*tags, "model"), own)
        self.fallback_allocs = metrics.Counter("xema_allocator_fallbacks", "static-layout misses served dynamically",
                                               tag_keys=(*tags, "model"))
        self.fallback_allocs.set_default_tags({"model": model})
        self.layout_armed = metrics.Counter("xema_layout_armed_batches", "batches run with the static layout armed",
                                            tag_keys=(*tags, "model"))
        self.layout_armed.set_default_tags({"model": model})
        self.layout_hits = metrics.Counter("xema_layout_hits", "allocations the armed layout placed", tag_keys=(*tags, "model"))
        self.layout_hits.set_default_tags({"model": model})
        self.layout_reserved = KeptGauge("xema_layout_reserved_bytes", "bytes the static allocator holds (0: not armed)",
                                         (*tags, "model"), own)
        self.out_of_memory = metrics.Counter("xema_out_of_memory", "batches that failed out of device memory",
                                             tag_keys=(*tags, "model"))
        self.out_of_memory.set_default_tags({"model": model})

        self.preemptions = metrics.Counter("xema_preemptions", "batches paused at a step boundary for another",
                                           tag_keys=(*tags, "model"))
        self.preemptions.set_default_tags({"model": model})
        self.paused_bytes = KeptGauge("xema_paused_bytes", "between-step state paused batches hold now",
                                      (*tags, "model"), own)
        self.paused_seconds = metrics.Counter("xema_paused_seconds", "seconds batches spent paused",
                                              tag_keys=(*tags, "model"))
        self.paused_seconds.set_default_tags({"model": model})
        #: what ``LoadMetrics`` republishes every second (``KeptGauge``)
        gauges = (self.queue_depth, self.batch_size, self.peak_bytes, self.host_weight_bytes, self.layout_reserved,
                  self.paused_bytes)
        self.load = LoadMetrics(model, plans, keep=gauges, summary=summary)
        self.start_at_zero(list(plans()[0]))

    def start_at_zero(self, templates: Sequence[str]) -> None:
        """Export every counter (requests, SLO met and missed, failures, retries, re-runs, out of
        memory, preemptions, the static layout's and residency's counts) and ``xema_paused_bytes``
        at 0 for ``templates`` from
        start-up: a series that appears only at its first event hides that event from ``rate()`` and
        ``increase()``, and an alert on it fires a scrape late or never.

        Ray's ``Counter.inc`` refuses 0, so the zero goes through the metric's own record call with
        the tags Serve's ``inc`` adds (``_add_serve_context_tag_values``, ``_record``: Ray internals;
        a Ray without them leaves the counters to appear at their first event, as before)."""
        per_template = (self.requests, self.slo_met, self.slo_missed, self.failed, self.rejected, self.retries,
                        self.out_of_memory, self.preemptions,
                        self.paused_seconds, self.fallback_allocs, self.layout_armed, self.layout_hits,
                        self.residency_switches, self.residency_bytes)
        tagged: list[tuple[metrics.Counter, dict[str, str]]] = [
            (c, {"template": t}) for t in templates for c in per_template]
        tagged += [(self.reruns, {"template": t, "reason": r}) for t in templates for r in ("named", "split")]
        tagged.append((self.worker_restarts, {}))
        for t in templates:
            self.paused_bytes.set(0.0, tags={"template": t})
        try:
            from ray.serve.metrics import _add_serve_context_tag_values

            for counter, tags in tagged:
                _add_serve_context_tag_values(counter._tag_keys, tags)
                counter._record(0.0, tags=tags)
        except (ImportError, AttributeError, TypeError, ValueError) as e:  # another Ray: first event shows it
            logger.info("event counters start at their first event (%s: %s)", type(e).__name__, e)

    def observe_queued(self, template: str, depth: int) -> None:
        self.queue_depth.set(depth, tags={"template": template})
        self.load.changed()

    def observe_shed(self, template: str) -> None:
        self.rejected.inc(tags={"template": template})
        self.load.observe_missed(template)  # missed, as the planner counts a shed request

    def observe_failed(self, template: str, n: int) -> None:
        self.failed.inc(n, tags={"template": template})
        self.load.observe_missed(template, n)  # a failed request did not meet its SLO either

    def observe_pause(self, template: str, held_bytes: int) -> None:
        t = {"template": template}
        self.preemptions.inc(tags=t)
        self.paused_bytes.set(float(held_bytes), tags=t)

    def observe_resume(self, template: str, paused_s: float, held_bytes: int) -> None:
        t = {"template": template}
        self.paused_seconds.inc(paused_s, tags=t)
        self.paused_bytes.set(float(held_bytes), tags=t)

    def observe_request(self, template: str, latency_s: float, met: bool, quality: str = "lossless") -> None:
        """A request finished: its latency and SLO, labelled by template and the quality tier it ran at."""
        t = {"template": template, "quality": quality}
        self.requests.inc(tags=t)
        self.latency.observe(latency_s, tags=t)
        (self.slo_met if met else self.slo_missed).inc(tags=t)
        self.load.observe_request(template, met)

    def observe_batch(self, template: str, size: int, result: BatchResult, workers: Sequence[int] = (),
                      results: Sequence[BatchResult] = (), seconds: float = 0.0, *, steps: int) -> None:
        """A (sub-)batch of ``size`` ran: ``result`` its SP rank 0's; ``workers``, ``results`` (every
        rank's), ``seconds``, ``steps`` for the load figures (``LoadMetrics.observe_batch``)."""
        t = {"template": template}
        if results:
            self.load.observe_batch(template, workers, results, size, seconds, steps)
        self.batch_size.set(size, tags=t)
        self.peak_bytes.set(float(result.memory.peak_bytes), tags=t)
        self.host_weight_bytes.set(float(result.host_weight_bytes), tags=t)
        # the static allocator's counters: 0 where no layout is armed (CPU workers: /v1/stats says why)
        if result.layout_armed:  # Ray's Counter.inc refuses 0
            self.layout_armed.inc(tags=t)
        if result.layout_hits:
            self.layout_hits.inc(result.layout_hits, tags=t)
        if result.layout_misses:
            self.fallback_allocs.inc(result.layout_misses, tags=t)
        self.layout_reserved.set(float(result.layout_reserved_bytes), tags=t)
        if result.residency_bytes_moved:
            self.residency_switches.inc(tags=t)
            self.residency_bytes.inc(result.residency_bytes_moved, tags=t)
