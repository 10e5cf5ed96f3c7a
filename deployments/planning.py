"""Start-up planning, composed where the Serve app is built: a library module of ``xema_ray``
never imports ``planner`` (issue #16), so the serving package takes its plan table from here.

Moved verbatim from ``xema_ray.serving.startup`` (which keeps the checks: ``served_templates``,
``check_runnable``).
"""

from __future__ import annotations

import logging
from typing import Any

from xema_ray.memory.analysis import parse_bytes
from xema_ray.plan import PlanProvenance, PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.startup import check_runnable
from xema_ray.templates import RequestTemplate

logger = logging.getLogger(__name__)


def machine_fingerprint(cfg: ServeConfig, gpus: int) -> str:
    """What this deployment runs on, in the form plan tables record."""
    from planner.latency import LatencyModel

    hardware = cfg.hardware or ("cpu" if cfg.device == "cpu" else "local-gpu")
    return LatencyModel(hardware).fingerprint(gpus)


def load_or_plan(cfg: ServeConfig, templates: list[RequestTemplate]) -> tuple[PlanTable, int]:
    """The plan table covering ``templates`` (loaded and checked, or planned now) and the host
    memory the node has beyond its residencies (``check_runnable``)."""
    if cfg.plan_table is not None:
        other = [g.model for g in cfg.models if not g.default_dtypes]
        if other:
            # a table's plans were traced at the models' default dtypes (plan tables record no others)
            raise ValueError(f"{', '.join(other)}: dtype / component_dtypes differ from the model's default, but "
                             f"plan table {cfg.plan_table} was planned at the defaults: drop plan_table to plan at "
                             "start-up with them, or drop the dtype settings")
        table = PlanTable.load(str(cfg.plan_table))
        if cfg.device != "emulated":  # an emulated box is, by definition, the table's hardware
            table.check_hardware(machine_fingerprint(cfg, table.gpus), force=cfg.force_plan_table)
        missing = [t.shape_key for t in templates if t.shape_key not in table.entries]
        if missing:
            raise ValueError(f"plan table {cfg.plan_table} has no plan for {', '.join(missing)}")
    else:
        table = plan_now(cfg, templates)
    host = parse_bytes(cfg.emulated_host_memory) if cfg.device == "emulated" else None
    return table, check_runnable(table, cfg, templates, host_memory_bytes=host)


def group_dtypes(cfg: ServeConfig) -> dict[str, Any]:
    """Per model whose group sets dtypes: (dtype, components kept in another) to trace it with."""
    from xema_ray.models import get_model_spec
    from xema_ray.models.base import model_dtypes

    return {g.model: model_dtypes(get_model_spec(g.model), g.dtype, g.component_dtypes)
            for g in cfg.models if not g.default_dtypes}


def plan_now(cfg: ServeConfig, templates: list[RequestTemplate]) -> PlanTable:
    from planner.latency import LatencyModel
    from planner.pause_state import with_pause_bytes
    from planner.stages import plan_template
    from planner.tiers import price_tiers
    from planner.trace_model import TracePlannerModel
    from planner.traces import TraceCache

    budget = parse_bytes(cfg.budget)
    hardware = cfg.hardware or ("cpu" if cfg.device == "cpu" else "local-gpu")
    cache_dir = cfg.cache_dir
    latency = LatencyModel(hardware, store_path=cache_dir / "profiles.json" if cache_dir else None)
    if hardware == "cpu":
        latency.calibrate(templates)  # one measured request per template: seconds for the tiny models
    cache = TraceCache(cache_dir / "traces" if cache_dir else None, dtypes=group_dtypes(cfg))
    entries = {}
    infeasible = []
    gpus_of = {g.model: g.workers for g in cfg.models}
    for t in templates:
        model = TracePlannerModel(t, latency.seconds, cache)
        plan = plan_template(model, t, gpus_of[t.model], budget, slo_scale=cfg.slo_scale, latency_source=latency.source)
        if plan.entry is None:
            infeasible.append(t.shape_key)
        else:
            entries[t.shape_key] = with_pause_bytes(plan.entry, cache)
            logger.info("planned %s: %s", t.shape_key, plan.entry.config.describe())
    if infeasible:
        raise ValueError(
            f"no configuration serves {', '.join(infeasible)} within the {cfg.budget} budget per worker; "
            "raise the budget, add workers or drop these templates"
        )
    gpus = max(gpus_of.values())
    table = PlanTable(hardware=latency.fingerprint(gpus), gpus=gpus, budget_bytes=budget, slo_scale=cfg.slo_scale,
                      group_gpus=gpus_of, planner="xema", entries=entries, provenance=PlanProvenance(planned="at start-up"))
    # each template's quality tiers priced (the planner's tiers pass): the groups serve what is priced
    return price_tiers(table, {g.model: g.quality_tiers for g in cfg.models if g.quality_tiers})
