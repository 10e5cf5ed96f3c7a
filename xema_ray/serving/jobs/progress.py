"""The step observer a model group hands its workers for a batch that contains jobs.

It travels to the worker with the batch (Ray pickles it) and reaches the job store from there:
after every denoising step it hands each job's progress — the fraction of the job's predicted
time done — to the worker process's ``ProgressPublisher`` and asks it which jobs were deleted.
A deleted job stops counting at once; when every member of the batch is deleted (and no
synchronous request shares it) the observer stops the batch, which frees the workers at that
step boundary (``xema_ray.runtime.progress``).

The denoising loop never makes a store call: the publisher is a thread of its own that writes
the latest progress of each job (coalesced: a job's newer step replaces the older one not yet
written; at most ``MAX_PENDING`` jobs waiting, the oldest dropped beyond) and polls the watched
jobs for deletions every ``POLL_S``. After handing over a step, the observer gives the thread up
to ``SYNC_WAIT_S`` to write it and read deletions — with a healthy store that takes a few
milliseconds, so a DELETE is honoured at the next step as before — and stops waiting at all once
a round overran it, until the store answers again: a stalled store costs one such wait, never a
step per store timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xema_ray.serving.jobs.store import JobStoreConfig, open_store

if TYPE_CHECKING:
    from xema_ray.runtime.engine import PhaseTimings
    from xema_ray.profiling.phases import PhaseShares

logger = logging.getLogger("xema_ray.serving")

#: jobs whose progress may wait for the store at once (the oldest is dropped beyond: a later step
#: of it, or its completion, is written anyway)
MAX_PENDING = 1024
#: how often the publisher asks the store which watched jobs were deleted
POLL_S = 0.025
#: longest a step waits for its progress to be written (only while the store keeps up)
SYNC_WAIT_S = 0.05


@dataclass(frozen=True)
class PhaseEstimate:
    """Predicted seconds of a template's batch, by phase (``xema_ray.vocabulary.Phase``: text,
    denoise per step, decode, encode); ``progress`` is measured against it."""

    steps: int
    text_s: float
    denoise_step_s: float
    decode_s: float
    encode_s: float

    @property
    def total_s(self) -> float:
        return self.text_s + self.steps * self.denoise_step_s + self.decode_s + self.encode_s

    def after_step(self, step: int) -> float:
        return (self.text_s + min(step, self.steps) * self.denoise_step_s) / self.total_s

    def after_decode(self) -> float:
        return (self.total_s - self.encode_s) / self.total_s

    @classmethod
    def from_plan(cls, steps: int, latency_s: float, video: bool) -> PhaseEstimate:
        """Before any batch ran, where the plan table's hardware split is not known: the plan's
        predicted latency split by ``phases.fallback_shares`` (10 % decode for videos, 5 % for
        images); measured batches replace it (``from_timings``)."""
        from xema_ray.profiling.phases import fallback_shares

        return cls.from_shares(steps, latency_s, fallback_shares(video))

    @classmethod
    def from_shares(cls, steps: int, latency_s: float, shares: PhaseShares) -> PhaseEstimate:
        """Before any batch ran: the plan's predicted latency split as the plan table's hardware
        splits it (``xema_ray.profiling.phases``, the split the simulator uses too)."""
        latency_s = max(latency_s, 1e-3)
        return cls(steps=steps, text_s=shares.text * latency_s, denoise_step_s=shares.denoise * latency_s / steps,
                   decode_s=shares.decode_encode * latency_s, encode_s=0.0)

    @classmethod
    def from_timings(cls, steps: int, t: PhaseTimings) -> PhaseEstimate:
        """A measured batch's phases (set-up time outside the phases counts as text encoding)."""
        rest = max(0.0, t.total_s - t.denoise_s - t.decode_s - t.encode_s)
        return cls(steps=steps, text_s=rest, denoise_step_s=max(t.denoise_s / steps, 1e-6), decode_s=t.decode_s,
                   encode_s=t.encode_s)


