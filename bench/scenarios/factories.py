"""Plan entries for tests and scenarios: one factory instead of one per test module.

A hand-made ``PlanEntry`` with a latency and a small peak, for tests that need a plan table
without planning (the dispatcher batches, preempts and admits by these numbers; the worker, the
simulator and ``xema verify`` read the configuration). ``plan_prediction`` is the prediction alone,
``plan_entry`` a configuration with one, ``plan_table`` a table keyed by each entry's template.

Example:
    >>> from xema_ray.templates import RequestTemplate
    >>> e = plan_entry(RequestTemplate(model="tiny-flux2", width=64, height=64, steps=4), batch=2, latency_s=1.0)
    >>> (e.config.batch, e.prediction.latency_s, e.prediction.latency_source.value)
    (2, 1.0, 'measured')
    >>> plan_entry(e.config, layout_ref="ab12").config.layout_ref
    'ab12'
    >>> list(plan_table([e]).entries) == [e.config.template.shape_key]
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from xema_ray.plan import ExecutionConfig, PlanEntry, PlanPrediction, PlanTable
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import LatencySource


def plan_prediction(*, peak_bytes: int = 10**7, latency_s: float = 0.5, goodput_rps: float = 1.0,
                    slo_s: float = 30.0, latency_source: LatencySource | str = LatencySource.MEASURED,
                    pause_bytes: int | None = None, latency_by_batch: dict[int, float] | None = None) -> PlanPrediction:
    """A prediction of ``latency_s`` (``latency_source``: measured unless said) under ``slo_s``.

    Args:
        peak_bytes, latency_s, goodput_rps, slo_s: the predicted figures.
        latency_source: where the latencies came from (``xema_ray.vocabulary.LatencySource``).
        pause_bytes: what a paused batch holds besides weights; None: not known.
        latency_by_batch: predicted latency of partial batches; None: none given.
    """
    return PlanPrediction(peak_bytes=peak_bytes, latency_s=latency_s, goodput_rps=goodput_rps, slo_s=slo_s,
                          latency_source=LatencySource(latency_source), pause_bytes=pause_bytes,
                          latency_by_batch=latency_by_batch or {})


def plan_entry(t: RequestTemplate | ExecutionConfig, *, batch: int | None = None, ulysses: int | None = None,
               dp: int | None = None, layout_ref: str | None = None, latency_s: float = 0.5, slo_s: float = 30.0,
               peak_bytes: int = 10**7, goodput_rps: float = 1.0,
               latency_source: LatencySource | str = LatencySource.MEASURED, pause_bytes: int | None = None,
               latency_by_batch: dict[int, float] | None = None, **config: Any) -> PlanEntry:
    """A plan entry for ``t`` whose prediction says ``latency_s`` under ``slo_s``.

    Args:
        t: the template (its configuration: SP 1, DP 1, batch 1, no mitigation unless given), or a
            whole execution configuration, of which the given fields are replaced.
        batch, ulysses, dp, layout_ref: the execution configuration's batch size, SP degree, data
            parallelism and static layout id; None: the template's default, or the configuration's own.
        latency_s, slo_s, peak_bytes, goodput_rps, latency_source, pause_bytes, latency_by_batch:
            the prediction (``plan_prediction``).
        **config: any other ``ExecutionConfig`` field (``mitigations``, ``text_encoder``, ``ring``, …).
    """
    fields = {k: v for k, v in (("batch", batch), ("ulysses", ulysses), ("dp", dp), ("layout_ref", layout_ref))
              if v is not None} | config
    cfg = (ExecutionConfig(**{**dict(t), **fields}) if isinstance(t, ExecutionConfig)
           else ExecutionConfig(template=t, **fields))
    return PlanEntry(config=cfg, prediction=plan_prediction(
        peak_bytes=peak_bytes, latency_s=latency_s, goodput_rps=goodput_rps, slo_s=slo_s,
        latency_source=latency_source, pause_bytes=pause_bytes, latency_by_batch=latency_by_batch))


def plan_table(entries: Iterable[PlanEntry], *, hardware: str = "cpu", gpus: int = 1, budget_bytes: int = 10**9,
               **table: Any) -> PlanTable:
    """A plan table of ``entries``, each under its template's shape key.

    Args:
        entries: the plan entries (one per template).
        hardware, gpus, budget_bytes: the table's hardware fingerprint, GPU count and per-GPU budget.
        **table: any other ``PlanTable`` field (``admission``, ``adapter_pools``, …).
    """
    return PlanTable(hardware=hardware, gpus=gpus, budget_bytes=budget_bytes,
                     entries={e.config.template.shape_key: e for e in entries}, **table)
