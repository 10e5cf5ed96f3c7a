"""The operator view's data (``GET /v1/console/operator``), assembled by the Router from what it
already holds (the plan table, the groups' health) and asks for now (each group's replica
summaries, static-layout and preemption counters, Serve's replica counts and targets).

The observed SLO attainment per template is the groups' own: each replica's window of finished
requests (``LoadMetrics``, the ``xema_slo_attainment`` gauge's counts) — synchronous requests and
video jobs alike, a request failed alone or shed counted as missed — summed over the replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from xema_ray.plan import PlanTable
from xema_ray.serving.console.schemas import Attainment, GroupView, OperatorView, PlanRow, mitigation_label
from xema_ray.serving.group.handle import GroupHandle
from xema_ray.serving.group.load_metrics import GroupLoad
from xema_ray.serving.group.preemption import PreemptionReport
from xema_ray.serving.messages import GroupLayoutStats
from xema_ray.serving.scale.replica_summary import ReplicaSummary
from xema_ray.serving.stats import StatsResponse
from xema_ray.templates import RequestTemplate

#: longest wait for one group's answers (a slow group shows what is known, never blocks the view)
ASK_TIMEOUT_S = 3.0


def attainment_of(loads: list[GroupLoad]) -> dict[str, Attainment]:
    """Per template, the replicas' attainment windows summed (each replica once).

    Example:
        >>> from xema_ray.serving.group.load_metrics import TemplateLoad
        >>> a = GroupLoad(model="m", replica="r1", templates={"t": TemplateLoad(window_met=3, window_finished=4)})
        >>> b = GroupLoad(model="m", replica="r2", templates={"t": TemplateLoad(window_met=1, window_finished=4)})
        >>> attainment_of([a, b])["t"].fraction
        0.5
    """
    out: dict[str, Attainment] = {}
    for load in loads:
        for key, t in load.templates.items():
            got = out.get(key)
            met, n = t.window_met + (got.met if got else 0), t.window_finished + (got.requests if got else 0)
            out[key] = Attainment(requests=n, met=met, fraction=met / n if n else None, window_s=load.window_s)
    return out


def plan_rows(model: str, served: dict[str, RequestTemplate], table: PlanTable,
              layouts: GroupLayoutStats | None) -> list[PlanRow]:
    rows = []
    for key, t in sorted(served.items()):
        if t.model != model or key not in table.entries:
            continue
        e = table.entries[key]
        st = layouts.templates.get(key) if layouts is not None else None
        armed = bool(st is not None and st.armed_batches and st.not_armed is None)
        if armed:
            why = f"armed: {st.armed_batches} of {st.batches} batches, {st.hits} allocations placed"  # type: ignore[union-attr]
        elif st is not None and st.not_armed:
            why = f"not armed: {st.not_armed}"
        elif e.config.layout_ref is None:
            why = "not armed: the plan names no static layout" + (f" ({layouts.status})" if layouts is not None else "")
        else:
            why = layouts.status if layouts is not None else "no answer from the group yet"
        rows.append(PlanRow(
            template=key, kind=t.spec.kind, config=e.config.describe(),
            mitigations=[mitigation_label(m) for m in e.config.mitigations],
            predicted_latency_s=e.prediction.latency_s, predicted_peak_bytes=e.prediction.peak_bytes,
            slo_s=e.prediction.slo_s, budget_bytes=table.budget_bytes, layout_armed=armed, layout_why=why,
            runner_up=e.runner_up))
    return rows


async def _ask(call: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await asyncio.wait_for(call(), timeout=ASK_TIMEOUT_S)
    except Exception:  # a group being replaced, or slow: shown as unknown
        return None


async def replica_summaries(handle: GroupHandle, replicas: int) -> list[ReplicaSummary]:
    """Each replica's summary: ``2 × replicas`` calls through the handle (Serve spreads them over
    the replicas), one kept per replica (with one replica: exactly its summary)."""
    answers = await asyncio.gather(*(_ask(handle.replica_summary) for _ in range(max(1, 2 * replicas))))
    out: dict[str, ReplicaSummary] = {}
    for a in answers:
        if a is not None:
            s = ReplicaSummary.model_validate(a)
            if s.replica not in out or out[s.replica].t < s.t:
                out[s.replica] = s
    return [out[k] for k in sorted(out)]


async def replica_loads(handle: GroupHandle, replicas: int) -> list[GroupLoad]:
    """Each replica's load figures (``load_stats``), asked as ``replica_summaries`` asks: one kept
    per replica."""
    answers = await asyncio.gather(*(_ask(handle.load_stats) for _ in range(max(1, 2 * replicas))))
    out: dict[str, GroupLoad] = {}
    for a in answers:
        if a is not None:
            load = GroupLoad.model_validate(a)
            out.setdefault(load.replica or "", load)
    return [out[k] for k in sorted(out)]


def serve_targets(app_name: str, deployments: Mapping[str, str]) -> dict[str, tuple[int, int, str | None]]:
    """Per model (``deployments``: model -> the deployment that runs its group): Serve's running replicas, its target replicas and the autoscaling bounds
    (``ServeInstanceDetails``, what ``serve.status()`` reads; blocking: call it in a thread)."""
    import ray
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    if not ray.is_initialized():  # a Router outside Ray (in-process tests): asking would start a cluster
        return {}
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return {}
    details = ServeInstanceDetails(**client.get_serve_details())
    app = details.applications.get(app_name)
    out: dict[str, tuple[int, int, str | None]] = {}
    if app is None:
        return out
    for m, name in deployments.items():
        d = app.deployments.get(name)
        if d is None:
            continue
        running = sum(1 for r in d.replicas if str(getattr(r.state, "value", r.state)) == "RUNNING")
        a = d.deployment_config.autoscaling_config
        bounds = None
        if isinstance(a, dict) and a:
            bounds = f"{a.get('min_replicas')}..{a.get('max_replicas')} replicas"
            spec = ((a.get("policy") or {}).get("policy_kwargs") or {}).get("spec") or {}
            if "target_attainment" in spec:
                bounds += f", target attainment {spec['target_attainment']}"
        out[m] = (running, d.target_num_replicas, bounds)
    return out


def _app_name() -> str | None:
    from ray import serve

    try:
        return serve.get_replica_context().app_name
    except Exception:  # not inside a Serve replica (in-process tests)
        return None


async def operator_view(router: Any, stats: StatsResponse) -> OperatorView:
    """The whole view, every group asked concurrently (``router``: the Router replica; ``stats``:
    its ``/v1/stats`` answer)."""
    models = sorted(router.groups)
    app_name = _app_name()
    deployments = {m: getattr(router.groups[m], "deployment", None) or f"ModelGroup:{m}" for m in models}
    targets = (await _ask(lambda: asyncio.to_thread(serve_targets, app_name, deployments)) if app_name else None) or {}

    async def group(m: str) -> GroupView:
        report = router.health.report(m)
        extra = report.model_extra or {}
        running_n, target_n, bounds = targets.get(m, (None, None, None))
        replicas: list[ReplicaSummary] = []
        loads: list[GroupLoad] = []
        if not router.health.quiet(m):  # a group scaled to zero is not asked: a call would wake it
            replicas, loads = await asyncio.gather(replica_summaries(router.groups[m], running_n or 1),
                                                   replica_loads(router.groups[m], running_n or 1))
        attainment = attainment_of(loads)
        layouts: GroupLayoutStats | None = stats.static_layouts.get(m)
        if layouts is not None and layouts.status.startswith("unavailable"):
            layouts = None
        pre: PreemptionReport | None = stats.preemption.get(m)
        queued = sum(q.queued for s in replicas for q in s.queues.values()) if replicas else int(extra.get("queued", 0))
        running = sum(1 for s in replicas for b in s.running if not b.paused) if replicas else int(extra.get("running", 0))
        paused = sum(1 for s in replicas for b in s.running if b.paused) if replicas else int(extra.get("paused", 0))
        return GroupView(
            model=m, status=report.status, reason=report.reason, workers=int(extra.get("workers", 0)),
            plans=plan_rows(m, router.served, router.table, layouts), queued=queued, running=running, paused=paused,
            replicas=replicas, replicas_running=running_n, replicas_target=target_n, autoscaling=bounds,
            attainment={k: v for k, v in attainment.items() if k in router.served and router.served[k].model == m},
            preemption=pre, static_layouts=layouts)

    groups = await asyncio.gather(*(group(m) for m in models))
    return OperatorView(t=time.time(), hardware=router.table.hardware, budget_bytes=router.table.budget_bytes,
                        received=stats.received, groups=list(groups))
