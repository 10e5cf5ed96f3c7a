"""The Ray Serve application: a Router ingress and one ModelGroup deployment per model (or a
SharedReplica deployment holding several models' groups in one process: ``shared_replicas:``).

``serve run deployments/xema.yaml`` calls ``build_app`` with the YAML's ``args``; everything is
composed from one ``ServeConfig``. Without a plan table the plans are computed at start-up
(the planner on the configured templates), so the default runs anywhere.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from deployments.console_traces import trace_view
from deployments.planning import load_or_plan, resolve_plan_table
from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.profiling.phases import phase_shares
from xema_ray.runtime.emulation import emulation_for, scale_table
from xema_ray.allocator.artifact import layouts_dir
from xema_ray.serving.config import ServeConfig
from xema_ray.scheduling.preemption_policy import PreemptionPolicy
from xema_ray.serving.group.adapter_registry import AdapterRegistry
from xema_ray.serving.group.shared_replica import SharedReplica, SharedMember
from xema_ray.serving.group.model_group import ModelGroup
from xema_ray.serving.group.settings import GroupSettings, ModelGroupConfig
from xema_ray.serving.ray_env import exposed_ports_warning
from xema_ray.serving.replica_bind import bind_replica_servers_to_node
from xema_ray.serving.scale.replica_summary import PlanBrief
from xema_ray.serving.api.router import Router
from xema_ray.serving.api.wake import WakePolicy
from xema_ray.serving.startup import gpu_shortfall, paused_host_bytes, preflight, served_templates
from xema_ray.serving.stats import Stats
from xema_ray.serving.group.worker_set import WORKER_KINDS

logger = logging.getLogger("xema_ray.serving")

#: Serve's own health check of every replica: a replica whose process died fails its next check at
#: once and is replaced (so Serve's controller, which the Router consults, knows within ~1 s
#: instead of Serve's default 10 s); a slow answer is not a death: 30 s per check, and Serve
#: needs 3 failed checks in a row (docs/serving.md "Failure detection")
HEALTH_CHECK = {"health_check_period_s": 1.0, "health_check_timeout_s": 30.0}


def preemption_policy(g: ModelGroupConfig, table: PlanTable, host_bytes: int,
                      time_scale: float = 1.0) -> PreemptionPolicy | None:
    """The group's step-level preemption policy, or None where the YAML turns it off
    (``time_scale``: an emulated box's clock, whose state moves are that much faster)."""
    if g.max_preemptions == 0:
        return None
    r = table.residency.get(g.model)
    switch = r.switch_s if r is not None and r.policy == "per_template" else {}
    policy = PreemptionPolicy(budget_bytes=table.budget_bytes, host_bytes=host_bytes,
                              max_preemptions=g.max_preemptions, switch_s=switch)
    if time_scale != 1.0:
        policy = policy.model_copy(update={"host_bandwidth": policy.host_bandwidth * time_scale})
    return policy


def _served_kwargs(config: ModelGroupConfig, settings: GroupSettings | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A served group's constructor keywords: where it keeps the model's host copy past its replica
    (``host_copy``: the node's holder, so a group scaled to zero wakes warm)."""
    real = settings is None or settings.emulation is None
    if real and config.wants_host_copy() and "host_holder" not in kwargs:
        from xema_ray.serving.group.host_keeper import node_holder

        kwargs = {**kwargs, "host_holder": node_holder(serve.get_replica_context().app_name)}
    return kwargs


class ServedModelGroup(ModelGroup):
    """ModelGroup as Serve runs it: on scale-down Serve stops routing to the replica, waits for
    its ongoing requests (every synchronous request it accepted), then calls ``__del__``, which
    drains what is left (``SummaryPublisher.drain``: queued jobs handed back, running batches
    finished within the budget)."""

    def __init__(self, config: ModelGroupConfig, plans: dict[str, PlanEntry], settings: GroupSettings | None = None,
                 **kwargs: Any) -> None:
        bind_replica_servers_to_node()  # before Serve starts this replica's gRPC server (replica_bind)
        super().__init__(config, plans, settings, **_served_kwargs(config, settings, kwargs))

    async def __del__(self) -> None:
        await self.drain(DRAIN_S)


class ServedSharedReplica(SharedReplica):
    """SharedReplica as Serve runs it (``shared_replicas:``): its replica's gRPC server bound to the node,
    each member built as a served group is, and on removal every member drained at once."""

    def __init__(self, members: list[SharedMember]) -> None:
        bind_replica_servers_to_node()  # before Serve starts this replica's gRPC server (replica_bind)
        super().__init__(members, make_group=lambda m: ModelGroup(m.config, m.plans, m.settings, wait_decode=False,
                                                                  **_served_kwargs(m.config, m.settings, {})))
        for group in self.groups.values():  # the decode workers loaded while the members were built
            group.wait_started()

    async def __del__(self) -> None:
        await self.drain(DRAIN_S)


#: seconds a replica being removed gets to finish its running batches after its ongoing requests
DRAIN_S = 60.0


def scaling_options(g: ModelGroupConfig, entries: dict[str, PlanEntry]) -> dict[str, Any]:
    """The deployment options that replicate a group: the SLO-aware request router where it can
    have several replicas, and Serve autoscaling driven by the replicas' predicted attainment."""
    import warnings

    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    from xema_ray.scheduling.batch import DispatchPlan
    from xema_ray.serving.scale.replica_router import SloRequestRouter
    from xema_ray.serving.scale.scaling import SloAutoscalingPolicy

    a = g.autoscaling
    longest = max(e.prediction.latency_s for e in entries.values())
    # Serve waits this long for a removed replica's ongoing requests, then its drain, then kills it
    opts: dict[str, Any] = {"graceful_shutdown_timeout_s": max(30.0, 2 * longest) + DRAIN_S,
                            "graceful_shutdown_wait_loop_s": 0.5}
    if not replicated(g):
        return {**opts, "num_replicas": 1}
    opts["request_router_config"] = RequestRouterConfig(request_router_class=SloRequestRouter,
                                                        request_routing_stats_period_s=0.5,
                                                        request_routing_stats_timeout_s=5.0)
    if a is None:
        return {**opts, "num_replicas": g.replicas}
    briefs = {k: PlanBrief.of(DispatchPlan.of_entry(e)).model_dump() for k, e in entries.items()}
    with warnings.catch_warnings():  # metrics_interval_s: deprecated for an env variable, still what 2.60 reads
        warnings.simplefilter("ignore", DeprecationWarning)
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=a.min_replicas, max_replicas=a.max_replicas, initial_replicas=g.replicas,
            metrics_interval_s=a.metrics_interval_s, look_back_period_s=3 * a.metrics_interval_s,
            upscale_delay_s=a.upscale_delay_s, downscale_delay_s=a.downscale_delay_s,
            policy=AutoscalingPolicy(policy_function=SloAutoscalingPolicy,
                                     policy_kwargs={"spec": a.model_dump(), "plans": briefs}))
    return {**opts, "num_replicas": "auto"}


def wake_policy(g: ModelGroupConfig, table: PlanTable) -> WakePolicy:
    """How the Router holds the requests of a group that scales to zero: its wake timeout from the
    YAML, else from the plan's predicted warm start of its replica (predicted here, from the same
    measured figures, for a table planned without one: the start-up plans and older tables)."""
    assert g.autoscaling is not None
    start = table.replica_start.get(g.model)
    if start is None and g.autoscaling.wake_timeout_s is None:
        from xema_ray.profiling.replica_start import predict_start, start_figures
        from xema_ray.runtime.host_bytes import model_weight_bytes

        start = predict_start(model_weight_bytes(g.model), start_figures(None))
    return WakePolicy(timeout_s=g.autoscaling.wake_timeout(start), max_queue=g.max_queue)


def replicated(g: ModelGroupConfig) -> bool:
    """Whether the group may run several replicas (``replicas:`` above 1, or ``autoscaling:``)."""
    return g.autoscaling is not None or g.replicas > 1


def adapter_registry(cfg: ServeConfig, options: dict[str, Any]) -> Any:
    """The ``AdapterRegistry`` deployment the replicated groups with adapters follow (their run-time
    adapter changes reach every replica; ``xema_ray.serving.group.adapter_registry``); None
    where no group needs one."""
    if not any(replicated(g) and g.adapters for g in cfg.models):
        return None
    return serve.deployment(AdapterRegistry, name="AdapterRegistry", num_replicas=1, ray_actor_options=dict(options),
                            # its calls never block on workers; a change waits up to a minute for replicas
                            max_ongoing_requests=1000, **HEALTH_CHECK).bind()


def worker_resources(cfg: ServeConfig, g: ModelGroupConfig, plans: dict[str, PlanEntry]) -> dict[str, Any]:
    """What a group's replica asks Ray for. Ray actors (``worker_set: ray``): a placement group of one
    bundle per worker, the replica in bundle 0 next to worker 0 with no CPU of its own, then one bundle
    per decode worker of the group's ``decode:`` pool (``worker_cpus``, and its GPU share on a GPU
    device). In-process
    workers (``worker_set: inprocess``): the replica alone, reserving what its workers' bundles would
    have (no placement group, no process per worker); every plan must be SP 1 (one torch.distributed
    world per process), refused here naming the template otherwise."""
    if cfg.worker_set == "inprocess":
        wide = sorted(k for k, e in plans.items() if e.config.sp > 1)
        if wide:
            raise ValueError(f"worker_set: inprocess runs plans of SP 1 only; {g.model}'s plans for {', '.join(wide)} "
                             "use SP > 1: set worker_set: ray, or plan them at SP 1")
        return {"ray_actor_options": {"num_cpus": round(g.workers * cfg.worker_cpus, 4),
                                      **({"resources": dict(g.bundle_resources)} if g.bundle_resources else {})}}
    bundle = {**WORKER_KINDS[cfg.device].bundle(cfg.worker_cpus), **g.bundle_resources}
    bundles = [dict(bundle) for _ in range(g.workers)]
    if g.decode is not None:  # the decode pool's bundles follow the DiT workers' (serving/group/decode_pool.py)
        gpu = {"GPU": g.decode.gpus_per_worker} if WORKER_KINDS[cfg.device].num_gpus else {}
        bundles += [{"CPU": cfg.worker_cpus, **gpu, **g.bundle_resources} for _ in range(g.decode.workers)]
    return {"ray_actor_options": {"num_cpus": 0}, "placement_group_bundles": bundles,
            "placement_group_strategy": "STRICT_PACK"}


def group_settings(cfg: ServeConfig, g: ModelGroupConfig, table: PlanTable, reference: PlanTable,
                   plans: dict[str, PlanEntry], spare_host: int | None) -> tuple[ModelGroupConfig, GroupSettings]:
    """A group's config as its deployment gets it (its residency resolved from the table) and its
    ``GroupSettings`` (``table``: the one served, scaled on an emulated box; ``reference``: as planned)."""
    emulation = emulation_for(reference, cfg.time_scale_of(g.model), list(plans)) if cfg.device == "emulated" else None
    residency = g.residency or (table.residency[g.model].policy if g.model in table.residency else "per_template")
    settings = GroupSettings(
        device=cfg.device, worker_cpus=cfg.worker_cpus, worker_set=cfg.worker_set, jobs=cfg.jobs,
        layouts_dir=layouts_dir(cfg.plan_table) if cfg.plan_table is not None else None,
        preemption=preemption_policy(g, table, paused_host_bytes(spare_host, cfg), cfg.time_scale_of(g.model)),
        emulation=emulation, admission=table.admission.get(g.model),
        phases=phase_shares(table, plans), budget_bytes=table.budget_bytes,
    )
    return g.model_copy(update={"residency": residency}), settings


def shared_replica(cfg: ServeConfig, name: str, members: list[SharedMember]) -> Application:
    """The ``SharedReplica`` deployment ``name`` holding ``members`` (``shared_replicas:``): one replica that
    reserves what its groups' own replicas would have (their workers' CPUs and resources), and
    waits on removal as long as the slowest of them would."""
    cpus, resources, grace = 0.0, {}, 0.0
    for h in members:
        opts = worker_resources(cfg, h.config, h.plans)["ray_actor_options"]
        cpus += opts["num_cpus"]
        for k, v in opts.get("resources", {}).items():
            resources[k] = resources.get(k, 0.0) + v
        grace = max(grace, scaling_options(h.config, h.plans)["graceful_shutdown_timeout_s"])
    actor = {"num_cpus": round(cpus, 4), **({"resources": resources} if resources else {})}
    return serve.deployment(ServedSharedReplica, name=name, num_replicas=1, ray_actor_options=actor,
                            graceful_shutdown_timeout_s=grace, graceful_shutdown_wait_loop_s=0.5,
                            max_ongoing_requests=10_000, **HEALTH_CHECK).bind(members)


def build_app(args: dict[str, Any]) -> Application:
    """Compose the application from ``args`` (validated as ``ServeConfig``)."""
    cfg = resolve_plan_table(ServeConfig.model_validate(args))
    exposed = exposed_ports_warning()
    if exposed is not None:  # Ray is already bound: tell, loudly (docs/serving.md "Ports")
        logger.warning(exposed)
        print(f"WARNING: {exposed}", flush=True)
    templates = served_templates(cfg)
    preflight(cfg)  # weights and Redis: a clear start-up error, never a failure at the first request
    short = gpu_shortfall(cfg, ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else None
    if short is not None:  # an autoscaler may still add them: said loudly, not refused
        logger.warning(short)
        print(f"WARNING: {short}", flush=True)
    table, spare_host = load_or_plan(cfg, templates)
    reference = table
    if cfg.device == "emulated":  # the whole app runs on the emulated box's clock (each group on its own)
        table = scale_table(table, {g.model: cfg.time_scale_of(g.model) for g in cfg.models})
    ingress_options = {"num_cpus": 0, **({"resources": cfg.router_resources} if cfg.router_resources else {})}
    registry = adapter_registry(cfg, ingress_options)
    where = cfg.group_deployments()
    groups: dict[str, Any] = {}
    members: dict[str, list[SharedMember]] = {}
    for g in cfg.models:
        plans = {t.shape_key: table.lookup(t) for t in templates if t.model == g.model}
        config, settings = group_settings(cfg, g, table, reference, plans, spare_host)
        if where[g.model].startswith("SharedReplica:"):  # several groups in one replica process (shared_replicas)
            members.setdefault(where[g.model], []).append(SharedMember(config=config, plans=plans, settings=settings))
            continue
        deployment = serve.deployment(
            ServedModelGroup,
            name=f"ModelGroup:{g.model}",
            **scaling_options(g, plans),
            **worker_resources(cfg, g, plans),
            max_ongoing_requests=10_000,  # the dispatcher bounds its queues and answers 503 itself
            **HEALTH_CHECK,
        )
        shared = {"adapter_registry": registry} if registry is not None and replicated(g) and g.adapters else {}
        groups[g.model] = deployment.bind(config, plans, settings, **shared)
    for name, held in members.items():
        replica = shared_replica(cfg, name, held)
        groups.update({m.config.model: replica for m in held})
    stats = serve.deployment(Stats, name="Stats", ray_actor_options=dict(ingress_options), **HEALTH_CHECK).bind()
    # the Router answers overload itself (JSON 503 with Retry-After at limits.max_in_flight), so
    # Serve's own limits sit above it, by a whole queue's worth: requests past max_in_flight reach
    # the Router and are refused at once instead of waiting in Serve's queue in front of it, where
    # /healthz and /v1/stats would wait behind them. Serve's backpressure stays a last resort.
    in_flight = cfg.limits.max_in_flight
    router = serve.deployment(Router, name="Router", num_replicas=cfg.router_replicas,
                              max_ongoing_requests=max(cfg.max_ongoing_requests, in_flight + cfg.max_queued_requests),
                              max_queued_requests=cfg.max_queued_requests, ray_actor_options=dict(ingress_options),
                              **HEALTH_CHECK,
                              backpressure_config={"retry_after_s": 2})
    # the groups that scale to zero: the Router holds their requests while they wake (api/wake.py)
    wake = {g.model: wake_policy(g, table) for g in cfg.models if g.scales_to_zero}
    return router.bind(groups, table, list(templates), stats=stats, limits=cfg.limits, jobs=cfg.jobs, wake=wake,
                       emulated=cfg.device == "emulated", auth=cfg.auth, console_traces=trace_view,
                       adapter_pools={g.model: g.adapters for g in cfg.models if g.adapters is not None},
                       shared={m: name for m, name in where.items() if name.startswith("SharedReplica:")})
