"""Start-up planning, composed where the Serve app is built: a library module of ``xema_ray``
never imports ``planner`` (issue #16), so the serving package takes its plan table from here.

Moved verbatim from ``xema_ray.serving.startup`` (which keeps the checks: ``served_templates``,
``check_runnable``).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from xema_ray.memory.analysis import parse_bytes
from xema_ray.plan import PlanProvenance, PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.serving.startup import check_runnable
from xema_ray.templates import RequestTemplate

logger = logging.getLogger(__name__)


def machine_fingerprint(cfg: ServeConfig, gpus: int) -> str:
    """What this deployment runs on, in the form plan tables record."""
    from planner.latency import LatencyModel

    hardware = cfg.hardware or ("cpu" if cfg.device == "cpu" else "local-gpu")
    return LatencyModel(hardware).fingerprint(gpus)


def resolve_plan_table(cfg: ServeConfig) -> ServeConfig:
    """``cfg`` with a relative ``plan_table`` that is not under the working directory taken from
    the repository root instead (``deployments/xema.yaml`` names ``plans/demo-cpu.json``)."""
    from pathlib import Path

    p = cfg.plan_table
    if p is None or p.is_absolute() or p.exists():
        return cfg
    in_repo = Path(__file__).resolve().parents[1] / p
    return cfg.model_copy(update={"plan_table": in_repo}) if in_repo.exists() else cfg


def load_or_plan(cfg: ServeConfig, templates: list[RequestTemplate]) -> tuple[PlanTable, int]:
    """The plan table covering ``templates`` (loaded and checked, or planned now) and the host
    memory the node has beyond its residencies (``check_runnable``)."""
    if cfg.plan_table is not None:
        other = [g.model for g in cfg.models if not g.default_dtypes]
        if other:
            # a table's plans were traced at the models' default dtypes (plan tables record no others)
            raise ValueError(f"{', '.join(other)}: dtype / component_dtypes differ from the model's default, but "
                             f"plan table {cfg.plan_table} was planned at the defaults: drop plan_table to plan at "
                             "start-up with them, or drop the dtype settings")
        table = PlanTable.load(str(cfg.plan_table))
        if cfg.device != "emulated":  # an emulated box is, by definition, the table's hardware
            table.check_hardware(machine_fingerprint(cfg, table.gpus), force=cfg.force_plan_table)
        missing = [t.shape_key for t in templates if t.shape_key not in table.entries]
        if missing:
            raise ValueError(f"plan table {cfg.plan_table} has no plan for {', '.join(missing)}")
        table = with_tiers(table, cfg)
    else:
        table = plan_now(cfg, templates)
    host = parse_bytes(cfg.emulated_host_memory) if cfg.device == "emulated" else None
    return table, check_runnable(table, cfg, templates, host_memory_bytes=host)


def with_tiers(table: PlanTable, cfg: ServeConfig) -> PlanTable:
    """``table`` with the deployment's quality tiers priced where an entry has none (a table
    planned before tiers were, or by a planner that prices none): arithmetic on the entry's own
    predictions (``planner.tiers``), nothing measured. An entry planned at one tier (``xema plan
    --quality``) or already priced is left as it is."""
    bare = {k: e for k, e in table.entries.items() if not e.tiers and e.config.step_cache is None}
    if not bare:
        return table
    from planner.tiers import price_tiers  # the pricing's imports (diffusers among them) only where a price is missing

    priced = price_tiers(table.model_copy(update={"entries": bare}),
                         {g.model: g.quality_tiers for g in cfg.models if g.quality_tiers})
    return table.model_copy(update={"entries": {**table.entries, **priced.entries}})


def group_dtypes(cfg: ServeConfig) -> dict[str, Any]:
    """Per model whose group sets dtypes: (dtype, components kept in another) to trace it with."""
    from xema_ray.models import get_model_spec
    from xema_ray.models.base import model_dtypes

    return {g.model: model_dtypes(get_model_spec(g.model), g.dtype, g.component_dtypes)
            for g in cfg.models if not g.default_dtypes}


def plan_now(cfg: ServeConfig, templates: list[RequestTemplate], overhead_s: float = 0.0,
             video_overhead_s: float | None = None) -> PlanTable:
    """Plan ``templates`` for ``cfg`` now (the cost model, calibrated on this machine for ``cpu``);
    ``overhead_s`` is added to every image template's candidate latencies and ``video_overhead_s``
    (default: ``overhead_s``) to every video template's (what serving adds per request: a video
    is a job, submitted, stored and polled)."""
    from planner.latency import LatencyModel, with_reused_step_share
    from planner.pause_state import with_pause_bytes
    from planner.stages import plan_template
    from planner.tiers import price_tiers
    from planner.trace_model import TracePlannerModel
    from planner.traces import TraceCache

    budget = parse_bytes(cfg.budget)
    hardware = cfg.hardware or ("cpu" if cfg.device == "cpu" else "local-gpu")
    cache_dir = cfg.cache_dir
    latency = LatencyModel(hardware, store_path=cache_dir / "profiles.json" if cache_dir else None)
    if hardware == "cpu":
        latency.calibrate(templates)  # one measured request per template: seconds for the tiny models
    cache = TraceCache(cache_dir / "traces" if cache_dir else None, dtypes=group_dtypes(cfg))
    entries = {}
    infeasible = []
    gpus_of = {g.model: g.workers for g in cfg.models}
    sp_degrees = [1] if cfg.worker_set == "inprocess" else None  # in-process workers run SP 1 only
    for t in templates:
        extra = overhead_s if t.spec.kind != "video" or video_overhead_s is None else video_overhead_s
        seconds = latency.seconds if not extra else (lambda c, f=latency.seconds, x=extra: f(c) + x)
        model = TracePlannerModel(t, seconds, cache)
        plan = plan_template(model, t, gpus_of[t.model], budget, slo_scale=cfg.slo_scale, latency_source=latency.source,
                             sp_degrees=sp_degrees)
        if plan.entry is None:
            infeasible.append(t.shape_key)
        else:
            entries[t.shape_key] = with_reused_step_share(with_pause_bytes(plan.entry, cache), latency)
            logger.info("planned %s: %s", t.shape_key, plan.entry.config.describe())
    if infeasible:
        raise ValueError(
            f"no configuration serves {', '.join(infeasible)} within the {cfg.budget} budget per worker; "
            "raise the budget, add workers or drop these templates"
        )
    gpus = max(gpus_of.values())
    table = PlanTable(hardware=latency.fingerprint(gpus), gpus=gpus, budget_bytes=budget, slo_scale=cfg.slo_scale,
                      group_gpus={g.model: g.gpus for g in cfg.models},  # DiT workers and decode pool
                      planner="xema", entries=entries, provenance=PlanProvenance(planned="at start-up"))
    # each template's quality tiers priced (the planner's tiers pass): the groups serve what is priced
    return price_tiers(table, {g.model: g.quality_tiers for g in cfg.models if g.quality_tiers})


def demo_table(config: str, out: str, overhead_s: float = 0.0, video_overhead_s: float | None = None) -> PlanTable:
    """Plan what ``config``'s first application serves, as start-up would without a plan table
    (``plan_now``, calibrated on this machine, no cache kept), with ``overhead_s`` — the serving
    path's seconds per batch on this machine (BENCHMARKS.md "Serving overhead") — added to every
    candidate's latency (so the SLOs and the simulator price what a request pays end to end),
    and write it to ``out``: the committed table ``make serve`` starts from without planning."""
    import time
    from datetime import UTC, datetime

    import yaml

    raw = yaml.safe_load(open(config))["applications"][0]["args"]
    args = {k: v for k, v in raw.items() if k not in ("plan_table", "cache_dir")}
    cfg = ServeConfig.model_validate({**args, "cache_dir": None})
    from xema_ray.serving.startup import served_templates

    start = time.monotonic()
    video = overhead_s if video_overhead_s is None else video_overhead_s
    table = plan_now(cfg, served_templates(cfg), overhead_s=overhead_s, video_overhead_s=video)
    table = with_decode_pools(table, cfg, served_templates(cfg))  # the groups with a decode: block
    table = with_node_host(table, cfg, served_templates(cfg))
    table = table.model_copy(update={"provenance": table.provenance.model_copy(update={
        "command": f"python -m deployments.planning {config} --out {out} --overhead-s {overhead_s:g} "
                   f"--video-overhead-s {video:g}",
        "planned": f"as start-up plans {config}, the serving path's seconds added to every latency: "
                   f"{overhead_s * 1000:.0f} ms per image request, {video * 1000:.0f} ms per video job",
        "planned_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "wall_s": round(time.monotonic() - start, 1),
        "notes": {"serving_overhead_s": f"{overhead_s:.4f}", "video_serving_overhead_s": f"{video:.4f}"}})})
    table.save(out)
    return table


def with_node_host(table: PlanTable, cfg: ServeConfig, templates: list[RequestTemplate]) -> PlanTable:
    """``table`` with the node's host memory for ``cfg``'s groups recorded (``table.host``), counted as
    start-up counts it (``xema_ray.serving.startup.node_host``, each group's figure with its basis):
    start-up then takes the figures from the table instead of building every model on the meta device."""
    from xema_ray.serving.startup import node_host

    return table.model_copy(update={"host": node_host(table.model_copy(update={"host": None}), cfg, templates)})


def with_decode_pools(table: PlanTable, cfg: ServeConfig, templates: list[RequestTemplate]) -> PlanTable:
    """``table`` with the planner's decode-stage pass run, as ``--stages split``, for the groups whose
    YAML holds a ``decode:`` block (docs/decode-stage.md): each of their video templates' decode on
    the pool the YAML runs where it fits (``planner.decode_stage.choose_decode``; one pool per group,
    ``one_pool``), the choice and its figures in ``provenance.decode_stages``, the pooled entries'
    quality tiers priced again on their new predictions; the group planned on its DiT workers and the
    pool's GPUs (``GroupShape.gpus``: serving runs the pool on top of the DiT workers). The other
    groups' entries are kept as they are."""
    from planner.decode_stage import choose_decode, decode_facts, one_pool
    from planner.latency import LatencyModel
    from planner.trace_model import TracePlannerModel
    from planner.traces import TraceCache

    pooled = {g.model: g for g in cfg.models if g.decode is not None}
    mine = [t for t in templates if t.model in pooled]
    if not mine:
        return table
    latency = LatencyModel("cpu" if cfg.device == "cpu" else (cfg.hardware or "local-gpu"))
    if latency.name == "cpu":
        latency.calibrate(mine)
    cache = TraceCache(None, dtypes=group_dtypes(cfg))
    entries, choices = dict(table.entries), dict(table.provenance.decode_stages)
    for model, g in pooled.items():
        before = {t.shape_key: table.entries[t.shape_key] for t in mine if t.model == model}
        after, decodes = {}, {}
        for k, e in before.items():
            # on the group's GPUs with the pool's, which serving runs on top of its DiT workers
            facts = decode_facts(TracePlannerModel(e.config.template, latency.seconds, cache), e.config, g.gpus)
            if cfg.worker_set == "inprocess":  # its DiT workers run SP 1 only (deployments/app.py)
                facts = facts.model_copy(update={"dit_stages": tuple(s for s in facts.dit_stages if s.config.sp == 1)})
            after[k], choice = choose_decode(e, facts, latency, g.gpus, table.budget_bytes, "split", pool=g.pool)
            if choice is not None:
                decodes[k] = choice
        after, decodes = one_pool(before, after, decodes, g.gpus)
        entries.update(after)
        choices.update(decodes)
    # a pooled entry's prediction is new: its tiers are priced again on it (``with_tiers``)
    entries = {k: e if e == table.entries[k] else e.model_copy(update={"tiers": {}}) for k, e in entries.items()}
    provenance = table.provenance.model_copy(update={"decode_stages": choices})
    group_gpus = {**table.group_gpus, **{m: g.gpus for m, g in pooled.items()}}  # a pool comes on top of workers
    return with_tiers(table.model_copy(update={"entries": entries, "provenance": provenance,
                                               "group_gpus": group_gpus}), cfg)


def pools_only(config: str, out: str) -> PlanTable:
    """``out``'s table with only the decode-stage pass run again for ``config``'s groups that hold a
    ``decode:`` block (``with_decode_pools``), written back to ``out``."""
    import yaml

    raw = yaml.safe_load(open(config))["applications"][0]["args"]
    args = {k: v for k, v in raw.items() if k not in ("plan_table", "cache_dir")}
    cfg = ServeConfig.model_validate({**args, "cache_dir": None})
    from xema_ray.serving.startup import served_templates

    before = PlanTable.load(out)
    pooled = sorted(k for k, e in before.entries.items() if e.config.decode is not None)
    if pooled:  # the pass compares a pool with the entry's decode in place: it needs the in-place entries
        raise ValueError(f"{out}: {', '.join(pooled)} already decode on a pool; plan the whole table again "
                         "(make demo-plan), which runs the decode-stage pass on the in-place entries")
    table = with_decode_pools(before, cfg, served_templates(cfg))
    raw = json.loads(Path(out).read_text())  # only what the pass changed is written: the rest stays byte for byte
    for k, e in table.entries.items():
        if e != before.entries[k]:
            raw["entries"][k] = e.model_dump(mode="json")
    raw["provenance"]["decode_stages"] = {k: d.model_dump(mode="json") for k, d in table.provenance.decode_stages.items()}
    raw["group_gpus"] = table.group_gpus  # a pooled group counts its pool's GPUs on top of its DiT workers
    raw["host"] = with_node_host(table, cfg, served_templates(cfg)).host.model_dump(mode="json")  # type: ignore[union-attr]
    Path(out).write_text(json.dumps(raw, indent=1))
    return PlanTable.load(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m deployments.planning",
                                description="write the plan table a serve YAML's start-up would plan (the demo's "
                                            "committed table: make demo-plan)")
    p.add_argument("config", help="a serve YAML, e.g. deployments/xema.yaml")
    p.add_argument("--out", required=True, help="the table to write, e.g. plans/demo-cpu.json")
    p.add_argument("--overhead-s", type=float, default=0.0,
                   help="seconds the serving path adds per image request on this machine (loadtests.run measures it: "
                        "client latency minus the batch's seconds), added to every image template's latencies")
    p.add_argument("--video-overhead-s", type=float, default=None,
                   help="the same for a video job (submitted, stored, polled); default: --overhead-s")
    p.add_argument("--decode-pools-only", action="store_true",
                   help="keep --out's entries and run only the decode-stage pass (--stages split) for the groups "
                        "with a decode: block (on a table whose entries decode in place)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        table = (pools_only(a.config, a.out) if a.decode_pools_only
                 else demo_table(a.config, a.out, a.overhead_s, a.video_overhead_s))
    except ValueError as e:
        print(f"python -m deployments.planning: {e}", file=sys.stderr)
        return 2
    for k, e in sorted(table.entries.items()):
        print(f"{k}: {e.config.describe()} latency {e.prediction.latency_s:.3f} s, SLO {e.prediction.slo_s:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
