"""Start-up of the serving application: the served templates and their plan table.

A plan table given in the config is checked against this machine's hardware (refused if it was
made for other hardware, unless forced); without one, the planner runs here on the configured
templates (seconds for the tiny models).
"""

from __future__ import annotations

import logging

from xema_ray.memory.analysis import parse_bytes
from xema_ray.plan import PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.templates import RequestTemplate

logger = logging.getLogger("xema_ray.serving")


def served_templates(cfg: ServeConfig) -> list[RequestTemplate]:
    """Every configured template, validated (a bad one fails start-up with its reason)."""
    out = []
    for g in cfg.models:
        for t in g.templates:
            out.append(RequestTemplate(model=g.model, width=t.width, height=t.height, frames=t.frames, steps=t.steps))
    return out


def machine_fingerprint(cfg: ServeConfig, gpus: int) -> str:
    """What this deployment runs on, in the form plan tables record."""
    from planner.latency import LatencyModel

    hardware = cfg.hardware or ("cpu" if cfg.device == "cpu" else "local-gpu")
    return LatencyModel(hardware).fingerprint(gpus)


class PlanNotRunnable(ValueError):
    """A plan table asks for a layout a model group cannot run, or more host memory than the node has."""


def check_runnable(table: PlanTable, cfg: ServeConfig, templates: list[RequestTemplate],
                   host_memory_bytes: int | None = None) -> None:
    """Refuse, before anything starts, a plan a model group cannot run: its SP degree must divide
    the group's workers (every SP group is carved from the worker set) and SP × DP must fit in
    it; and the pinned host memory every worker's residency needs must fit the node.

    Raises:
        PlanNotRunnable: naming the template, the plan and the group size.
    """
    from xema_ray.runtime.residency import Residency, residency_host_bytes

    workers = {g.model: g.workers for g in cfg.models}
    problems = []
    host_needed = 0
    for g in cfg.models:
        mine = [t for t in templates if t.model == g.model]
        per_worker = 0
        for t in mine:
            c = table.lookup(t).config
            if g.workers % c.sp:
                problems.append(f"{t.shape_key}: plan {c.describe()} needs SP groups of {c.sp} workers, but the "
                                f"{g.model} group has {g.workers} (SP must divide the group size)")
            elif c.gpus > g.workers:
                problems.append(f"{t.shape_key}: plan {c.describe()} uses {c.gpus} GPUs (SP {c.sp} x DP {c.dp}), "
                                f"the {g.model} group has {g.workers}")
            per_worker = max(per_worker, residency_host_bytes(t.spec, Residency.of_config(c)))
        planned = table.group_gpus.get(g.model)
        if planned is not None and planned != workers[g.model]:
            problems.append(f"{g.model}: the table was planned for a group of {planned} GPUs, the deployment gives it "
                            f"{workers[g.model]} (re-plan with xema plan --deployment)")
        host_needed += per_worker * g.workers
    total = host_memory_bytes if host_memory_bytes is not None else node_memory_bytes()
    if host_needed > total:
        problems.append(f"the residencies keep {host_needed / 1e9:.1f} GB of weights in pinned host memory, "
                        f"the node has {total / 1e9:.1f} GB")
    if problems:
        raise PlanNotRunnable("plan table cannot run on this deployment:\n  " + "\n  ".join(problems))


def node_memory_bytes() -> int:
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def load_or_plan(cfg: ServeConfig, templates: list[RequestTemplate]) -> PlanTable:
    """The plan table covering ``templates``: loaded and checked, or planned now."""
    if cfg.plan_table is not None:
        table = PlanTable.load(str(cfg.plan_table))
        table.check_hardware(machine_fingerprint(cfg, table.gpus), force=cfg.force_plan_table)
        missing = [t.shape_key for t in templates if t.shape_key not in table.entries]
        if missing:
            raise ValueError(f"plan table {cfg.plan_table} has no plan for {', '.join(missing)}")
    else:
        table = plan_now(cfg, templates)
    check_runnable(table, cfg, templates)
    return table


def plan_now(cfg: ServeConfig, templates: list[RequestTemplate]) -> PlanTable:
    from planner.latency import LatencyModel
    from planner.stages import plan_template
    from planner.trace_model import TracePlannerModel
    from planner.traces import TraceCache

    budget = parse_bytes(cfg.budget)
    hardware = cfg.hardware or ("cpu" if cfg.device == "cpu" else "local-gpu")
    cache_dir = cfg.cache_dir
    latency = LatencyModel(hardware, store_path=cache_dir / "profiles.json" if cache_dir else None)
    if hardware == "cpu":
        latency.calibrate(templates)  # one measured request per template: seconds for the tiny models
    cache = TraceCache(cache_dir / "traces" if cache_dir else None)
    entries = {}
    infeasible = []
    gpus_of = {g.model: g.workers for g in cfg.models}
    for t in templates:
        model = TracePlannerModel(t, latency.seconds, cache)
        plan = plan_template(model, t, gpus_of[t.model], budget, slo_scale=cfg.slo_scale, latency_source=latency.source)
        if plan.entry is None:
            infeasible.append(t.shape_key)
        else:
            entries[t.shape_key] = plan.entry
            logger.info("planned %s: %s", t.shape_key, plan.entry.config.describe())
    if infeasible:
        raise ValueError(
            f"no configuration serves {', '.join(infeasible)} within the {cfg.budget} budget per worker; "
            "raise the budget, add workers or drop these templates"
        )
    gpus = max(gpus_of.values())
    return PlanTable(hardware=latency.fingerprint(gpus), gpus=gpus, budget_bytes=budget, slo_scale=cfg.slo_scale,
                     group_gpus=gpus_of, planner="xema", entries=entries, provenance={"planned": "at start-up"})
