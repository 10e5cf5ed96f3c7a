"""The real planner model on tiny templates: analytic memory search, then traced confirmation."""

from __future__ import annotations

from planner.latency import LatencyModel
from planner.stages import plan_template
from planner.trace_model import TracePlannerModel
from planner.traces import TraceCache
from xema_ray.mitigation.tracing import trace_with_mitigations
from xema_ray.templates import RequestTemplate


def test_plan_fits_its_budget_when_traced_with_its_mitigations() -> None:
    t = RequestTemplate(model="tiny-cogvideox", height=64, width=64, frames=9, steps=4)
    budget = 15 * 10**6  # the unmitigated request peaks at 19.1 MB (VAE decode)
    model = TracePlannerModel(t, LatencyModel("a6000").seconds, TraceCache())
    plan = plan_template(model, t, gpus=1, budget=budget, max_batch=2)
    assert plan.entry is not None, plan.log.infeasible
    cfg = plan.entry.config
    assert cfg.mitigations, "the budget is below the unmitigated peak, so something must be mitigated"
    assert model.confirm(cfg, budget) is None
    traced = trace_with_mitigations(t.with_(batch=cfg.batch), list(cfg.mitigations)).peak()
    assert traced <= budget


def test_unrunnable_or_oversized_choices_are_rejected_by_confirmation() -> None:
    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=4)
    model = TracePlannerModel(t, LatencyModel("a6000").seconds, TraceCache())
    plan = plan_template(model, t, gpus=1, budget=10**3, max_batch=1)  # 1 kB: nothing fits
    assert plan.entry is None
