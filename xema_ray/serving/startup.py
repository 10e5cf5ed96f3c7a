"""Start-up of the serving application: the served templates and the checks on their plan table
(every plan runnable by its model group, the weights' host memory within the node's).

Loading or computing the plan table at start-up (``load_or_plan``) runs the planner, so it is
composed where the app is built (``deployments.planning``): no library module of ``xema_ray``
imports ``planner``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from xema_ray import deployment
from xema_ray.host_budget import NodeHost, fmt_bytes, host_basis
from xema_ray.plan import ExecutionConfig, PlanTable
from xema_ray.platforms.host_memory import DEFAULT_SHM_DIR, shm_dir
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.group.settings import ModelGroupConfig
from xema_ray.templates import RequestTemplate


def served_templates(cfg: ServeConfig) -> list[RequestTemplate]:
    """Every configured template, validated (a bad one fails start-up with its reason)."""
    return deployment.served_templates(list(cfg.models))


class ShmSpace(BaseModel):
    """The tmpfs the node's shared weight segments go to, and what else plans to use it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    directory: Path
    free_bytes: int = Field(ge=0, description="its free bytes now (statvfs)")
    object_store_bytes: int = Field(default=0, ge=0, description="Ray's object store where it lies on this tmpfs "
                                                                 "(its pages are taken as objects arrive), else 0")

    @classmethod
    def here(cls) -> ShmSpace:
        """This node's: the segments' directory (``XEMA_SHM_DIR`` or /dev/shm), and Ray's object store
        when Ray has put it there (Ray's rule: /dev/shm when the store fits its size, else /tmp)."""
        directory = shm_dir()
        st = os.statvfs(directory)
        store = ray_object_store_bytes()
        on_it = directory == DEFAULT_SHM_DIR and 0 < store <= st.f_blocks * st.f_frsize
        return cls(directory=directory, free_bytes=st.f_bavail * st.f_frsize, object_store_bytes=store if on_it else 0)

    def problem(self, shared_bytes: int) -> str | None:
        """None when ``shared_bytes`` of segments fit beside the object store; else both, named. A
        node that plans no segment (the CPU demo, CI: nothing pinned) starts on a 64 MB /dev/shm."""
        if shared_bytes == 0 or shared_bytes + self.object_store_bytes <= self.free_bytes:
            return None
        beside = (f" beside Ray's object store of {fmt_bytes(self.object_store_bytes)} on the same tmpfs"
                  if self.object_store_bytes else "")
        return (f"{self.directory}: {fmt_bytes(self.free_bytes)} free, the node's workers plan "
                f"{fmt_bytes(shared_bytes)} of shared weight segments there{beside} (enlarge it: docker --shm-size, "
                "mount -o remount,size=...; or point XEMA_SHM_DIR at a larger tmpfs; or share_host_weights: off)")


def ray_object_store_bytes() -> int:
    """This node's Ray object store (0 when Ray is not started here)."""
    import ray

    if not ray.is_initialized():
        return 0
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return int(node.get("Resources", {}).get("object_store_memory", 0))
    return 0


class PlanNotRunnable(ValueError):
    """A plan table asks for a layout a model group cannot run, or more host memory than the node has."""


def check_runnable(table: PlanTable, cfg: ServeConfig, templates: list[RequestTemplate],
                   host_memory_bytes: int | None = None, shm: ShmSpace | None = None) -> int:
    """Refuse, before anything starts, a plan a model group cannot run: a decode pool
    (``config.decode``) where the group has none (``decode_problem``); its SP degree must divide the group's workers (every SP group is carved from the worker set) and SP × DP must fit in
    them; the group the table was planned for must be the deployment's (its DiT workers and its decode
    pool's GPUs, ``GroupShape.gpus``: a pool comes on top of ``workers``); the host memory the node's workers hold for their weights (``node_host``) must fit
    the node, while loading too; and their shared weight segments, beside Ray's object store where
    it lies on the same tmpfs, must fit that tmpfs's free bytes (``shm``: default ``ShmSpace.here()``).

    Returns:
        the host memory the node has left beyond those weights (for paused batches' state).

    Raises:
        PlanNotRunnable: naming the template, the plan and the group size, or the host bytes.
    """
    problems = []
    for g in cfg.models:
        for t in (t for t in templates if t.model == g.model):
            c = table.lookup(t).config
            problem = decode_problem(t.shape_key, c, g, cfg.device)
            if problem is not None:
                problems.append(problem)
            elif g.workers % c.sp:
                problems.append(f"{t.shape_key}: plan {c.describe()} needs SP groups of {c.sp} workers, but the "
                                f"{g.model} group has {g.workers} (SP must divide the group size)")
            elif c.gpus > g.workers:
                problems.append(f"{t.shape_key}: plan {c.describe()} uses {c.gpus} GPUs (SP {c.sp} x DP {c.dp}), "
                                f"the {g.model} group has {g.workers}")
        planned = table.group_gpus.get(g.model)
        if planned is not None and planned != g.gpus:
            pool = f" ({g.workers} DiT workers + a decode pool of {g.gpus - g.workers})" if g.decode is not None else ""
            problems.append(f"{g.model}: the table was planned for a group of {planned} GPUs, the deployment gives it "
                            f"{g.gpus}{pool} (re-plan with xema plan --deployment)")
    total, where = node_host_memory(cfg, host_memory_bytes)
    node = node_host(table, cfg, templates, total)
    if not node.fits:
        problems.append(f"host memory: the node's workers hold {fmt_bytes(node.resident_bytes)} of weights on the "
                        f"host, {fmt_bytes(node.load_peak_bytes)} while loading ({node.describe()}); {where} has "
                        f"{fmt_bytes(total)}")
    if cfg.device != "emulated":  # an emulated box's workers make no segments
        space = shm if shm is not None else ShmSpace.here()
        problem = space.problem(node.shared_bytes)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise PlanNotRunnable("plan table cannot run on this deployment:\n  " + "\n  ".join(problems))
    return total - node.resident_bytes


