"""The planning driver (paper §7): what ``python -m planner plan`` (also ``xema plan`` and ``ray job
submit -- python -m planner ...``) runs once ``planner.cli`` has read its flags.

Each template is planned in its own Ray task (``plan_one``: ``PlanOptions`` in, ``TemplateResult``
out). When the cluster has GPUs, the task holds one (``num_gpus=1``), builds the model there with
random weights at its real config and measures the candidates with the segment-reuse profiler
(``planner.measure``; profile store keyed by the GPU's NVML fingerprint); the roofline cost model
answers only for what one GPU cannot measure (SP > 1, out of memory) and for what-if planning
(``--hardware a6000`` on another GPU). On a cluster without GPUs the tasks request none and use the
cost model (``--hardware cpu``: this CPU is measured). Every plan entry says which
(``latency_source``), and the statistics count the candidates measured and estimated.

A model group is finished as soon as its last template is planned, while the others still plan
(``GroupFinisher``): its residency policy (``planner.residency_choice``), each template's
text-encoder placement (``planner.text_encoder``), then its static layouts start
(``planner.layouts.LayoutWave``). With an expected load (``--load``) the groups are finished
together after every template is planned, from the configurations chosen under that load
(``planner.load_aware``). The table (``plan_table``) then takes the layouts' entries and the run's
provenance (``xema_ray.plan.PlanProvenance``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TextIO

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.memory.analysis import gb
from xema_ray.plan import ExecutionConfig, LoraPoolConfig, PlanEntry, PlanProvenance, PlanTable, TextEncoderChoice
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import LatencySource
from xema_ray.profiling.hardware import HardwareProfile

from planner.baselines import SearchSpace, run_baseline
from planner.cluster_fit import NoRoom, TaskShape, fit_tasks
from planner.latency import LatencyModel, combine
from planner.layouts import LayoutWave
from planner.load_aware import GroupLoad
from planner.measure import DeviceLatency, task_device
from planner.finishing import GroupFinisher, finish_group, finish_under_load, merged_encoder_facts  # noqa: F401
from planner.text_encoder import EncoderFacts


class PlanOptions(BaseModel):
    """What every planning task of one run is told (``plan_one``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hardware: str = Field(description="hardware profile for latency (planner.latency.hardware_names)")
    budget: int = Field(description="per-GPU memory budget, bytes")
    gpus: int = Field(description="GPUs a template may use where its model has no group of its own")
    group_gpus: dict[str, int] = Field(default_factory=dict, description="model -> GPUs of its deployment group")
    slo_scale: float = 1.0
    max_batch: int = 8
    planner: str = Field(default="xema", description="xema or a baseline (planner.baselines.BASELINES)")
    trace_cache: str | None = Field(default=None, description="directory keeping analyzer traces (JSON)")
    time_limit_s: float | None = Field(default=None, description="seconds per template for grid-style baselines")
    profile_store: str | None = Field(default=None, description="profile store JSON (measurements reused)")
    measure: Literal["auto", "always", "never"] = "auto"
    text_encoder: Literal["plan", "none"] = Field(
        default="none", description="plan: the task measures the text encoder's facts for its placement")
    loaded_models: tuple[str, ...] = Field(
        default=(), description="models with an expected load: their tasks send their other candidates too")
    host_budget: int | None = Field(
        default=None, ge=1, description="host memory per node, bytes (--host-budget, or the deployment's host_memory): "
                                        "plans whose node fits it are preferred (planner.host_choice)")
    send_candidates: bool = Field(
        default=False, description="every task sends its other candidates (the host budget's second pass)")
    adapter_pools: dict[str, LoraPoolConfig] = Field(
        default_factory=dict, description="model -> its group's LoRA adapter pool (the deployment's adapters:): "
                                          "its plans are traced with the pool and every sample's adapters")


class TemplateResult(BaseModel):
    """What one planning task sends back (``plan_one``; Ray pickles it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    template: str = Field(description="the template's shape key")
    slo_s: float | None = Field(description="the SLO it was planned for (None: no configuration fits the budget)")
    entry: PlanEntry | None = Field(description="the chosen plan (None: infeasible)")
    candidates: tuple[PlanEntry, ...] = Field(
        default=(), description="its other assembled configurations, when its model group has an expected load")
    encoder_facts: EncoderFacts | None = Field(default=None, description="what placing its text encoder needs")
    device: str = Field(description="where candidates were measured: cuda, cpu, or none (the cost model)")
    traced: int = Field(description="analyzer traces taken (not found in the trace cache)")
    profiled: int = Field(description="candidates whose latency was asked")
    analysed: int = Field(description="candidates whose memory was analysed")
    finished: bool = Field(description="False: a baseline stopped at its time limit")
    pruned_memory: int | None = Field(default=None, description="Xema: candidates pruned for memory")
    pruned_slo: int | None = Field(default=None, description="Xema: candidates pruned for the SLO")
    measured: int = Field(description="candidates' latencies measured")
    estimated: int = Field(description="candidates' latencies estimated")
    not_measured: tuple[str, ...] = Field(default=(), description="measuring on the device failed: why (first 5)")
    seconds: float = Field(description="the task's wall time")
    cpu_s: float = Field(description="the task's CPU time (other jobs stretch only the wall time)")
    started_unix: float = Field(description="when the task started, for the planning timeline")
    worker_pid: int


def plan_one(template: RequestTemplate, opts: PlanOptions) -> TemplateResult:
    """Plan one template (runs inside a Ray task or in-process)."""
    from planner.load_aware import load_candidates
    from planner.pause_state import with_pause_bytes
    from planner.stages import CountingModel, plan_template
    from planner.text_encoder import encoder_facts
    from planner.trace_model import TracePlannerModel
    from planner.traces import TraceCache

    t0, started, cpu0 = time.perf_counter(), time.time(), time.process_time()
    latency = LatencyModel(opts.hardware, store_path=opts.profile_store)
    gpus = opts.group_gpus.get(template.model, opts.gpus)  # the template's own group
    device = task_device(opts.hardware, opts.measure)
    timer: LatencyModel | DeviceLatency = latency
    if device is not None:
        timer = DeviceLatency(template, latency, device)
        latency.on_device(timer.fingerprint)  # estimates calibrated by this device's measurements
    elif opts.hardware == "cpu":
        latency.calibrate([template])  # measure SP 1 / batch 1 here; the cost model scales from it
    cache = TraceCache(Path(opts.trace_cache) if opts.trace_cache else None, adapters=opts.adapter_pools)
    model = TracePlannerModel(template, timer.seconds, cache)
    counting = CountingModel(model)
    xema = plan_template(counting, template, gpus, opts.budget, slo_scale=opts.slo_scale, max_batch=opts.max_batch,
                         latency_source=LatencySource.ESTIMATED)
    traced = cache.traced  # the stages' traces (as counted before: not a baseline's, the pause state's, the encoder's)
    pruned_memory = pruned_slo = None
    if opts.planner == "xema":
        entry, counter, finished = xema.entry, xema.counter, True
        pruned_memory, pruned_slo = len(xema.log.pruned_memory), len(xema.log.pruned_slo)
    elif xema.slo_s is None:
        entry, counter, finished = None, None, True
    else:
        space = SearchSpace(gpus=gpus, budget=opts.budget, slo_s=xema.slo_s, max_batch=opts.max_batch)
        entry, counted, finished = run_baseline(opts.planner, model, template, space, LatencySource.ESTIMATED,
                                                time_limit_s=opts.time_limit_s)
        counter = counted.counter
    profiled, analysed = (len(counter.profiled), len(counter.analysed)) if counter is not None else (0, 0)
    candidates: tuple[PlanEntry, ...] = ()
    if entry is not None and opts.planner == "xema" and (template.model in opts.loaded_models or opts.send_candidates):
        # a load is expected for this model's group: its other assembled configurations compete
        # under that load in the driver (planner.load_aware)
        candidates = tuple(with_pause_bytes(with_latency_source(e, timer), cache)
                           for e in load_candidates(counting, xema.ranked, opts.budget, xema.slo_s or 0.0,
                                                    LatencySource.ESTIMATED)[1:])
    facts = None
    if entry is not None:
        entry = with_pause_bytes(with_latency_source(entry, timer), cache)
        if opts.text_encoder == "plan" and template.spec.text_encoder is not None:
            # measured here, where the model's meta pipeline is built already and in parallel
            # with the other tasks; the driver places the encoder after the residency choice
            facts = encoder_facts(entry.config)
    not_measured: tuple[str, ...] = ()
    if isinstance(timer, DeviceLatency):
        measured, estimated = len(timer.measured), len(timer.estimated)
        not_measured = tuple(timer.errors[:5])
        timer.save()
    else:  # the cost model; on a CPU, calibrated by one measured request (itself measured)
        counted_keys = xema.counter.profiled if opts.planner == "xema" else set()
        sources = [latency.source_of(ExecutionConfig.model_validate_json(k)) for k in counted_keys]
        measured = sum(1 for x in sources if x == LatencySource.MEASURED)
        estimated = profiled - measured
    return TemplateResult(
        template=template.shape_key, slo_s=xema.slo_s, entry=entry, candidates=candidates, encoder_facts=facts,
        device=device or "none", traced=traced, profiled=profiled, analysed=analysed, finished=finished,
        pruned_memory=pruned_memory, pruned_slo=pruned_slo, measured=measured, estimated=estimated,
        not_measured=not_measured, seconds=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0,
        started_unix=started, worker_pid=os.getpid())


def with_latency_source(entry: PlanEntry, timer: LatencyModel | DeviceLatency) -> PlanEntry:
    """The entry labelled with where its latencies came from: its batch's and its partial batches'."""
    configs = [entry.config, *(entry.config.for_batch(n) for n in entry.prediction.latency_by_batch)]
    source = combine([timer.source_of(c) for c in configs])
    return entry.model_copy(update={"prediction": entry.prediction.model_copy(update={"latency_source": source})})


def _planning_work(template: RequestTemplate) -> tuple[int, int]:
    """Rough order of a template's planning time, to start the longest first (fewer idle GPUs at
    the end): meta tracing costs per operator, not per byte, so it grows with the transformer
    passes per denoising step and the blocks per pass; latent length breaks ties."""
    spec = template.spec
    passes = spec.transformer_passes_per_step() if hasattr(spec, "transformer_passes_per_step") else (1,)
    cfg = spec.transformer_config
    blocks = int(cfg.get("num_layers", 1)) + int(cfg.get("num_single_layers", 0))
    return len(passes) * blocks, template.latent_length


GroupDone = Callable[[str, list[TemplateResult]], None]


def plan_all(templates: list[RequestTemplate], opts: PlanOptions, use_ray: bool,
             on_group: GroupDone | None = None, shape: TaskShape | None = None) -> list[TemplateResult]:
    """Every template's ``plan_one`` result, in ``templates``' order; ``on_group(model, results)``
    is called as soon as a model group's last template is planned (the others still planning).
    ``shape``: what each Ray task asks for (default: ``planner.cluster_fit.fit_tasks``)."""
    from tqdm import tqdm

    model_of = {t.shape_key: t.model for t in templates}
    left = {m: list(model_of.values()).count(m) for m in set(model_of.values())}
    order = {t.shape_key: i for i, t in enumerate(templates)}
    results: list[TemplateResult] = []

    def arrived(r: TemplateResult) -> None:
        results.append(r)
        model = model_of[r.template]
        left[model] -= 1
        if on_group is not None and left[model] == 0:
            on_group(model, sorted((x for x in results if model_of[x.template] == model), key=lambda x: order[x.template]))

    if not use_ray:
        for t in tqdm(templates, desc="planning", unit="template"):
            arrived(plan_one(t, opts))
        return sorted(results, key=lambda r: order[r.template])
    import ray

    from planner.boot import init_ray

    init_ray()  # already done by ``python -m planner`` while the planner imported
    # sized to what the cluster can spare (a serving app holds most of it): a fraction of a CPU,
    # a GPU only where one is free and measuring needs it (planner.cluster_fit)
    shape = shape or fit_tasks(opts.hardware, opts.measure)
    # max_calls=0: Ray retires a GPU task's worker after one call by default (to free its CUDA
    # memory); a reused worker keeps its imports and meta pipelines
    task = ray.remote(num_cpus=shape.num_cpus, num_gpus=shape.num_gpus, max_calls=0)(plan_one)
    pending = {task.remote(t, opts): t for t in sorted(templates, key=_planning_work, reverse=True)}
    with tqdm(total=len(pending), desc="planning", unit="template") as bar:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                pending.pop(ref)
                arrived(ray.get(ref))
                bar.update(1)
    return sorted(results, key=lambda r: order[r.template])


# ---------------------------------------------------------------------------- the table
def plan_table(results: list[TemplateResult], opts: PlanOptions, groups: GroupFinisher, loaded: PlanTable | None,
               wall_s: float) -> PlanTable:
    """The finished groups' entries in the templates' order, with the run's provenance."""
    in_order = [r.template for r in results if r.template in groups.entries]
    return PlanTable(
        hardware=LatencyModel(opts.hardware).fingerprint(opts.gpus), gpus=opts.gpus, budget_bytes=opts.budget,
        group_gpus=opts.group_gpus, slo_scale=opts.slo_scale, planner=opts.planner,
        adapter_pools={m: opts.adapter_pools[m] for m in sorted(opts.adapter_pools)},
        residency={m: groups.residency[m] for m in sorted(groups.residency)},
        entries={k: groups.entries[k] for k in in_order}, admission=loaded.admission if loaded else {},
        planned_load=loaded.planned_load if loaded else {},
        provenance=PlanProvenance(
            command=" ".join(sys.argv), wall_s=round(wall_s, 1), profiled=sum(r.profiled for r in results),
            tasks_cpu_s=round(sum(r.cpu_s for r in results), 1),
            text_encoders={k: groups.encoders[k] for k in in_order if k in groups.encoders},
            measured=sum(r.measured for r in results), estimated=sum(r.estimated for r in results),
            infeasible=tuple(r.template for r in results if r.entry is None),
            planned_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
    )


def with_layouts(table: PlanTable, wave: LayoutWave, gpu: str, planned_at: float) -> PlanTable:
    """``table`` with the layouts ``wave`` solved (each entry referencing its layout, its peak what
    the worker holds with it armed) and their provenance; prints one line per entry. ``planned_at``:
    ``time.perf_counter()`` when the last template was planned."""
    budget = table.budget_bytes
    solved, ratios, layout_cpu = wave.collect(budget)
    # the wall time the layouts add after the last template is planned (they start while others plan)
    layout_wall = time.perf_counter() - planned_at
    table = table.model_copy(update={"entries": {k: solved[k] for k in table.entries},
                                     "provenance": table.provenance.model_copy(update=dict(
                                         layouts_wall_s=round(layout_wall, 1), layouts_cpu_s=round(layout_cpu, 1),
                                         layouts_gpu=gpu, layouts_dynamic_bytes=dict(sorted(wave.dynamic_bytes.items())),
                                         layouts_not_armed=dict(sorted(wave.not_armed.items()))))})
    for model, dyn in wave.dynamic_bytes.items():
        print(f"layouts {model}: one dynamic region of {gb(dyn)} per worker, the static region follows the template")
    for k, e in table.entries.items():
        p = e.prediction
        if k in wave.not_armed:
            print(f"layout {k}: none kept ({wave.not_armed[k]}), predicted peak {gb(p.peak_bytes)} without it")
            continue
        over = "" if p.peak_bytes <= budget else f"  OVER the {gb(budget)} budget with the static allocator"
        print(f"layout {k}: {e.config.layout_ref}, reserved/lower bound {ratios[k]:.3f}, "
              f"predicted peak {gb(p.peak_bytes)}{over}")
    print(f"solved {len(ratios)} static layouts, done {layout_wall:.1f} s after the last template was planned "
          f"({layout_cpu:.1f} CPU s in the tasks)")
    return table


# ---------------------------------------------------------------------------- the run
def print_summary(results: list[TemplateResult], out: TextIO | None = None) -> None:
    w = (out or sys.stdout).write
    w(f"{'template':<28} {'plan':<48} {'peak/GPU':>10} {'latency':>9} {'goodput':>10} {'profiled':>8}  runner-up\n")
    for r in results:
        if r.entry is None:
            w(f"{r.template:<28} {'infeasible (no configuration fits the budget and the SLO)':<48}\n")
            continue
        e = r.entry
        p = e.prediction
        w(f"{r.template:<28} {e.config.describe():<48} {gb(p.peak_bytes):>10} {p.latency_s:>8.2f}s "
          f"{p.goodput_rps * 60:>7.2f}/min {r.profiled:>8}  {e.runner_up or '-'}\n")


def print_groups(table: PlanTable, encoders: dict[str, TextEncoderChoice]) -> None:
    """Each entry's text encoder, each group's residency and the load it was planned for."""
    for k in table.entries:
        if k in encoders:
            print(f"text encoder {k}: {encoders[k].describe()}")
    for model, r in table.residency.items():
        figures = ", ".join(f"{k} {v * 60:.2f}/min" for k, v in r.goodput_rps.items())
        print(f"residency {model}: {r.policy} ({figures}; host {r.host_bytes_per_worker / 1e9:.2f} GB per worker)")
    for model, pl in table.planned_load.items():
        adm = table.admission[model]
        print(f"load {model}: {pl.rate_per_min:g}/min -> expected attainment {pl.expected_attainment:.1%} "
              f"(goodput choice {pl.goodput_attainment:.1%}); changed {', '.join(pl.changed) or 'none'}; "
              f"late requests: {adm.late}; refused: {', '.join(adm.refused) or 'none'}")


def fit_host(results: list[TemplateResult], templates: list[RequestTemplate], opts: PlanOptions,
             groups: GroupFinisher, use_ray: bool, shape: TaskShape | None) -> list[TemplateResult]:
    """The finished groups within ``--host-budget``: as planned where their node fits (the usual
    case: nothing more to do), else planned again with every template's other candidates and
    fitted (``planner.host_choice``; the layouts of changed entries are solved anew). Returns the
    results the table is built from; raises ``HostBudgetError`` naming the bytes when none fits."""
    from planner.host_choice import node_host

    assert opts.host_budget is not None
    if not groups.defer:
        node = node_host(groups.entries, groups.residency, opts.group_gpus, opts.gpus, opts.host_budget,
                         share=opts.hardware != "cpu")
        if node.fits:
            return results
        print(f"host memory: {node.load_peak_bytes / 1e9:.1f} GB per node while loading, over --host-budget "
              f"{opts.host_budget / 1e9:.1f} GB: planning again with every template's other candidates")
        results = plan_all(templates, opts.model_copy(update={"send_candidates": True}), use_ray=use_ray,
                           shape=shape)
        groups.defer = True
        model_of = {t.shape_key: t.model for t in templates}
        for model in sorted(set(model_of.values())):
            groups.finish(model, [r for r in results if model_of[r.template] == model])
    groups.fit_host(results)
    return results


def _block_sizes(templates: list[RequestTemplate]) -> threading.Thread:
    """What the residency choice needs from each model (its DiT blocks' weight bytes: a meta build
    of the transformer, seconds with its imports), prepared on a thread while the tasks run."""
    from xema_ray.runtime.residency import block_sizes

    return threading.Thread(target=lambda: [block_sizes(t.spec) for t in {t.model: t for t in templates}.values()],
                            name="block-sizes", daemon=True)


def _plan_expert_switches(table: PlanTable, templates: list[RequestTemplate], opts: PlanOptions, hw: HardwareProfile,
                          out: str | None) -> PlanTable:
    """Two-expert models (Wan2.2-A14B): what each template's plan does at the expert switch,
    printed, written beside the table (``planner.expert_switch``) and made the template's entry
    (``ExecutionConfig.experts``: the worker executes it)."""
    from planner.expert_switch import ExpertSwitchFile, describe, expert_switch_plans, with_switch_entries

    slos = {k: e.prediction.slo_s for k, e in table.entries.items()}
    plans = expert_switch_plans(templates, opts.budget, hw, opts.group_gpus, opts.gpus, slo_of=slos)
    for p in plans:
        print(describe(p))
    if plans and out:
        path = Path(out).with_suffix(".experts.json")
        ExpertSwitchFile(plans=plans).save(path)
        print(f"wrote {path}")
    if not plans:
        return table
    switched = with_switch_entries(table, plans, templates)
    for p in plans:
        key = next(t.shape_key for t in templates if t.key == p.template)
        e = switched.entries[key]
        print(f"table entry {key}: {e.config.describe()}, predicted peak {e.prediction.peak_bytes / 1e9:.2f} GB, "
              f"latency {e.prediction.latency_s:.1f} s (the search on both experts held: {e.runner_up})")
    return switched


def plan(templates: list[RequestTemplate], opts: PlanOptions, loads: dict[str, GroupLoad], out: str | None,
         stats: str | None, layouts: bool, use_ray: bool, wait_s: float = 10.0) -> int:
    """Plan ``templates`` (Ray tasks, or in this process), finish each model group, solve the
    static layouts next to ``out`` (``layouts``), write the table and the per-template statistics
    (``stats``). Returns the exit status (2: the load names what is not planned; 3: the cluster
    had no room for a planning task within ``wait_s`` seconds: the message says who holds it)."""
    t0 = time.perf_counter()
    shape = None
    if use_ray:
        from planner.boot import init_ray

        init_ray()
        try:
            shape = fit_tasks(opts.hardware, opts.measure, wait_s=wait_s)
        except NoRoom as e:
            print(f"planner: {e}", file=sys.stderr, flush=True)
            return 3
        print(f"planning tasks ask for {shape.note}", flush=True)
    sizes = _block_sizes(templates)
    if use_ray:
        sizes.start()
    latency_model = LatencyModel(opts.hardware, store_path=opts.profile_store)
    if layouts and not out:
        print("planner: no --out, so no static layouts (they are written next to the table; --no-layouts "
              "says so explicitly)", file=sys.stderr)
    wave = (LayoutWave(out, latency_model.hardware.gpu_model, use_ray=use_ray, num_cpus=shape.num_cpus if shape else 1.0)
            if layouts and out else None)
    # with an expected load the groups' choices are made together, after every template is planned
    # (with a host budget too, fitted then: planner.host_choice)
    groups = GroupFinisher(opts, latency_model, wave, sizes, defer=bool(loads) and opts.host_budget is not None)
    results = plan_all(templates, opts, use_ray=use_ray, on_group=None if loads else groups.finish, shape=shape)
    wall = time.perf_counter() - t0
    loaded = None
    try:
        if loads:
            loaded = finish_under_load(results, templates, opts, loads, groups)
        if opts.host_budget is not None:
            results = fit_host(results, templates, opts, groups, use_ray, shape)
    except ValueError as e:  # the load names what is not planned, or no plan fits the host budget
        print(f"planner: {e}", file=sys.stderr)
        return 2
    from planner.host_choice import with_node_host

    table = with_node_host(plan_table(results, opts, groups, loaded, wall), share=opts.hardware != "cpu",
                           budget_bytes=opts.host_budget)
    if wave is not None:
        table = with_layouts(table, wave, latency_model.hardware.gpu_model, planned_at=t0 + wall)
    print_summary(results)
    print_groups(table, groups.encoders)
    if table.host is not None:
        n = table.host
        budget = f" of {n.budget_bytes / 1e9:.1f} GB" if n.budget_bytes else ""
        print(f"host memory per node: {n.resident_bytes / 1e9:.2f} GB resident, {n.pinned_bytes / 1e9:.2f} GB pinned, "
              f"{n.load_peak_bytes / 1e9:.2f} GB while loading{budget} ({n.describe()})")
    table = _plan_expert_switches(table, templates, opts, latency_model.hardware, out)
    total = time.perf_counter() - t0
    table.provenance.total_s = round(total, 1)
    print(f"planned {len(results)} templates in {wall:.1f} s ({total:.1f} s with residencies, encoders and layouts); "
          f"candidates' latencies: {table.provenance.measured} measured, {table.provenance.estimated} estimated")
    if out:
        table.save(out)
        # the path as this process sees it: under `ray job submit` the job's working directory is
        # the cluster's, not the submitting shell's
        print(f"wrote {out} ({Path(out).resolve()})")
    if stats:
        Path(stats).write_text(json.dumps({"wall_s": wall, "results": [r.model_dump(mode="json") for r in results]},
                                          indent=1))
    return 0
