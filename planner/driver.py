"""The template pass (paper §7.3): each template planned in its own Ray task (``plan_one``:
``PlanOptions`` in, ``TemplateResult`` out), run by ``plan_all`` for ``planner.pipeline``'s
``templates`` pass.

When the cluster has GPUs, the task holds one (``num_gpus=1``), builds the model there with
random weights at its real config and measures the candidates with the segment-reuse profiler
(``planner.measure``; profile store keyed by the GPU's NVML fingerprint); the roofline cost model
answers only for what one GPU cannot measure (SP > 1, out of memory) and for what-if planning
(``--hardware a6000`` on another GPU). On a cluster without GPUs the tasks request none and use the
cost model (``--hardware cpu``: this CPU is measured). Every plan entry says which
(``latency_source``), and the statistics count the candidates measured and estimated.

``plan_all`` hands each model group on (``on_group``) as soon as its last template is planned,
while the others still plan: the pipeline finishes it there when no pass couples the groups
(``planner.pipeline``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from xema_ray.plan import ExecutionConfig, PlanEntry
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import LatencySource
from xema_ray.tier_plan import WeightFormat

from planner.baselines import SearchSpace, run_baseline
from planner.cluster_fit import TaskShape, fit_tasks
from planner.latency import LatencyModel, combine, with_reused_step_share
from planner.measure import DeviceLatency, task_device
# the task's types live below the passes that read them (planner.finishing, planner.pipeline);
# named here too, where the bench and the tests import them from
from planner.task_io import PlanOptions, TemplateResult

__all__ = ["GroupDone", "PlanOptions", "TemplateResult", "plan_all", "plan_one", "with_latency_source"]


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
    gpus = opts.dit_gpus(template.model)  # the template's own group's DiT workers
    device = task_device(opts.hardware, opts.measure)
    timer: LatencyModel | DeviceLatency = latency
    if device is not None:
        timer = DeviceLatency(template, latency, device)
        latency.on_device(timer.fingerprint)  # estimates calibrated by this device's measurements
    elif opts.hardware == "cpu":
        latency.calibrate([template])  # measure SP 1 / batch 1 here; the cost model scales from it
    fmt = opts.weights.get(template.model, "model")
    cache = TraceCache(Path(opts.trace_cache) if opts.trace_cache else None, adapters=opts.adapter_pools,
                       weights={template.model: fmt} if fmt != "model" else {})
    model = TracePlannerModel(template, _in_weights(timer.seconds, fmt), cache)
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
    facts = decoding = None
    if entry is not None and opts.stages != "joint" and template.spec.decode_components():
        from planner.decode_stage import decode_facts

        # the trace is here; the choice is the driver's, on the whole group (a pool's GPUs too)
        decoding = decode_facts(model, entry.config, opts.group_size(template.model))
    if fmt != "model":  # every configuration was traced and priced with the quantized weights
        candidates = tuple(_with_weights(e, fmt) for e in candidates)
        entry = _with_weights(entry, fmt) if entry is not None else None
    if entry is not None:
        entry = with_reused_step_share(with_pause_bytes(with_latency_source(entry, timer), cache), latency)
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
        decode_facts=decoding,
        device=device or "none", traced=traced, profiled=profiled, analysed=analysed, finished=finished,
        pruned_memory=pruned_memory, pruned_slo=pruned_slo, measured=measured, estimated=estimated,
        not_measured=not_measured, seconds=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0,
        started_unix=started, worker_pid=os.getpid())


def _in_weights(seconds: Callable[[ExecutionConfig], float], fmt: WeightFormat) -> Callable[[ExecutionConfig], float]:
    """``seconds`` of a configuration run with its transformer's weights in ``fmt``."""
    if fmt == "model":
        return seconds
    return lambda config: seconds(config.model_copy(update={"weights": fmt}))


def _with_weights(entry: PlanEntry, fmt: WeightFormat) -> PlanEntry:
    """``entry`` whose configuration runs its transformer's weights in ``fmt``."""
    return entry.model_copy(update={"config": entry.config.model_copy(update={"weights": fmt})})


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
