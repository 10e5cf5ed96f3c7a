"""``python -m planner plan ...`` (also ``xema plan`` and ``ray job submit -- python -m planner ...``).

Each template is planned in its own Ray task. When the cluster has GPUs, the task holds one
(``num_gpus=1``), builds the model there with random weights at its real config and measures
the candidates with the segment-reuse profiler (``planner.measure``; profile store keyed by the
GPU's NVML fingerprint); the roofline cost model answers only for what one GPU cannot measure
(SP > 1, out of memory) and for what-if planning (``--hardware a6000`` on another GPU). On a
cluster without GPUs the tasks request none and use the cost model (``--hardware cpu``: this CPU
is measured). Every plan entry says which (``latency_source``), and the statistics count the
candidates measured and estimated.

Example:
    python -m planner plan --templates tiny --gpus 2 --budget 20MB --hardware cpu --out plans/tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

# Only light modules at the top (pydantic, numpy): ``xema --help`` and ``xema plan --help`` must
# answer in well under a second. What builds models (torch, diffusers) or starts Ray is imported
# where it is used; ``planner.boot`` imports ``HEAVY_MODULES`` while Ray starts.
from xema_ray.memory.analysis import gb, parse_bytes
from xema_ray.plan import ExecutionConfig, GroupResidency, PlanEntry, PlanProvenance, PlanTable, TextEncoderChoice
from xema_ray.templates import RequestTemplate, named_templates

from planner.baselines import BASELINES, SearchSpace, run_baseline
from planner.latency import LatencyModel, combine, hardware_names
from planner.measure import DeviceLatency, task_device

if TYPE_CHECKING:
    from planner.text_encoder import EncoderFacts

PLANNERS = ("xema", *BASELINES)
#: what ``plan_one`` and ``cmd_plan`` import on first use (torch, diffusers: seconds)
HEAVY_MODULES = ("planner.trace_model", "planner.traces", "planner.pause_state", "planner.text_encoder",
                 "planner.residency_choice", "planner.layouts", "xema_ray.runtime.residency")


def parse_templates(text: str, steps: int | None) -> list[RequestTemplate]:
    """A named set ("paper", "tiny") or a comma list of MODEL:WxH[xF], e.g. "ltx2:1280x704x49"."""
    if text in ("paper", "tiny"):
        return named_templates(text, steps)
    out = []
    for item in text.split(","):
        try:
            model, dims = item.split(":")
            parts = [int(x) for x in dims.lower().split("x")]
        except ValueError:
            raise ValueError(f"cannot read template {item!r}; use a set name (paper, tiny) or MODEL:WxH[xFRAMES]") from None
        w, h, f = (parts + [1])[:3]
        out.append(RequestTemplate(model=model, width=w, height=h, frames=f, **({"steps": steps} if steps else {})))
    return out


def deployment_groups(path: Path) -> tuple[dict[str, int], list[RequestTemplate]]:
    """``model -> GPUs of its group`` and the served templates of a ``serve run`` YAML."""
    from xema_ray.deployment import DeploymentShape, served_templates

    shape = DeploymentShape.from_serve_yaml(path)
    return {g.model: g.workers for g in shape.models}, served_templates(shape.models)


def plan_one(template_json: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Plan one template (runs inside a Ray task or in-process)."""
    from planner.load_aware import load_candidates
    from planner.pause_state import with_pause_bytes
    from planner.stages import CountingModel, plan_template
    from planner.text_encoder import encoder_facts
    from planner.trace_model import TracePlannerModel
    from planner.traces import TraceCache

    t0, started, cpu0 = time.perf_counter(), time.time(), time.process_time()
    template = RequestTemplate.model_validate_json(template_json)
    latency = LatencyModel(opts["hardware"], store_path=opts.get("profile_store"))
    gpus = opts.get("group_gpus", {}).get(template.model, opts["gpus"])  # the template's own group
    device = task_device(opts["hardware"], opts.get("measure", "auto"))
    timer: LatencyModel | DeviceLatency = latency
    if device is not None:
        timer = DeviceLatency(template, latency, device)
        latency.on_device(timer.fingerprint)  # estimates calibrated by this device's measurements
    elif opts["hardware"] == "cpu":
        latency.calibrate([template])  # measure SP 1 / batch 1 here; the cost model scales from it
    cache = TraceCache(Path(opts["trace_cache"]) if opts.get("trace_cache") else None)
    model = TracePlannerModel(template, timer.seconds, cache)
    budget = opts["budget"]
    counting = CountingModel(model)
    xema = plan_template(counting, template, gpus, budget, slo_scale=opts["slo_scale"], max_batch=opts["max_batch"],
                         latency_source="estimated")
    result: dict[str, Any] = {"template": template.shape_key, "slo_s": xema.slo_s, "traced": cache.traced,
                              "device": device or "none"}
    if opts["planner"] == "xema":
        entry = xema.entry
        result.update(profiled=len(xema.counter.profiled), analysed=len(xema.counter.analysed), finished=True,
                      pruned_memory=len(xema.log.pruned_memory), pruned_slo=len(xema.log.pruned_slo))
    elif xema.slo_s is None:
        entry = None
        result.update(profiled=0, analysed=0, finished=True)
    else:
        space = SearchSpace(gpus=gpus, budget=budget, slo_s=xema.slo_s, max_batch=opts["max_batch"])
        entry, counted, finished = run_baseline(opts["planner"], model, template, space, "estimated",
                                                time_limit_s=opts.get("time_limit_s"))
        result.update(profiled=len(counted.counter.profiled), analysed=len(counted.counter.analysed), finished=finished)
    if entry is not None and opts["planner"] == "xema" and template.model in opts.get("loaded_models", ()):
        # a load is expected for this model's group: its other assembled configurations compete
        # under that load in the driver (planner.load_aware)
        alts = [with_pause_bytes(with_latency_source(e, timer), cache)
                for e in load_candidates(counting, xema.ranked, budget, xema.slo_s or 0.0, "estimated")[1:]]
        result["candidates"] = [e.model_dump_json() for e in alts]
    if entry is not None:
        entry = with_pause_bytes(with_latency_source(entry, timer), cache)
        if opts.get("text_encoder") == "plan" and template.spec.text_encoder is not None:
            # measured here, where the model's meta pipeline is built already and in parallel
            # with the other tasks; the driver places the encoder after the residency choice
            result["encoder_facts"] = encoder_facts(entry.config).model_dump_json()
    if isinstance(timer, DeviceLatency):
        result["measured"], result["estimated"] = len(timer.measured), len(timer.estimated)
    else:  # the cost model; on a CPU, calibrated by one measured request (itself measured)
        counted_keys = xema.counter.profiled if opts["planner"] == "xema" else set()
        sources = [latency.source_of(ExecutionConfig.model_validate_json(k)) for k in counted_keys]
        result["measured"] = sum(1 for x in sources if x == "measured")
        result["estimated"] = result["profiled"] - result["measured"]
    if isinstance(timer, DeviceLatency):
        result["not_measured"] = timer.errors[:5]
        timer.save()
    result["entry"] = entry.model_dump_json() if entry is not None else None
    result["seconds"] = time.perf_counter() - t0
    result["cpu_s"] = time.process_time() - cpu0  # this task's CPU time (other jobs stretch only the wall time)
    result["started_unix"], result["worker_pid"] = started, os.getpid()  # for the planning timeline
    return result


