"""The Ray Serve application: a Router ingress and one ModelGroup deployment per model.

``serve run deployments/xema.yaml`` calls ``build_app`` with the YAML's ``args``; everything is
composed from one ``ServeConfig``. Without a plan table the plans are computed at start-up
(the planner on the configured templates), so the default runs anywhere.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application

from deployments.planning import load_or_plan
from xema_ray.plan import PlanTable
from xema_ray.runtime.layouts import layouts_dir
from xema_ray.serving.config import ModelGroupConfig, ServeConfig
from xema_ray.serving.dispatcher import PreemptionPolicy
from xema_ray.serving.model_group import ModelGroup
from xema_ray.serving.ray_env import exposed_ports_warning
from xema_ray.serving.router import Router
from xema_ray.serving.startup import paused_host_bytes, served_templates
from xema_ray.serving.stats import Stats
from xema_ray.serving.worker_set import WORKER_KINDS

logger = logging.getLogger("xema_ray.serving")


def preemption_policy(g: ModelGroupConfig, table: PlanTable, host_bytes: int) -> PreemptionPolicy | None:
    """The group's step-level preemption policy, or None where the YAML turns it off."""
    if g.max_preemptions == 0:
        return None
    r = table.residency.get(g.model)
    switch = r.switch_s if r is not None and r.policy == "per_template" else {}
    return PreemptionPolicy(budget_bytes=table.budget_bytes, host_bytes=host_bytes,
                            max_preemptions=g.max_preemptions, switch_s=switch)


def build_app(args: dict[str, Any]) -> Application:
    """Compose the application from ``args`` (validated as ``ServeConfig``)."""
    cfg = ServeConfig.model_validate(args)
    exposed = exposed_ports_warning()
    if exposed is not None:  # Ray is already bound: tell, loudly (docs/serving.md "Ports")
        logger.warning(exposed)
        print(f"WARNING: {exposed}", flush=True)
    templates = served_templates(cfg)
    table, spare_host = load_or_plan(cfg, templates)
    groups = {}
    for g in cfg.models:
        plans = {t.shape_key: table.lookup(t) for t in templates if t.model == g.model}
        bundle = {**WORKER_KINDS[cfg.device].bundle(cfg.worker_cpus), **g.bundle_resources}
        deployment = serve.deployment(
            ModelGroup,
            name=f"ModelGroup:{g.model}",
            num_replicas=g.replicas,
            # the replica sits in bundle 0 next to worker 0 and needs no CPU of its own
            ray_actor_options={"num_cpus": 0},
            placement_group_bundles=[dict(bundle) for _ in range(g.workers)],
            placement_group_strategy="STRICT_PACK",
            max_ongoing_requests=10_000,  # the dispatcher bounds its queues and answers 503 itself
        )
        groups[g.model] = deployment.bind(
            model=g.model, workers=g.workers, plans=plans, device=cfg.device,
            weights_dir=str(g.weights_dir) if g.weights_dir else None, worker_cpus=cfg.worker_cpus,
            wait_window_s=g.wait_window_s, max_queue=g.max_queue, jobs=cfg.jobs,
            residency=g.residency or (table.residency[g.model].policy if g.model in table.residency else "per_template"),
            layouts_dir=str(layouts_dir(cfg.plan_table)) if cfg.plan_table is not None else None,
            preemption=preemption_policy(g, table, paused_host_bytes(spare_host, cfg)),
        )
    ingress_options = {"num_cpus": 0, **({"resources": cfg.router_resources} if cfg.router_resources else {})}
    stats = serve.deployment(Stats, name="Stats", ray_actor_options=dict(ingress_options)).bind()
    # the Router answers overload itself (JSON 503 with Retry-After at limits.max_in_flight), so
    # Serve's own limits sit above it; Serve's backpressure stays a last resort with Retry-After
    in_flight = cfg.limits.max_in_flight
    router = serve.deployment(Router, name="Router", num_replicas=cfg.router_replicas,
                              max_ongoing_requests=max(cfg.max_ongoing_requests, in_flight + 16),
                              max_queued_requests=cfg.max_queued_requests, ray_actor_options=dict(ingress_options),
                              backpressure_config={"retry_after_s": 2})
    return router.bind(groups, table, list(templates), stats=stats, limits=cfg.limits, jobs=cfg.jobs, auth=cfg.auth)
