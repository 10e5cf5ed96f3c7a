"""The decode stage as the dispatcher sees it (``ExecutionConfig.decode``): a template whose latents
go to a decode pool is dispatched twice by the same ``Dispatcher`` code, once over the model
group's DiT workers for its denoising (the batch's latency less its decode: the DiT workers are
free when the last step ends) and once per request over the pool's decode workers (a batch of one
on one worker, its latency one decode with its hand-over), the second keeping the deadline the
request got at the door. The simulator and the live model group both build their decode queue
here.

Example:
    >>> from xema_ray.plan import DecodeStage, ExecutionConfig, PlanEntry, PlanPrediction
    >>> from xema_ray.templates import RequestTemplate
    >>> t = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=4)
    >>> e = PlanEntry(config=ExecutionConfig(template=t, decode=DecodeStage(workers=1, gpus_per_worker=0.5)),
    ...               prediction=PlanPrediction(peak_bytes=1, latency_s=10.0, goodput_rps=0.1, slo_s=30.0,
    ...                                         latency_source="estimated", decode_s=3.0))
    >>> dit_stage_latency(e), decode_plan(e).latency_s
    (7.0, 3.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from xema_ray.plan import PlanEntry
from xema_ray.scheduling.batch import DispatchPlan


def pooled(entry: PlanEntry) -> bool:
    """The entry hands its latents to a decode pool (with the pool's decode time known)."""
    return entry.config.decode is not None and entry.prediction.decode_s is not None


def decode_tail_s(entry: PlanEntry) -> float:
    """Seconds of the entry's latency after its DiT workers are free: its batch's decodes on the
    pool (waves of ``workers`` at once), hand-overs included; 0 decoded in place."""
    if not pooled(entry):
        return 0.0
    assert entry.config.decode is not None and entry.prediction.decode_s is not None
    waves = math.ceil(entry.config.batch / entry.config.decode.workers)
    return waves * entry.prediction.decode_s


def dit_stage_latency(entry: PlanEntry, n: int | None = None) -> float:
    """Seconds a batch of ``n`` (default: the plan's batch) holds the DiT workers."""
    p = entry.prediction
    whole = p.latency_s if n is None else p.latency_by_batch.get(n, p.latency_s)
    return max(0.0, whole - decode_tail_s(entry))


def decode_plan(entry: PlanEntry) -> DispatchPlan:
    """One request's decode on one decode worker, as the pool's dispatcher queues it."""
    assert pooled(entry) and entry.prediction.decode_s is not None
    return DispatchPlan(batch=1, sp=1, slo_s=entry.prediction.slo_s, latency_s=entry.prediction.decode_s, steps=1,
                        peak_bytes=entry.prediction.decode_peak_bytes, denoise_frac=0.0, decode_encode_frac=1.0)


def decode_plans(entries: Mapping[str, PlanEntry]) -> dict[str, DispatchPlan]:
    """The pool's dispatch plans: one per template whose decode is pooled."""
    return {k: decode_plan(e) for k, e in entries.items() if pooled(e)}


def pool_size(entries: Mapping[str, PlanEntry]) -> tuple[int, int]:
    """(decode workers, GPUs they take) of a model group's pool: the largest its templates ask for
    (the group holds one pool; each template's plan was sized for its own)."""
    stages = [e.config.decode for e in entries.values() if pooled(e) and e.config.decode is not None]
    return max((s.workers for s in stages), default=0), max((s.gpus for s in stages), default=0)