def merged_encoder_facts(results: list[dict[str, Any]]) -> dict[str, EncoderFacts]:
    """Per model, the text-encoder facts the planning tasks sent back, merged."""
    from planner.text_encoder import EncoderFacts

    out: dict[str, EncoderFacts] = {}
    for r in results:
        if r.get("encoder_facts"):
            f = EncoderFacts.model_validate_json(r["encoder_facts"])
            out[f.model] = out[f.model].merged(f) if f.model in out else f
    return out


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


GroupDone = Callable[[str, list[dict[str, Any]]], None]


def _run_all(templates: list[RequestTemplate], opts: dict[str, Any], use_ray: bool,
             on_group: GroupDone | None = None) -> list[dict[str, Any]]:
    """Every template's ``plan_one`` result, in ``templates``' order; ``on_group(model, results)``
    is called as soon as a model group's last template is planned (the others still planning)."""
    from tqdm import tqdm

    model_of = {t.shape_key: t.model for t in templates}
    left = {m: list(model_of.values()).count(m) for m in set(model_of.values())}
    order = {t.shape_key: i for i, t in enumerate(templates)}
    results: list[dict[str, Any]] = []

    def arrived(r: dict[str, Any]) -> None:
        results.append(r)
        model = model_of[r["template"]]
        left[model] -= 1
        if on_group is not None and left[model] == 0:
            on_group(model, sorted((x for x in results if model_of[x["template"]] == model), key=lambda x: order[x["template"]]))

    if not use_ray:
        for t in tqdm(templates, desc="planning", unit="template"):
            arrived(plan_one(t.model_dump_json(), opts))
        return sorted(results, key=lambda r: order[r["template"]])
    import ray

    from planner.boot import init_ray

    init_ray()  # already done by ``python -m planner`` while the planner imported
    # a task holds a GPU only where the cluster has some: on a cluster without GPUs, asking for
    # one would wait forever (tasks then plan on the cost model, one per CPU)
    gpus_in_cluster = ray.cluster_resources().get("GPU", 0)
    # max_calls=0: Ray retires a GPU task's worker after one call by default (to free its CUDA
    # memory); a reused worker keeps its imports and meta pipelines
    task = ray.remote(num_gpus=1 if gpus_in_cluster >= 1 else 0, max_calls=0)(plan_one)
    pending = {task.remote(t.model_dump_json(), opts): t for t in sorted(templates, key=_planning_work, reverse=True)}
    with tqdm(total=len(pending), desc="planning", unit="template") as bar:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                pending.pop(ref)
                arrived(ray.get(ref))
                bar.update(1)
    return sorted(results, key=lambda r: order[r["template"]])