class ProgressPublisher:
    """Writes job progress and reads deletions for one store, off the caller's thread.

    ``publish`` and ``cancelled`` only touch memory under a lock; a daemon thread does the
    store calls. One per worker process and store config (``publisher_for``).

    Args:
        store: the job store's config (the thread opens its own client).
    """

    def __init__(self, store: JobStoreConfig) -> None:
        self.store_cfg = store
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._stops: dict[str, int] = {}
        self._watched: dict[str, int] = {}  # job -> observers watching it
        self._cancelled: set[str] = set()
        self._wake = threading.Event()
        self._rounds = threading.Condition(self._lock)
        self._requested = 0  # publish calls so far
        self._written = 0  # publish calls whose updates (and a deletion poll after them) reached the store
        self._healthy = True  # the last round finished within SYNC_WAIT_S
        self.dropped = 0  # progress updates dropped because the buffer was full
        self.failures = 0  # store calls that failed (the thread retries)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="xema-progress", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side (no I/O)
    def watch(self, job_ids: list[str]) -> None:
        with self._lock:
            for j in job_ids:
                self._watched[j] = self._watched.get(j, 0) + 1
        self._wake.set()

    def unwatch(self, job_ids: list[str]) -> None:
        with self._lock:
            for j in job_ids:
                n = self._watched.get(j, 0) - 1
                if n <= 0:
                    self._watched.pop(j, None)
                    self._cancelled.discard(j)
                else:
                    self._watched[j] = n

    def publish(self, job_ids: list[str], fraction: float, step: int) -> int:
        """Queue the jobs' progress; returns a ticket for ``wait_written``."""
        with self._lock:
            self._requested += 1
            ticket = self._requested
            for j in job_ids:
                self._pending.pop(j, None)
                self._pending[j] = (fraction, step)
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
                self.dropped += 1
        self._wake.set()
        return ticket

    def wait_written(self, ticket: int, timeout: float = SYNC_WAIT_S) -> bool:
        """Wait (at most ``timeout``, and not at all while the store lags) until the updates of
        ``ticket`` are written and deletions read after them."""
        with self._rounds:
            if not self._healthy:
                return self._written >= ticket
            done = self._rounds.wait_for(lambda: self._written >= ticket, timeout=timeout)
            if not done:
                self._healthy = False
            return done

    def stopped(self, job_id: str, step: int) -> None:
        with self._lock:
            self._stops[job_id] = step
        self._wake.set()

    def cancelled(self, job_ids: list[str]) -> set[str]:
        """Which of ``job_ids`` the store said were deleted (as of the last poll)."""
        with self._lock:
            return {j for j in job_ids if j in self._cancelled}

    def idle(self) -> bool:
        """Nothing waits to be written (for tests and drains)."""
        with self._lock:
            return not self._pending and not self._stops

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (what it has not written is dropped): ``close_publisher``."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(timeout=POLL_S)
            self._wake.clear()
            if self._closed:
                return
            with self._lock:
                pending, self._pending = self._pending, OrderedDict()
                stops, self._stops = self._stops, {}
                watched = [j for j in self._watched if j not in self._cancelled]
                round_of = self._requested
            if not (pending or stops or watched):
                continue
            try:
                store = open_store(self.store_cfg)
                for j in list(pending):
                    store.set_progress(j, *pending[j])
                    del pending[j]  # written: nothing to put back for it
                for j in list(stops):
                    store.stopped(j, stops[j])
                    del stops[j]
                gone = store.cancelled(watched) if watched else set()
            except Exception as e:  # the store is slow or down: keep what was not written, retry
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    logger.warning("job progress not written (%s: %s); retrying", type(e).__name__, e)
                with self._lock:
                    for j, v in pending.items():
                        self._pending.setdefault(j, v)
                    for j, v in stops.items():
                        self._stops.setdefault(j, v)
                time.sleep(POLL_S)
                continue
            with self._rounds:
                self._cancelled |= {j for j in gone if j in self._watched}
                self._written = max(self._written, round_of)
                self._healthy = True
                self._rounds.notify_all()


_publishers: dict[str, ProgressPublisher] = {}
_publishers_lock = threading.Lock()


def publisher_for(store: JobStoreConfig) -> ProgressPublisher:
    """This process's publisher for ``store`` (started on first use)."""
    key = store.model_dump_json()
    with _publishers_lock:
        if key not in _publishers:
            _publishers[key] = ProgressPublisher(store)
        return _publishers[key]


def close_publisher(store: JobStoreConfig) -> None:
    """Stop and forget this process's publisher for ``store``, if it has one (a store that went
    away for good; a test that pointed one at nothing, so that its retries end with it)."""
    with _publishers_lock:
        pub = _publishers.pop(store.model_dump_json(), None)
    if pub is not None:
        pub.close()


class JobProgress:
    """``StepObserver`` for the jobs of one batch.

    Args:
        store: the job store's config (the worker's ``ProgressPublisher`` reaches it).
        job_ids: the batch's jobs.
        others: members that are not jobs (synchronous requests); a batch with any never stops.
        estimate: the predicted phases progress is measured against.
        bases: a re-run's (its batch ran again without a request that failed it): the progress each
            job had reached; this run's fraction maps onto what is left above it, so that progress
            never goes back. None: a first run.
    """

    def __init__(self, store: JobStoreConfig, job_ids: list[str], others: int, estimate: PhaseEstimate,
                 bases: dict[str, float] | None = None) -> None:
        self.store_cfg = store
        self.live = list(job_ids)
        self.others = others
        self.estimate = estimate
        self.bases = dict(bases or {})
        self._watching = False

    def _publish(self, pub: ProgressPublisher, fraction: float, step: int) -> int:
        """Each live job's progress at this run's ``fraction`` (above its base); the last ticket."""
        by_base: dict[float, list[str]] = {}
        for j in self.live:
            by_base.setdefault(self.bases.get(j, 0.0), []).append(j)
        ticket = 0
        for base, jobs in by_base.items():
            ticket = pub.publish(jobs, base + (1.0 - base) * fraction, step)
        return ticket

    def _publisher(self) -> ProgressPublisher:
        pub = publisher_for(self.store_cfg)
        if not self._watching:
            pub.watch(self.live)
            self._watching = True
        return pub

    def on_step(self, step: int, total: int) -> bool:
        pub = self._publisher()
        # progress first, then the deletions: a DELETE that lands in between sees this step done
        # and is honoured now (while the store keeps up), so a job runs at most a step past it
        pub.wait_written(self._publish(pub, self.estimate.after_step(step), step))
        self._drop_deleted(pub, step)
        return not self.live and self.others == 0

    def on_decoded(self) -> None:
        pub = self._publisher()
        self._drop_deleted(pub, self.estimate.steps)
        self._publish(pub, self.estimate.after_decode(), self.estimate.steps)
        pub.unwatch(self.live)

    def on_failed(self) -> None:
        """The batch ended without output (it failed, or was stopped): its jobs are no longer
        watched for deletions here (a re-run's observer watches them again)."""
        if self._watching:
            publisher_for(self.store_cfg).unwatch(self.live)
            self._watching = False

    def _drop_deleted(self, pub: ProgressPublisher, step: int) -> None:
        gone = pub.cancelled(self.live)
        for j in gone:
            pub.stopped(j, step)
        if gone:
            pub.unwatch(sorted(gone))
        self.live = [j for j in self.live if j not in gone]
