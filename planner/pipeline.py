"""The planner as an ordered list of named passes (paper §7): what ``python -m planner plan``
(also ``xema plan`` and ``ray job submit -- python -m planner ...``) runs once ``planner.cli`` has
read its flags into a ``PlanRequest``.

``PASSES``, in order; each reads the fields of ``PlanState`` that earlier passes wrote and returns
the state with its own (``Pass.reads`` / ``Pass.writes``, checked as it runs):

- ``templates``: each template planned in its own Ray task (``planner.driver.plan_one``): the
  template's SLO, SP × DP × batch pruned by memory and the SLO, the mitigation of each pressure
  interval, the choice by goodput confirmed by a mitigated trace (``planner.stages``).
- ``load_aware``: with an expected load (``--load``), the configurations that load is served best
  with (``planner.load_aware``).
- ``groups``: each model group's ``GROUP_PASSES`` (residency, text-encoder placement, and for a
  two-expert model (Wan2.2-A14B) its plan at the expert switch made the template's entry:
  ``planner.finishing``, ``planner.expert_switch``; with ``--stages split|auto`` each video
  template's decode in place or on a pool of its own, ``planner.decode_stage``), then its layouts start
  (``planner.layouts.LayoutWave``: solved for the entries the worker will run, the swap
  included). No pass between ``templates`` and this one couples the groups without a load, so
  each group is then finished inside ``templates``, as soon as its last template is planned,
  while the others still plan; this pass has nothing left to do.
- ``expert_switch``: the finished groups' switch plans gathered for the summary and
  ``<table>.experts.json``.
- ``host_memory``: with a host budget, plans whose node fits it (``planner.host_choice``), the
  node counted from the finished entries, the expert switch's pinned experts included
  (``xema_ray.runtime.host_bytes.config_host_bytes``).
- ``table``: the plan table, its provenance and the node's host memory.
- ``layouts``: the static layouts solved, each entry pointing at its own.
- ``tiers``: each (template, quality tier) priced (``planner.tiers``); with ``--quality`` the
  entries are that tier's.
- ``write``: the table, the expert-switch plans and the statistics written.

A new pass (quality tiers, weight formats, a decode stage) is one more ``Pass`` in ``PASSES``,
with the fields it reads and writes; a new choice per model group is one more entry of
``planner.finishing.GROUP_PASSES``.

``plan`` prints nothing: it returns a ``PlanResult``, raises a ``PlanError`` (its ``exit_code``
is the command's) and reports what happens while it runs as ``PlanEvent`` values; ``planner.cli``
says all of it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from xema_ray.plan import (DecodeChoice, GroupResidency, PlanEntry, PlanProvenance, PlanTable, ReplicaStart,
                           TextEncoderChoice)
from xema_ray.tier_plan import QualityTierSpec
from xema_ray.profiling.hardware import HardwareProfile
from xema_ray.templates import RequestTemplate

from planner.cluster_fit import NoRoom, TaskShape, fit_tasks
from planner.driver import plan_all
from planner.expert_switch import ExpertSwitchPlan
from planner.finishing import GroupFinisher, finish_every_group
from planner.latency import LatencyModel
from planner.layouts import LayoutWave
from planner.load_aware import GroupLoad
from planner.task_io import PlanOptions, TemplateResult


# ---------------------------------------------------------------------------- what goes in and out
@dataclass(frozen=True)
class PlanRequest:
    """One planning run: the templates, the options every task is told, and what the run does
    with them beside planning."""

    templates: tuple[RequestTemplate, ...]
    opts: PlanOptions
    #: model -> its group's expected load (``--load``; empty: isolated goodput)
    loads: Mapping[str, GroupLoad] = field(default_factory=dict)
    #: the plan table JSON to write (None: written nowhere, and no layouts)
    out: str | None = None
    #: the per-template statistics JSON to write
    stats: str | None = None
    #: solve each entry's static layout next to ``out``
    layouts: bool = True
    #: plan in Ray tasks (False: in this process)
    use_ray: bool = True
    #: seconds to wait for a Ray cluster to have room for one planning task
    wait_s: float = 10.0
    #: the command recorded in the table's provenance (``planner.cli.recorded_command``)
    command: str = ""
    #: model -> its quality tiers (the deployment's ``quality_tiers``; absent: ``DEFAULT_TIERS``)
    tiers: Mapping[str, Mapping[str, QualityTierSpec]] = field(default_factory=dict)
    #: plan this one tier (``--quality``): the entries are the tier's; None: every tier priced beside lossless
    quality: str | None = None


@dataclass(frozen=True)
class LayoutReport:
    """What the ``layouts`` pass solved: the entries with their layouts (the expert switch's included),
    each entry's reserved bytes over the lower bound, the dynamic region per model, the entries
    left without a layout (why), and the time the layouts added."""

    entries: dict[str, PlanEntry]
    ratios: dict[str, float]
    dynamic_bytes: dict[str, int]
    not_armed: dict[str, str]
    budget_bytes: int
    #: seconds after the last template was planned until the last layout was solved
    wall_s: float
    #: CPU seconds in the layout tasks
    cpu_s: float


@dataclass(frozen=True)
class Written:
    """The files a run wrote (None: not asked for, or nothing to write)."""

    table: Path | None = None
    experts: Path | None = None
    stats: Path | None = None


@dataclass(frozen=True)
class FinishedGroups:
    """The model groups' final entries, residencies, text-encoder placements and decode choices."""

    entries: dict[str, PlanEntry]
    residency: dict[str, GroupResidency]
    encoders: dict[str, TextEncoderChoice]
    decodes: dict[str, DecodeChoice] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanState:
    """What the passes hand each other; each field is written by the passes that name it."""

    #: every template's task result, in the templates' order
    results: tuple[TemplateResult, ...] = ()
    #: seconds from the start until the last template was planned
    planned_s: float = 0.0
    #: the table chosen under the expected load (admission policies, planned loads)
    loaded: PlanTable | None = None
    groups: FinishedGroups | None = None
    table: PlanTable | None = None
    layouts: LayoutReport | None = None
    #: each two-expert template's plan at the expert switch, and the shape keys of the entries it replaced
    switches: tuple[ExpertSwitchPlan, ...] = ()
    switched: tuple[str, ...] = ()
    #: seconds from the start until the table was complete
    total_s: float = 0.0
    written: Written = Written()


@dataclass(frozen=True)
class PlanResult:
    """What ``plan`` returns: the table and what ``planner.cli`` prints of the run."""

    table: PlanTable
    results: tuple[TemplateResult, ...]
    #: the text-encoder placement chosen per entry
    encoders: dict[str, TextEncoderChoice]
    layouts: LayoutReport | None
    switches: tuple[ExpertSwitchPlan, ...]
    switched: tuple[str, ...]
    planned_s: float
    total_s: float
    written: Written


class PlanError(Exception):
    """Planning stopped; ``exit_code`` is what the command exits with."""

    exit_code: ClassVar[int] = 1


class PlanRefused(PlanError):
    """The request cannot be planned as asked: the load names what is not planned, or no plan
    keeps the node's host memory within the host budget (the message names the bytes)."""

    exit_code = 2


class NoRoomForTasks(PlanError):
    """The Ray cluster had no room for one planning task in time (the message says who holds it)."""

    exit_code = 3


@dataclass(frozen=True)
class TasksSized:
    """The planning tasks' resource request is known (before any is submitted)."""

    note: str


@dataclass(frozen=True)
class LayoutsSkipped:
    """Layouts were asked for without a table to write them next to."""


@dataclass(frozen=True)
class HostReplanning:
    """The node's host memory while loading is over the host budget: every template is planned
    again, sending its other candidates."""

    load_peak_bytes: int
    host_budget: int


PlanEvent = TasksSized | LayoutsSkipped | HostReplanning


# ---------------------------------------------------------------------------- the passes
@dataclass
class PlanRun:
    """What the passes share beside the state: the request and the run's machinery, set up once
    (the tasks' resource shape, the latency model, the layout wave, the group finisher)."""

    request: PlanRequest
    shape: TaskShape | None
    latency: LatencyModel
    wave: LayoutWave | None
    finisher: GroupFinisher
    started: float
    notify: Callable[[PlanEvent], None]


PassFn = Callable[[PlanRun, PlanState], PlanState]


@dataclass(frozen=True)
class Pass:
    """One named pass: the ``PlanState`` fields it reads (written by an earlier pass) and those it
    writes (the only ones it may change)."""

    name: str
    run: PassFn
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    #: a ValueError it raises refuses the request (exit 2) rather than being a fault
    refuses: bool = False


def _snapshot(finisher: GroupFinisher) -> FinishedGroups:
    return FinishedGroups(dict(finisher.entries), dict(finisher.residency), dict(finisher.encoders),
                          dict(finisher.decodes))


def templates_pass(run: PlanRun, state: PlanState) -> PlanState:
    """Every template planned in its task; without an expected load each group is finished as
    soon as its last template is planned."""
    req = run.request
    results = plan_all(list(req.templates), req.opts, use_ray=req.use_ray,
                       on_group=None if req.loads else run.finisher.finish, shape=run.shape)
    return dataclasses.replace(state, results=tuple(results), planned_s=time.perf_counter() - run.started)


def load_aware_pass(run: PlanRun, state: PlanState) -> PlanState:
    """The configurations chosen for each group's expected load: the goodput choices compete with
    the other assembled configurations there. A ValueError where the load names what is not planned."""
    from planner.load_aware import plan_groups_for_load

    req = run.request
    if not req.loads:
        return state
    opts, results = req.opts, state.results
    planned = {r.template: r.entry for r in results if r.entry is not None}
    draft = PlanTable(hardware="planning", gpus=opts.gpus, budget_bytes=opts.budget, group_gpus=opts.group_gpus,
                      entries=planned)
    alts = {r.template: [r.entry, *r.candidates] for r in results if r.entry is not None}
    loaded = plan_groups_for_load(draft, alts, {r.template: r.slo_s for r in results if r.entry is not None},
                                  dict(req.loads))
    return dataclasses.replace(state, loaded=loaded)


def groups_pass(run: PlanRun, state: PlanState) -> PlanState:
    """Every group not finished yet (under a load: all of them, from the load's choices)."""
    if state.loaded is not None:
        finish_every_group(list(state.results), list(run.request.templates), run.finisher, dict(state.loaded.entries))
    return dataclasses.replace(state, groups=_snapshot(run.finisher))


def host_memory_pass(run: PlanRun, state: PlanState) -> PlanState:
    """The finished groups within the host budget: as planned where their node fits (the usual
    case: nothing more to do), else planned again with every template's other candidates and
    fitted (``planner.host_choice``; the layouts of changed entries are solved anew). A
    ``HostBudgetError`` (a ValueError) names the bytes when none fits."""
    from planner.host_choice import node_host

    req, groups = run.request, run.finisher
    opts = req.opts
    if opts.host_budget is None:
        return state
    results = list(state.results)
    if not groups.defer:
        node = node_host(groups.entries, groups.residency, opts.dit_workers(), opts.gpus, opts.host_budget,
                         share=opts.hardware != "cpu")
        if node.fits:
            return state
        run.notify(HostReplanning(node.load_peak_bytes, opts.host_budget))
        results = plan_all(list(req.templates), opts.model_copy(update={"send_candidates": True}), use_ray=req.use_ray,
                           shape=run.shape)
        groups.defer = True
        finish_every_group(results, list(req.templates), groups)
    groups.fit_host(results)
    # a group finished here (deferred, or planned again) makes its switch plans here
    return _with_switches(run, dataclasses.replace(state, results=tuple(results), groups=_snapshot(groups)))


def replica_starts(models: list[str], hardware: HardwareProfile | None) -> dict[str, ReplicaStart]:
    """Each model's predicted replica start, cold and warm, from measured figures (the wake time
    of a group scaled to zero: ``xema_ray.profiling.replica_start``)."""
    from xema_ray.profiling.replica_start import predict_start, start_figures
    from xema_ray.runtime.host_bytes import model_weight_bytes

    figures = start_figures(hardware)
    return {m: predict_start(model_weight_bytes(m), figures) for m in models}


def table_pass(run: PlanRun, state: PlanState) -> PlanState:
    """The finished groups' entries in the templates' order, with the run's provenance and the
    node's host memory."""
    from planner.host_choice import with_node_host

    opts, results, groups, loaded = run.request.opts, state.results, state.groups, state.loaded
    assert groups is not None  # the groups pass ran
    in_order = [r.template for r in results if r.template in groups.entries]
    table = PlanTable(
        replica_start=replica_starts(sorted({groups.entries[k].config.template.model for k in in_order}),
                                     None if opts.hardware == "cpu" else run.latency.hardware),
        hardware=LatencyModel(opts.hardware).fingerprint(opts.gpus), gpus=opts.gpus, budget_bytes=opts.budget,
        group_gpus=opts.group_gpus, slo_scale=opts.slo_scale, planner=opts.planner,
        adapter_pools={m: opts.adapter_pools[m] for m in sorted(opts.adapter_pools)},
        residency={m: groups.residency[m] for m in sorted(groups.residency)},
        entries={k: groups.entries[k] for k in in_order}, admission=loaded.admission if loaded else {},
        planned_load=loaded.planned_load if loaded else {},
        provenance=PlanProvenance(
            command=run.request.command, wall_s=round(state.planned_s, 1), profiled=sum(r.profiled for r in results),
            tasks_cpu_s=round(sum(r.cpu_s for r in results), 1),
            text_encoders={k: groups.encoders[k] for k in in_order if k in groups.encoders},
            decode_stages={k: groups.decodes[k] for k in in_order if k in groups.decodes},
            measured=sum(r.measured for r in results), estimated=sum(r.estimated for r in results),
            infeasible=tuple(r.template for r in results if r.entry is None),
            planned_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
    )
    table = with_node_host(table, share=opts.hardware != "cpu", budget_bytes=opts.host_budget)
    return dataclasses.replace(state, table=table)


def layouts_pass(run: PlanRun, state: PlanState) -> PlanState:
    """The table with the layouts the wave solved (each entry referencing its layout, its peak what
    the worker holds with it armed) and their provenance."""
    table, wave = state.table, run.wave
    assert table is not None  # the table pass ran
    if wave is None:
        return dataclasses.replace(state, total_s=time.perf_counter() - run.started)
    budget = table.budget_bytes
    solved, ratios, layout_cpu = wave.collect(budget)
    # the wall time the layouts add after the last template is planned (they start while others plan)
    layout_wall = time.perf_counter() - (run.started + state.planned_s)
    table = table.model_copy(update={"entries": {k: solved[k] for k in table.entries},
                                     "provenance": table.provenance.model_copy(update=dict(
                                         layouts_wall_s=round(layout_wall, 1), layouts_cpu_s=round(layout_cpu, 1),
                                         layouts_gpu=run.latency.hardware.gpu_model,
                                         layouts_dynamic_bytes=dict(sorted(wave.dynamic_bytes.items())),
                                         layouts_not_armed=dict(sorted(wave.not_armed.items()))))})
    report = LayoutReport(entries=dict(table.entries), ratios=dict(ratios), dynamic_bytes=dict(wave.dynamic_bytes),
                          not_armed=dict(wave.not_armed), budget_bytes=budget, wall_s=layout_wall, cpu_s=layout_cpu)
    return dataclasses.replace(state, table=table, layouts=report, total_s=time.perf_counter() - run.started)


def expert_switch_pass(run: PlanRun, state: PlanState) -> PlanState:
    """Two-expert models (Wan2.2-A14B): the switch plans the groups' ``expert_switch`` pass made
    their templates' entries (``ExecutionConfig.experts``: the worker executes it), in the
    templates' order, and the shape keys of those entries."""
    assert state.groups is not None  # the groups pass ran
    return _with_switches(run, state)


def _with_switches(run: PlanRun, state: PlanState) -> PlanState:
    """``state`` with the switch plans of its finished groups (``GroupFinisher.switches``)."""
    groups = state.groups
    by_key = {p.template: p for plans in run.finisher.switches.values() for p in plans}
    templates = [t for t in run.request.templates if t.key in by_key and groups and t.shape_key in groups.entries]
    switches, switched = tuple(by_key[t.key] for t in templates), tuple(t.shape_key for t in templates)
    if (switches, switched) == (state.switches, state.switched):
        return state
    return dataclasses.replace(state, switches=switches, switched=switched)


def tiers_pass(run: PlanRun, state: PlanState) -> PlanState:
    """Each (template, quality tier) priced (``planner.tiers``): latency with the tier's computed
    steps, memory with its cached outputs; ``--quality`` makes each entry the tier's."""
    from planner.tiers import TierNotServed, price_tiers

    assert state.table is not None  # the table pass ran
    try:
        table = price_tiers(state.table, run.request.tiers, run.request.quality)
    except TierNotServed as e:
        raise PlanRefused(str(e)) from None
    return dataclasses.replace(state, table=table)


def write_pass(run: PlanRun, state: PlanState) -> PlanState:
    """The table (with the run's total time), the expert-switch plans beside it, the statistics."""
    from planner.expert_switch import ExpertSwitchFile

    req, table = run.request, state.table
    assert table is not None  # the table pass ran
    experts = None
    if state.switches and req.out:
        experts = Path(req.out).with_suffix(".experts.json")
        ExpertSwitchFile(plans=list(state.switches)).save(experts)
    table.provenance.total_s = round(state.total_s, 1)
    if req.out:
        table.save(req.out)
    if req.stats:
        Path(req.stats).write_text(json.dumps(
            {"wall_s": state.planned_s, "results": [r.model_dump(mode="json") for r in state.results]}, indent=1))
    return dataclasses.replace(state, written=Written(table=Path(req.out) if req.out else None, experts=experts,
                                                      stats=Path(req.stats) if req.stats else None))


#: the planner's passes, in order (the module's docstring says what each does)
PASSES: tuple[Pass, ...] = (
    Pass("templates", templates_pass, reads=(), writes=("results", "planned_s")),
    Pass("load_aware", load_aware_pass, reads=("results",), writes=("loaded",), refuses=True),
    Pass("groups", groups_pass, reads=("results", "loaded"), writes=("groups",), refuses=True),
    Pass("expert_switch", expert_switch_pass, reads=("groups",), writes=("switches", "switched")),
    Pass("host_memory", host_memory_pass, reads=("results", "groups", "switches"),
         writes=("results", "groups", "switches", "switched"), refuses=True),
    Pass("table", table_pass, reads=("results", "planned_s", "loaded", "groups"), writes=("table",)),
    Pass("layouts", layouts_pass, reads=("table", "planned_s"), writes=("table", "layouts", "total_s")),
    Pass("tiers", tiers_pass, reads=("table",), writes=("table",), refuses=True),
    Pass("write", write_pass, reads=("table", "switches", "total_s", "planned_s", "results"), writes=("written",)),
)


def run_passes(run: PlanRun, passes: tuple[Pass, ...] = PASSES, state: PlanState | None = None) -> PlanState:
    """``passes`` in order over ``state``; a pass that changes a field it does not write is a
    programming error (RuntimeError naming it)."""
    state = state or PlanState()
    names = [f.name for f in dataclasses.fields(PlanState)]
    for p in passes:
        try:
            after = p.run(run, state)
        except ValueError as e:
            if p.refuses:
                raise PlanRefused(str(e)) from e
            raise
        changed = {n for n in names if getattr(after, n) is not getattr(state, n)}
        if changed - set(p.writes):
            raise RuntimeError(f"pass {p.name} changed {sorted(changed - set(p.writes))}; it writes {list(p.writes)}")
        state = after
    return state


def _block_sizes(templates: tuple[RequestTemplate, ...]) -> threading.Thread:
    """What the residency choice needs from each model (its DiT blocks' weight bytes: a meta build
    of the transformer, seconds with its imports), prepared on a thread while the tasks run."""
    from xema_ray.runtime.residency import block_sizes

    return threading.Thread(target=lambda: [block_sizes(t.spec) for t in {t.model: t for t in templates}.values()],
                            name="block-sizes", daemon=True)


def plan(request: PlanRequest, on_event: Callable[[PlanEvent], None] | None = None) -> PlanResult:
    """Plan ``request.templates`` through ``PASSES``: Ray tasks (or this process), each model group
    finished, the static layouts solved next to ``request.out``, the table and the statistics
    written. Prints nothing.

    Args:
        request: what to plan and what to do with the plans.
        on_event: told what happens while the run goes on (``PlanEvent``), e.g. to print it.

    Raises:
        NoRoomForTasks: the cluster had no room for a planning task within ``request.wait_s``.
        PlanRefused: the load names what is not planned, or no plan fits the host budget.

    Example:
        >>> from xema_ray.templates import named_templates
        >>> opts = PlanOptions(hardware="a6000", budget=20 * 2**20, gpus=2)
        >>> result = plan(PlanRequest(tuple(named_templates("tiny", None)), opts, layouts=False, use_ray=False))
        >>> result.written.table is None  # no ``out``: the table is returned, not written
        True
    """
    from planner.tiers import quality_weights

    notify = on_event or (lambda _event: None)
    t0 = time.perf_counter()
    if request.quality is not None and not request.opts.weights:  # a quantized tier plans with its weights
        weights = quality_weights(request.quality, [t.model for t in request.templates], request.tiers,
                                  request.opts.hardware)
        request = dataclasses.replace(request, opts=request.opts.model_copy(update={"weights": weights}))
    opts = request.opts
    shape = None
    if request.use_ray:
        from planner.boot import init_ray

        init_ray()
        try:
            shape = fit_tasks(opts.hardware, opts.measure, wait_s=request.wait_s)
        except NoRoom as e:
            raise NoRoomForTasks(str(e)) from e
        notify(TasksSized(shape.note))
    sizes = _block_sizes(request.templates)
    if request.use_ray:
        sizes.start()
    latency = LatencyModel(opts.hardware, store_path=opts.profile_store)
    if request.layouts and not request.out:
        notify(LayoutsSkipped())
    wave = (LayoutWave(request.out, latency.hardware.gpu_model, use_ray=request.use_ray,
                       num_cpus=shape.num_cpus if shape else 1.0)
            if request.layouts and request.out else None)
    # with an expected load the groups' choices are made together, after every template is planned
    # (with a host budget too, fitted then: planner.host_choice)
    finisher = GroupFinisher(opts, latency, wave, sizes, defer=bool(request.loads) and opts.host_budget is not None)
    state = run_passes(PlanRun(request, shape, latency, wave, finisher, t0, notify))
    assert state.table is not None and state.groups is not None  # the table and groups passes ran
    return PlanResult(table=state.table, results=state.results, encoders=state.groups.encoders,
                      layouts=state.layouts, switches=state.switches, switched=state.switched,
                      planned_s=state.planned_s, total_s=state.total_s, written=state.written)