def finish_group(results: list[dict[str, Any]], entries: dict[str, PlanEntry], planner: str, text_encoder: str,
                 latency: LatencyModel, budget: int) -> tuple[dict[str, PlanEntry], GroupResidency | None, dict[str, TextEncoderChoice]]:
    """One model group's planned entries made final: the residency policy with more goodput
    (Xema) and each template's text-encoder placement (after it: the residency changes the
    plans). Returns the entries to serve with, the residency (None: a baseline or no entry) and
    the placement chosen per entry, for the summary."""
    from planner.residency_choice import choose_group_residency
    from planner.text_encoder import place_text_encoder

    residency = None
    if planner == "xema" and entries:
        residency, entries = choose_group_residency(entries, latency.seconds, latency.hardware.h2d_gbps)
    entries, encoders = dict(entries), {}
    if text_encoder == "plan":
        facts = merged_encoder_facts(results)
        for k, e in list(entries.items()):
            if e.config.template.spec.text_encoder is not None:
                entries[k], costs = place_text_encoder(e, latency.hardware, budget, facts.get(e.config.template.spec.name))
                chosen = next(c for c in costs if c.placement == entries[k].config.text_encoder)
                encoders[k] = TextEncoderChoice(placement=chosen.placement, seconds_per_batch=chosen.seconds)
    return entries, residency, encoders


def print_summary(results: list[dict[str, Any]], out: TextIO | None = None) -> None:
    w = (out or sys.stdout).write
    w(f"{'template':<28} {'plan':<48} {'peak/GPU':>10} {'latency':>9} {'goodput':>10} {'profiled':>8}  runner-up\n")
    for r in results:
        if r["entry"] is None:
            w(f"{r['template']:<28} {'infeasible (no configuration fits the budget and the SLO)':<48}\n")
            continue
        e = PlanEntry.model_validate_json(r["entry"])
        p = e.prediction
        w(f"{r['template']:<28} {e.config.describe():<48} {gb(p.peak_bytes):>10} {p.latency_s:>8.2f}s "
          f"{p.goodput_rps * 60:>7.2f}/min {r['profiled']:>8}  {e.runner_up or '-'}\n")


