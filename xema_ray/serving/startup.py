"""Start-up of the serving application: the served templates and the checks on their plan table
(every plan runnable by its model group, residencies within the node's host memory).

Loading or computing the plan table at start-up (``load_or_plan``) runs the planner, so it is
composed where the app is built (``deployments.planning``): no library module of ``xema_ray``
imports ``planner``.
"""

from __future__ import annotations

from xema_ray import deployment
from xema_ray.plan import PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.templates import RequestTemplate


def served_templates(cfg: ServeConfig) -> list[RequestTemplate]:
    """Every configured template, validated (a bad one fails start-up with its reason)."""
    return deployment.served_templates(list(cfg.models))


class PlanNotRunnable(ValueError):
    """A plan table asks for a layout a model group cannot run, or more host memory than the node has."""


def check_runnable(table: PlanTable, cfg: ServeConfig, templates: list[RequestTemplate],
                   host_memory_bytes: int | None = None) -> int:
    """Refuse, before anything starts, a plan a model group cannot run: its SP degree must divide
    the group's workers (every SP group is carved from the worker set) and SP × DP must fit in
    it; and the pinned host memory every worker's residency needs must fit the node.

    Returns:
        the host memory the node has left beyond those residencies (for paused batches' state).

    Raises:
        PlanNotRunnable: naming the template, the plan and the group size.
    """
    import torch

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
            host = residency_host_bytes(t.spec, Residency.of_config(c))
            if c.text_encoder in ("streamed", "cpu") and t.spec.text_encoder is not None:
                from xema_ray.models.text_encoders import encoder_weight_bytes

                dtype = torch.bfloat16 if t.spec.size == "real" else torch.float32
                host += encoder_weight_bytes(t.spec.text_encoder, dtype)[0]  # its weights live on the host
            per_worker = max(per_worker, host)
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
    return total - host_needed


def paused_host_bytes(spare_host_bytes: int, cfg: ServeConfig) -> int:
    """Host memory one worker may give to paused batches' state: half of what the residencies
    leave on the node (the other half for the processes themselves), shared by every worker."""
    return max(0, spare_host_bytes // 2) // max(1, sum(g.workers for g in cfg.models))


def node_memory_bytes() -> int:
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class StartupError(ValueError):
    """Something the deployment needs is missing: named, with what to do, before anything starts."""


def preflight(cfg: ServeConfig) -> None:
    """The checks a user's first start-up needs, run where ``xema serve`` starts (before planning):
    every group's ``weights_dir`` is its model's diffusers directory with the folders it loads
    (``xema_ray.models.published.check_weights_dir``), and a Redis job store answers. Each missing
    piece is a start-up error naming it, never a failure at the first request.

    Weights are read on the workers' nodes: a multi-node deployment keeps them at the same path on
    every node, this one included (docs/install-gpu.md).

    Raises:
        StartupError: listing every problem found.
    """
    from xema_ray.models import get_model_spec
    from xema_ray.models.published import WeightsDirError, check_weights_dir

    problems = []
    if cfg.device != "emulated":  # an emulated box loads no weights
        for g in cfg.models:
            if g.weights_dir is not None:
                try:
                    check_weights_dir(get_model_spec(g.model).family, g.model, g.weights_dir)
                except WeightsDirError as e:
                    problems.append(str(e))
    if cfg.jobs.backend == "redis":
        problem = redis_problem(cfg.jobs.redis_url or "", cfg.jobs.timeout_s)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise StartupError("cannot start:\n  " + "\n  ".join(problems))


def redis_problem(url: str, timeout_s: float) -> str | None:
    """None if a Redis server answers PING at ``url``, else what is wrong and how to start one."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as e:
        return (f"jobs.redis_url {url}: no Redis answers ({type(e).__name__}: {e}); start one (redis-server "
                "--port 6379, or your distribution's redis service) or set jobs.backend: sqlite on a single node")
    return None


def gpu_shortfall(cfg: ServeConfig, cluster_gpus: float) -> str | None:
    """On ``device: cuda``, what is missing when the Ray cluster has fewer GPUs than the groups'
    workers ask for (Serve would wait for them without saying why); None if they fit. A warning,
    not an error: a cluster autoscaler (KubeRay) adds GPU nodes for the pending bundles."""
    if cfg.device != "cuda":
        return None
    asked = {g.model: g.workers * g.replicas for g in cfg.models}
    if sum(asked.values()) <= cluster_gpus:
        return None
    return (f"device: cuda: the groups' workers ask for {sum(asked.values())} GPUs ("
            + ", ".join(f"{m} {n}" for m, n in asked.items()) + f"), the Ray cluster has {cluster_gpus:g} now: "
            "the groups wait for them (nvidia-smi lists the machine's; CUDA_VISIBLE_DEVICES may hide some; without "
            "an autoscaler adding GPU nodes, they never come: docs/install-gpu.md)")