def decode_problem(key: str, c: ExecutionConfig, g: ModelGroupConfig, device: str) -> str | None:
    """What is wrong with serving ``key``'s plan ``c`` on group ``g``'s decode pool, None if nothing.
    A plan that hands its decode to a pool (``config.decode``) needs a group with one: its DiT
    config dropped the VAE mitigations the decode needs in place, so decoding it there would run
    past the budget it was planned for. On a GPU device each decode worker needs at least the GPU
    share the plan's decode peak was checked against."""
    if c.decode is None:
        return None
    if g.decode is None:
        return (f"{key}: plan {c.describe()} hands its decode to a decode pool of {c.decode.workers} worker(s) "
                f"x {c.decode.gpus_per_worker:g} GPU (config.decode, xema plan --stages split|auto), but the "
                f"{g.model} group has no decode: block, and its DiT config dropped the VAE mitigations the decode "
                "needs in place; add decode: {workers, gpus_per_worker} to the group, or serve a table planned "
                "with --stages joint")
    if device == "cuda" and g.decode.gpus_per_worker < c.decode.gpus_per_worker:
        return (f"{key}: plan {c.describe()} decodes on {c.decode.gpus_per_worker:g} GPU per decode worker, the "
                f"{g.model} group's decode.gpus_per_worker is {g.decode.gpus_per_worker:g} (its decode peak "
                "would not fit the smaller share)")
    return None


def node_host_memory(cfg: ServeConfig, given: int | None = None) -> tuple[int, str]:
    """(the node's RAM, what says so): ``given``, else the deployment's ``host_memory`` (and this
    machine's where it has less, serving on it), else the emulated node's, else this machine's."""
    from xema_ray.memory.analysis import parse_bytes

    if given is not None:
        return given, "the node"
    machine = node_memory_bytes()
    if cfg.host_memory is not None:
        stated = parse_bytes(cfg.host_memory)
        if cfg.device == "emulated" or stated <= machine:
            return stated, "the node (host_memory)"
        return machine, f"this machine (the deployment states host_memory {stated / 1e9:.1f} GB, but it)"
    if cfg.device == "emulated":
        return parse_bytes(cfg.emulated_host_memory), "the emulated node"
    return machine, "this machine"


def node_host(table: PlanTable, cfg: ServeConfig, templates: list[RequestTemplate],
              budget_bytes: int | None = None) -> NodeHost:
    """The host memory of one replica of every group on one node: each worker holds the largest of
    its templates' plans (all of their blocks under a shared residency), one copy of its shared
    segments per node where workers share them (CUDA and emulated GPUs). A group's worker figure is
    the table's own (``table.host``) where it was counted from the same plans, residency and sharing
    (``host_basis``); otherwise it is counted here, each model built on the meta device
    (``xema_ray.runtime.host_bytes``: seconds of imports)."""
    recorded = {g.model: g for g in table.host.groups} if table.host is not None else {}
    groups = []
    for g in cfg.models:
        share = g.share_host_weights == "on" or (g.share_host_weights == "auto" and cfg.device in ("cuda", "emulated"))
        configs = [table.lookup(t).config for t in templates if t.model == g.model]
        if not configs:
            continue
        shared = (g.residency or (table.residency[g.model].policy if g.model in table.residency
                                  else "per_template")) == "shared"
        basis = host_basis((c.config_hash() for c in configs), shared, share)
        known = recorded.get(g.model)
        if known is not None and known.basis == basis:
            groups.append(known.model_copy(update={"workers": g.workers}))
            continue
        from xema_ray.runtime.host_bytes import group_host

        groups.append(group_host(g.model, configs, g.workers, shared, share))
    return NodeHost.of(groups, budget_bytes)


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
                    check_weights_dir(get_model_spec(g.model).published_layout, g.model, g.weights_dir)
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
    asked = {g.model: (g.workers + (g.decode.gpus if g.decode is not None else 0)) * g.replicas for g in cfg.models}
    if sum(asked.values()) <= cluster_gpus:
        return None
    return (f"device: cuda: the groups' workers ask for {sum(asked.values()):g} GPUs ("
            + ", ".join(f"{m} {n:g}" for m, n in asked.items()) + f"), the Ray cluster has {cluster_gpus:g} now: "
            "the groups wait for them (nvidia-smi lists the machine's; CUDA_VISIBLE_DEVICES may hide some; without "
            "an autoscaler adding GPU nodes, they never come: docs/install-gpu.md)")