def cmd_plan(args: argparse.Namespace) -> int:
    from xema_ray.runtime.residency import block_sizes

    from planner.load_aware import plan_groups_for_load, read_loads

    group_gpus: dict[str, int] = {}
    try:
        if args.deployment is not None:
            group_gpus, served = deployment_groups(Path(args.deployment))
            templates = parse_templates(args.templates, args.steps) if args.templates else served
            outside = sorted({t.model for t in templates} - set(group_gpus))
            if outside:
                raise ValueError(f"{args.deployment} has no model group for {', '.join(outside)}; "
                                 f"its groups: {', '.join(f'{m} ({n} GPUs)' for m, n in group_gpus.items())}")
            gpus = sum(group_gpus.values())
        else:
            templates = parse_templates(args.templates or "tiny", args.steps)
            gpus = args.gpus
        budget = parse_bytes(args.budget)
        loads = read_loads(args.load) if args.load else {}
        if loads and args.planner != "xema":
            raise ValueError("--load plans Xema for a load; baselines plan for isolated goodput")
        if args.hardware not in hardware_names():
            raise ValueError(f"unknown hardware {args.hardware!r}; known: {', '.join(hardware_names())}")
    except (ValueError, OSError) as e:
        print(f"planner: {e}", file=sys.stderr)
        return 2
    opts = {"hardware": args.hardware, "budget": budget, "gpus": gpus, "group_gpus": group_gpus,
            "slo_scale": args.slo_scale, "max_batch": args.max_batch, "planner": args.planner,
            "trace_cache": args.trace_cache, "time_limit_s": args.time_limit, "profile_store": args.profile_store,
            "measure": args.measure, "text_encoder": args.text_encoder, "loaded_models": sorted(loads)}
    t0 = time.perf_counter()
    # what the residency choice needs from each model (its DiT blocks' weight bytes: a meta build
    # of the transformer, seconds with its imports) is prepared while the tasks run
    sizes = threading.Thread(target=lambda: [block_sizes(t.spec) for t in {t.model: t for t in templates}.values()],
                             name="block-sizes", daemon=True)
    if not args.no_ray:
        sizes.start()
    latency_model = LatencyModel(args.hardware, store_path=args.profile_store)
    if args.layouts and not args.out:
        print("planner: no --out, so no static layouts (they are written next to the table; --no-layouts "
              "says so explicitly)", file=sys.stderr)
    wave = None
    if args.layouts and args.out:
        from planner.layouts import LayoutWave

        wave = LayoutWave(args.out, latency_model.hardware.gpu_model, use_ray=not args.no_ray)
    final: dict[str, PlanEntry] = {}
    residency: dict[str, GroupResidency] = {}
    encoders: dict[str, TextEncoderChoice] = {}

    def finish(model: str, group: list[dict[str, Any]], entries: dict[str, PlanEntry] | None = None) -> None:
        """A model group is planned: its residency and text encoders, then its layouts start."""
        if sizes.is_alive():
            sizes.join()
        if entries is None:
            entries = {r["template"]: PlanEntry.model_validate_json(r["entry"]) for r in group if r["entry"]}
        served, chosen, placed = finish_group(group, entries, args.planner, args.text_encoder, latency_model, budget)
        final.update(served)
        encoders.update(placed)
        if chosen is not None:
            residency[model] = chosen
        if wave is not None:
            wave.submit(served)

    # with an expected load the groups' choices are made together, after every template is planned
    results = _run_all(templates, opts, use_ray=not args.no_ray, on_group=None if loads else finish)
    wall = time.perf_counter() - t0
    loaded = None
    if loads:  # the goodput choices compete with the other assembled configurations under the load
        planned = {r["template"]: PlanEntry.model_validate_json(r["entry"]) for r in results if r["entry"]}
        draft = PlanTable(hardware="planning", gpus=gpus, budget_bytes=budget, group_gpus=group_gpus, entries=planned)
        alts = {r["template"]: [planned[r["template"]], *(PlanEntry.model_validate_json(j) for j in r.get("candidates", []))]
                for r in results if r["entry"]}
        try:
            loaded = plan_groups_for_load(draft, alts, {r["template"]: r["slo_s"] for r in results if r["entry"]}, loads)
        except ValueError as e:
            print(f"planner: {e}", file=sys.stderr)
            return 2
        model_of = {t.shape_key: t.model for t in templates}
        for model in sorted(set(model_of.values())):
            group = [r for r in results if model_of[r["template"]] == model]
            finish(model, group, {r["template"]: loaded.entries[r["template"]] for r in group if r["template"] in loaded.entries})
    in_order = [r["template"] for r in results if r["template"] in final]
    table = PlanTable(
        hardware=LatencyModel(args.hardware).fingerprint(gpus), gpus=gpus, budget_bytes=budget,
        group_gpus=group_gpus, slo_scale=args.slo_scale, planner=args.planner,
        residency={m: residency[m] for m in sorted(residency)},
        entries={k: final[k] for k in in_order}, admission=loaded.admission if loaded else {},
        planned_load=loaded.planned_load if loaded else {},
        provenance=PlanProvenance(
            command=" ".join(sys.argv), wall_s=round(wall, 1), profiled=sum(r["profiled"] for r in results),
            tasks_cpu_s=round(sum(r["cpu_s"] for r in results), 1),
            text_encoders={k: encoders[k] for k in in_order if k in encoders},
            measured=sum(r.get("measured", 0) for r in results), estimated=sum(r.get("estimated", 0) for r in results),
            infeasible=tuple(r["template"] for r in results if r["entry"] is None),
            planned_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
    )
    if wave is not None:
        solved, ratios, layout_cpu = wave.collect(budget)
        table.entries = {k: solved[k] for k in table.entries}
        # the wall time the layouts add after the last template is planned (they start while others plan)
        layout_wall = time.perf_counter() - t0 - wall
        table.provenance = table.provenance.model_copy(update=dict(
            layouts_wall_s=round(layout_wall, 1), layouts_cpu_s=round(layout_cpu, 1),
            layouts_gpu=latency_model.hardware.gpu_model, layouts_dynamic_bytes=dict(sorted(wave.dynamic_bytes.items())),
            layouts_not_armed=dict(sorted(wave.not_armed.items()))))
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
    print_summary(results)
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
    total = time.perf_counter() - t0
    table.provenance.total_s = round(total, 1)
    print(f"planned {len(results)} templates in {wall:.1f} s ({total:.1f} s with residencies, encoders and layouts); candidates' latencies: {table.provenance.measured} "
          f"measured, {table.provenance.estimated} estimated")
    if args.out:
        table.save(args.out)
        print(f"wrote {args.out}")
    if args.stats:
        Path(args.stats).write_text(json.dumps({"wall_s": wall, "results": results}, indent=1))
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan SP x DP x batch x mitigation per template (paper §7)")
    p.add_argument("--templates", default=None,
                   help="paper | tiny | MODEL:WxH[xF],... (default: the deployment's templates, else tiny)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the set's own)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs every template may use (ignored with --deployment)")
    p.add_argument("--deployment", default=None,
                   help="a serve YAML (deployments/X.yaml): each template is planned for its model group's own GPUs")
    p.add_argument("--budget", default="48GB", help="per-GPU memory budget, e.g. 48GB or 44.7GiB")
    p.add_argument("--hardware", default="a6000", help=f"hardware profile for latency ({', '.join(hardware_names())})")
    p.add_argument("--slo-scale", type=float, default=1.0)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--planner", choices=PLANNERS, default="xema")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per template for grid-style baselines")
    p.add_argument("--trace-cache", default=None, help="directory to keep analyzer traces in (JSON)")
    p.add_argument("--profile-store", default=None, help="profile store JSON (measurements reused across runs)")
    p.add_argument("--text-encoder", choices=("plan", "none"), default="plan",
                   help="plan where each template's text encoder runs (device / streamed / cpu), or plan without one")
    p.add_argument("--layouts", action=argparse.BooleanOptionalAction, default=True,
                   help="solve each entry's static layout from the worker's allocation stream, in parallel "
                        "Ray tasks, into <out>.layouts/ (default; --no-layouts: plan without)")
    p.add_argument("--load", default=None,
                   help='expected load per model group (traffic profile JSON: {"MODEL": {"rate_per_min": R, "mix": '
                        '{"TEMPLATE": W}, "slo_scale": S}}): its plans and admission policy maximise the simulated '
                        "SLO attainment there (planner.load_aware); without it, isolated goodput")
    p.add_argument("--out", default=None, help="plan table JSON to write")
    p.add_argument("--stats", default=None, help="per-template planning statistics JSON to write")
    p.add_argument("--no-ray", action="store_true", help="plan in this process instead of Ray tasks")
    p.add_argument("--measure", choices=("auto", "always", "never"), default="auto",
                   help="auto: measure candidates on the planning task's GPU when it matches --hardware (this CPU "
                        "for --hardware cpu), else estimate; always: fail without a GPU; never: cost model only")
    p.set_defaults(func=cmd_plan)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="planner", description="Xema offline planner")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))
