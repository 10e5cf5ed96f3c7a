"""``python -m planner plan ...`` (also ``xema plan`` and ``ray job submit -- python -m planner ...``):
the command line, and the only module of the planner that prints or chooses an exit status. Its
flags are read into a ``planner.pipeline.PlanRequest``; ``planner.pipeline.plan`` runs the passes
(Ray tasks, group finishing, host memory, layouts, expert switch, the table) and returns a
``PlanResult``, which is said here.

Example:
    python -m planner plan --templates tiny --gpus 2 --budget 20MB --hardware cpu --out plans/tiny.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

# Only light modules at the top (pydantic, numpy): ``xema --help`` and ``xema plan --help`` must
# answer in well under a second. What builds models (torch, diffusers) or starts Ray is imported
# where it is used (``planner.pipeline``); ``planner.boot`` imports ``HEAVY_MODULES`` while Ray starts.
from xema_ray.memory.analysis import parse_bytes
from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.templates import RequestTemplate, named_templates

from planner.baselines import BASELINES
from planner.latency import hardware_names

if TYPE_CHECKING:
    from xema_ray.deployment import DecodePoolConfig
    from xema_ray.plan import PlanTable, TextEncoderChoice

    from planner.load_aware import GroupLoad

    from planner.pipeline import LayoutReport, PlanEvent, PlanResult
    from planner.task_io import TemplateResult

PLANNERS = ("xema", *BASELINES)
#: the checkout the recorded command is relative to
ROOT = Path(__file__).resolve().parents[1]
#: what ``cmd_plan`` imports on first use (the driver and what its tasks import: torch, diffusers: seconds)
HEAVY_MODULES = ("planner.pipeline", "planner.driver", "planner.trace_model", "planner.traces", "planner.pause_state",
                 "planner.text_encoder", "planner.residency_choice", "planner.layouts", "xema_ray.runtime.residency")


def parse_templates(text: str, steps: int | None) -> list[RequestTemplate]:
    """A named set ("paper", "tiny") or a comma list of MODEL:WxH[xF][+rN[@WxH]], e.g.
    "ltx2:1280x704x49" or "flux2:1024x1024+r2@1024x1024" (two references encoded at 1024²)."""
    from xema_ray.models import MODEL_NAMES

    if text in ("paper", "tiny") or text in MODEL_NAMES:  # a model: the templates its spec names
        return named_templates(text, steps)
    out = []
    for item in text.split(","):
        try:
            model, dims = item.split(":")
            dims, _, refs = dims.lower().partition("+r")
            parts = [int(x) for x in dims.split("x")]
            count, _, size = refs.partition("@")
            rw, rh = (int(x) for x in size.split("x")) if size else (0, 0)
            references = {"references": int(count), "reference_width": rw, "reference_height": rh} if refs else {}
        except ValueError:
            raise ValueError(f"cannot read template {item!r}; use a set name (paper, tiny) or "
                             "MODEL:WxH[xFRAMES][+rN[@WxH]]") from None
        w, h, f = (parts + [1])[:3]
        out.append(RequestTemplate(model=model, width=w, height=h, frames=f, **references,
                                   **({"steps": steps} if steps else {})))
    return out


def deployment_groups(path: Path) -> tuple[dict[str, int], list[RequestTemplate], str | None]:
    """``model -> GPUs of its group`` (its DiT workers and its decode pool's, ``GroupShape.gpus``),
    the served templates and the stated host memory of a ``serve run`` YAML."""
    from xema_ray.deployment import DeploymentShape, served_templates

    shape = DeploymentShape.from_serve_yaml(path)
    return {g.model: g.gpus for g in shape.models}, served_templates(shape.models), shape.host_memory


def deployment_decode_pools(path: Path) -> dict[str, DecodePoolConfig]:
    """``model -> its group's decode pool`` of a ``serve run`` YAML (groups with ``decode:``)."""
    from xema_ray.deployment import DeploymentShape

    return {g.model: g.decode for g in DeploymentShape.from_serve_yaml(path).models if g.decode is not None}


def deployment_adapter_pools(path: Path) -> dict[str, LoraPoolConfig]:
    """``model -> its group's LoRA adapter pool`` of a ``serve run`` YAML (groups with ``adapters:``)."""
    from xema_ray.deployment import DeploymentShape

    return {g.model: g.adapters for g in DeploymentShape.from_serve_yaml(path).models if g.adapters is not None}


def deployment_tiers(path: Path) -> dict[str, Any]:
    """``model -> its quality tiers`` of a ``serve run`` YAML (groups with ``quality_tiers:``)."""
    from xema_ray.deployment import DeploymentShape

    return {g.model: g.quality_tiers for g in DeploymentShape.from_serve_yaml(path).models if g.quality_tiers}


def deployment_scheduler_configs(path: Path) -> dict[str, dict[str, Any]]:
    """``model -> the scheduler config of its group's checkpoint`` of a ``serve run`` YAML (groups
    whose ``weights_dir`` holds ``scheduler/scheduler_config.json``): what the plans are priced on."""
    from xema_ray.deployment import DeploymentShape

    out = {}
    for g in DeploymentShape.from_serve_yaml(path).models:
        config = g.scheduler_config()
        if config is not None:
            out[g.model] = config
    return out


def recorded_command(argv: list[str], root: Path = ROOT) -> str:
    """The command as the table's provenance records it: relative to the checkout, so the record
    reads the same on every machine (``python -m planner plan ...``, ``xema plan ...``; a path
    under the checkout relative to it)."""
    if not argv:
        return ""
    head = Path(argv[0])
    first = "python -m planner" if head.name == "__main__.py" and head.parent.name == "planner" else head.name
    return " ".join([first, *(_relative(a, root) for a in argv[1:])])


def _relative(arg: str, root: Path) -> str:
    name, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    path = Path(value)
    if path.is_absolute() and path.is_relative_to(root):
        value = str(path.relative_to(root)) or "."
    return f"{name}{eq}{value}"


def template_loads(templates: list[RequestTemplate], loads: dict[str, GroupLoad]) -> dict[str, float]:
    """Shape key -> its expected requests/s: its group's rate split by the mix (uniform without one)."""
    out: dict[str, float] = {}
    for model, load in loads.items():
        keys = [t.shape_key for t in templates if t.model == model]
        weights = {k: load.mix.get(k, 0.0) if load.mix else 1.0 for k in keys}
        total = sum(weights.values())
        for k in keys:
            if total > 0:
                out[k] = load.rate_per_min / 60 * weights[k] / total
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    """The flags read into a ``planner.pipeline.PlanRequest``, planned, and the run said: the
    summary on stdout, errors on stderr; exit 2 for a request that cannot be planned as asked, 3
    when the cluster had no room for a planning task (``PlanError.exit_code``)."""
    from planner.driver import PlanOptions
    from planner.load_aware import read_loads
    from planner.pipeline import PlanError, PlanRequest, plan

    group_gpus: dict[str, int] = {}
    pools: dict[str, LoraPoolConfig] = {}
    decode_pools: dict[str, DecodePoolConfig] = {}
    tiers: dict[str, Any] = {}
    schedulers: dict[str, dict[str, Any]] = {}
    stated: str | None = None
    try:
        if args.deployment is not None:
            group_gpus, served, stated = deployment_groups(Path(args.deployment))
            pools = deployment_adapter_pools(Path(args.deployment))
            decode_pools = deployment_decode_pools(Path(args.deployment))
            tiers = deployment_tiers(Path(args.deployment))
            schedulers = deployment_scheduler_configs(Path(args.deployment))
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
        host_budget = parse_bytes(args.host_budget) if args.host_budget else (parse_bytes(stated) if stated else None)
        loads = read_loads(args.load) if args.load else {}
        if loads and args.planner != "xema":
            raise ValueError("--load plans Xema for a load; baselines plan for isolated goodput")
        if args.stages != "joint" and args.planner != "xema":
            raise ValueError(f"--stages {args.stages} plans Xema's decode stage; baselines decode in place "
                             "(--stages joint)")
        if args.hardware not in hardware_names():
            raise ValueError(f"unknown hardware {args.hardware!r}; known: {', '.join(hardware_names())}")
    except (ValueError, OSError) as e:
        print(f"planner: {e}", file=sys.stderr)
        return 2
    opts = PlanOptions(hardware=args.hardware, budget=budget, gpus=gpus, group_gpus=group_gpus,
                       slo_scale=args.slo_scale, max_batch=args.max_batch, planner=args.planner,
                       trace_cache=args.trace_cache, time_limit_s=args.time_limit, profile_store=args.profile_store,
                       measure=args.measure, text_encoder=args.text_encoder, loaded_models=tuple(sorted(loads)),
                       host_budget=host_budget, adapter_pools=pools, stages=args.stages, decode_pools=decode_pools,
                       template_loads=template_loads(templates, loads), scheduler_configs=schedulers)
    request = PlanRequest(templates=tuple(templates), opts=opts, loads=loads, out=args.out, stats=args.stats,
                          layouts=args.layouts, use_ray=not args.no_ray, wait_s=args.wait_for_resources,
                          command=recorded_command(sys.argv), tiers=tiers, quality=args.quality)
    try:
        result = plan(request, on_event=say_event)
    except PlanError as e:
        print(f"planner: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    say_result(result)
    return 0


# ---------------------------------------------------------------------------- what the run says
def say_event(event: PlanEvent) -> None:
    """What ``plan`` reports while it runs."""
    from planner.pipeline import HostReplanning, LayoutsSkipped, TasksSized

    if isinstance(event, TasksSized):
        print(f"planning tasks ask for {event.note}", flush=True)
    elif isinstance(event, LayoutsSkipped):
        print("planner: no --out, so no static layouts (they are written next to the table; --no-layouts "
              "says so explicitly)", file=sys.stderr)
    elif isinstance(event, HostReplanning):
        print(f"host memory: {event.load_peak_bytes / 1e9:.1f} GB per node while loading, over --host-budget "
              f"{event.host_budget / 1e9:.1f} GB: planning again with every template's other candidates")


def say_tiers(result: PlanResult) -> None:
    """Each entry's quality tiers beside its lossless plan (``planner.tiers``)."""
    lossless = {r.template: r.entry.prediction for r in result.results if r.entry is not None}
    for key, e in result.table.entries.items():
        base = lossless.get(key)
        for name, tier in e.tiers.items():
            if name == "lossless" or base is None or base.latency_s <= 0:
                continue
            print(f"quality {name} {key}: latency {tier.latency_s:.2f} s ({tier.latency_s / base.latency_s:.2f}x "
                  f"lossless {base.latency_s:.2f} s), peak {tier.peak_bytes / 1e9:.2f} GB (cached outputs "
                  f"{tier.cache_bytes / 1e6:.1f} MB), {tier.cache.describe() if tier.cache else 'no cache'}")


def say_result(result: PlanResult) -> None:
    """The run's summary, in the order the passes made it: layouts, plans, groups, the node's host
    memory, the expert switches, the times, the files written."""
    from planner.expert_switch import describe

    if result.layouts is not None:
        say_layouts(result.layouts)
    print_summary(list(result.results))
    table = result.table
    print_groups(table, result.encoders)
    if table.host is not None:
        n = table.host
        budget = f" of {n.budget_bytes / 1e9:.1f} GB" if n.budget_bytes else ""
        print(f"host memory per node: {n.resident_bytes / 1e9:.2f} GB resident, {n.pinned_bytes / 1e9:.2f} GB pinned, "
              f"{n.load_peak_bytes / 1e9:.2f} GB while loading{budget} ({n.describe()})")
    for p in result.switches:
        print(describe(p))
    if result.written.experts is not None:
        print(f"wrote {result.written.experts}")
    say_tiers(result)
    for key in result.switched:
        e = table.entries[key]
        print(f"table entry {key}: {e.config.describe()}, predicted peak {e.prediction.peak_bytes / 1e9:.2f} GB, "
              f"latency {e.prediction.latency_s:.1f} s (the search on both experts held: {e.runner_up})")
    print(f"planned {len(result.results)} templates in {result.planned_s:.1f} s ({result.total_s:.1f} s with "
          f"residencies, encoders and layouts); candidates' latencies: {table.provenance.measured} measured, "
          f"{table.provenance.estimated} estimated")
    if result.written.table is not None:
        # the path as this process sees it: under `ray job submit` the job's working directory is
        # the cluster's, not the submitting shell's
        print(f"wrote {result.written.table} ({result.written.table.resolve()})")


def say_layouts(report: LayoutReport) -> None:
    """One line per model's dynamic region and per entry's layout."""
    from xema_ray.memory.analysis import gb

    budget = report.budget_bytes
    for model, dyn in report.dynamic_bytes.items():
        print(f"layouts {model}: one dynamic region of {gb(dyn)} per worker, the static region follows the template")
    for k, e in report.entries.items():
        p = e.prediction
        if k in report.not_armed:
            print(f"layout {k}: none kept ({report.not_armed[k]}), predicted peak {gb(p.peak_bytes)} without it")
            continue
        over = "" if p.peak_bytes <= budget else f"  OVER the {gb(budget)} budget with the static allocator"
        print(f"layout {k}: {e.config.layout_ref}, reserved/lower bound {report.ratios[k]:.3f}, "
              f"predicted peak {gb(p.peak_bytes)}{over}")
    print(f"solved {len(report.ratios)} static layouts, done {report.wall_s:.1f} s after the last template was planned "
          f"({report.cpu_s:.1f} CPU s in the tasks)")


def print_summary(results: list[TemplateResult], out: TextIO | None = None) -> None:
    """One line per template: its plan, peak, latency, goodput, candidates profiled, runner-up."""
    from xema_ray.memory.analysis import gb

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
    for k, d in table.provenance.decode_stages.items():
        pool = f"{d.pool.describe()}" if d.pool is not None else "no pool fits"
        print(f"decode {k}: {'pool' if d.stage == 'pool' else 'in place'} ({pool}; DiT peak without the decode "
              f"{(d.dit_peak_bytes or 0) / 1e9:.2f} GB, a decode worker's {(d.decode_peak_bytes or 0) / 1e9:.2f} GB): "
              f"{d.reason}")
    for model, r in table.residency.items():
        figures = ", ".join(f"{k} {v * 60:.2f}/min" for k, v in r.goodput_rps.items())
        print(f"residency {model}: {r.policy} ({figures}; host {r.host_bytes_per_worker / 1e9:.2f} GB per worker)")
    for model, pl in table.planned_load.items():
        adm = table.admission[model]
        print(f"load {model}: {pl.rate_per_min:g}/min -> expected attainment {pl.expected_attainment:.1%} "
              f"(goodput choice {pl.goodput_attainment:.1%}); changed {', '.join(pl.changed) or 'none'}; "
              f"late requests: {adm.late}; refused: {', '.join(adm.refused) or 'none'}")


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan SP x DP x batch x mitigation per template (paper §7)")
    p.add_argument("--templates", default=None,
                   help="paper | tiny | MODEL:WxH[xF][+rN[@WxH]],... (default: the deployment's templates, else tiny)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the set's own)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs every template may use (ignored with --deployment)")
    p.add_argument("--deployment", default=None,
                   help="a serve YAML (deployments/X.yaml): each template is planned for its model group's own GPUs")
    p.add_argument("--budget", default="48GB", help="per-GPU memory budget, e.g. 48GB or 44.7GiB")
    p.add_argument("--host-budget", default=None,
                   help="host memory per node, e.g. 64GB: prefer plans whose workers' host-homed weights (one replica "
                        "of each group on one node, while loading too) fit it; refuse, naming the bytes, when none "
                        "does (default: the deployment's host_memory, else no host limit)")
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
    p.add_argument("--quality", choices=("lossless", "balanced", "fast"), default=None,
                   help="plan one quality tier: each entry's config and prediction are the tier's (default: every "
                        "tier the models serve priced beside lossless, PlanEntry.tiers; docs/quality.md)")
    p.add_argument("--stages", choices=("joint", "split", "auto"), default="joint",
                   help="where each video template's VAE decode runs: joint: in place on the DiT workers (default); "
                        "split: on a decode pool of its own wherever one fits (config.decode); auto: the better of "
                        "the two per template, by goodput at its load, then latency (planner.decode_stage)")
    p.add_argument("--out", default=None, help="plan table JSON to write")
    p.add_argument("--stats", default=None, help="per-template planning statistics JSON to write")
    p.add_argument("--no-ray", action="store_true", help="plan in this process instead of Ray tasks")
    p.add_argument("--wait-for-resources", type=float, default=10.0, metavar="S",
                   help="seconds to wait for a Ray cluster to have room for one planning task (a fraction of a CPU; "
                        "a GPU with --measure always) before stopping with what is free and who holds it (exit 3)")
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
