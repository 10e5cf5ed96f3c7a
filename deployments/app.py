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

from xema_ray.serving.config import ServeConfig
from xema_ray.serving.model_group import ModelGroup
from xema_ray.serving.router import Router
from deployments.planning import load_or_plan
from xema_ray.serving.startup import served_templates

logger = logging.getLogger("xema_ray.serving")


def build_app(args: dict[str, Any]) -> Application:
    """Compose the application from ``args`` (validated as ``ServeConfig``)."""
    cfg = ServeConfig.model_validate(args)
    templates = served_templates(cfg)
    table = load_or_plan(cfg, templates)
    groups = {}
    for g in cfg.models:
        plans = {t.shape_key: table.lookup(t).model_dump_json() for t in templates if t.model == g.model}
        bundle: dict[str, float] = {"CPU": cfg.worker_cpus}
        if cfg.device == "cuda":
            bundle["GPU"] = 1
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
            wait_window_s=g.wait_window_s, max_queue=g.max_queue,
            residency=g.residency or (table.residency[g.model].policy if g.model in table.residency else "per_template"),
        )
    router = serve.deployment(Router, name="Router", max_ongoing_requests=cfg.max_ongoing_requests,
                              max_queued_requests=cfg.max_queued_requests, ray_actor_options={"num_cpus": 0})
    return router.bind(groups, table.model_dump_json(), [t.model_dump_json() for t in templates])
