"""The step observer a model group hands its workers for a batch that contains jobs.

It travels to the worker with the batch (Ray pickles it) and reaches the job store from there:
after every denoising step it writes each job's progress — the fraction of the job's predicted
time done — and reads which jobs were deleted. A deleted job stops counting at once; when every
member of the batch is deleted (and no synchronous request shares it) the observer stops the
batch, which frees the workers at that step boundary (``xema_ray.runtime.progress``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from xema_ray.runtime.engine import PhaseTimings
from xema_ray.serving.jobs import JobStore, JobStoreConfig, open_store

logger = logging.getLogger("xema_ray.serving")


@dataclass(frozen=True)
class PhaseEstimate:
    """Predicted seconds of a template's batch, by phase (``progress`` is measured against it)."""

    steps: int
    text_s: float
    step_s: float
    decode_s: float
    encode_s: float

    @property
    def total_s(self) -> float:
        return self.text_s + self.steps * self.step_s + self.decode_s + self.encode_s

    def after_step(self, step: int) -> float:
        return (self.text_s + min(step, self.steps) * self.step_s) / self.total_s

    def after_decode(self) -> float:
        return (self.total_s - self.encode_s) / self.total_s

    @classmethod
    def from_plan(cls, steps: int, latency_s: float, video: bool) -> PhaseEstimate:
        """Before any batch ran: the plan's predicted latency, 10 % of it (5 % for images) for the
        decoders and the rest for the steps; measured batches replace it (``from_timings``)."""
        latency_s = max(latency_s, 1e-3)
        decode = (0.10 if video else 0.05) * latency_s
        return cls(steps=steps, text_s=0.0, step_s=(latency_s - decode) / steps, decode_s=decode, encode_s=0.0)

    @classmethod
    def from_timings(cls, steps: int, t: PhaseTimings) -> PhaseEstimate:
        """A measured batch's phases (set-up time outside the phases counts as text encoding)."""
        rest = max(0.0, t.total_s - t.denoise_s - t.decode_s - t.encode_s)
        return cls(steps=steps, text_s=rest, step_s=max(t.denoise_s / steps, 1e-6), decode_s=t.decode_s,
                   encode_s=t.encode_s)


class JobProgress:
    """``StepObserver`` for the jobs of one batch.

    Args:
        store: the job store's config (the worker opens its own client).
        job_ids: the batch's jobs.
        others: members that are not jobs (synchronous requests); a batch with any never stops.
        estimate: the predicted phases progress is measured against.
    """

    def __init__(self, store: JobStoreConfig, job_ids: list[str], others: int, estimate: PhaseEstimate) -> None:
        self.store_cfg = store
        self.live = list(job_ids)
        self.others = others
        self.estimate = estimate

    def on_step(self, step: int, total: int) -> bool:
        try:
            store = open_store(self.store_cfg)
            # progress first, then the deletions: a DELETE that lands in between sees this step
            # done and is honoured now, so a job never runs more than one step past its DELETE
            frac = self.estimate.after_step(step)
            for j in self.live:
                store.set_progress(j, frac, step)
            self._drop_deleted(store, step)
        except Exception:  # an unreachable store costs this step's progress, never the batch
            logger.exception("job progress after step %d not recorded", step)
            return False
        return not self.live and self.others == 0

    def on_decoded(self) -> None:
        try:
            store = open_store(self.store_cfg)
            for j in self.live:
                store.set_progress(j, self.estimate.after_decode(), self.estimate.steps)
            self._drop_deleted(store, self.estimate.steps)
        except Exception:
            logger.exception("job progress after the decode not recorded")

    def _drop_deleted(self, store: JobStore, step: int) -> None:
        gone = store.cancelled(self.live)
        for j in gone:
            store.stopped(j, step)
        self.live = [j for j in self.live if j not in gone]
