"""Baselines and ablations (paper §9.1, Figure 14), over the same models and SLO as Xema.

- ``grid``: exhaustive search over SP × BS × every combination of the mitigation catalogue
  (the same space Xema searches; the paper's 6.3 h point of comparison).
- ``heuristic``: the paper's Heuristic — fine-grained primitives, but greedy: the smallest SP that
  fits and meets the SLO, mitigations by largest memory saving first, batch grown while goodput
  improves.
- ``vllm-omni``: only vLLM-Omni's native controls, applied globally (layerwise offload of every
  block, VAE slicing = decode one request at a time, HSDP of every block), grid-searched.
- ``extendedlib``: Xema's primitives but each applied globally at full intensity, grid-searched.
- ``no-memory-planning`` / ``no-parallelism-planning`` / ``no-concurrency``: Figure 14's
  ablations — Xema with global mitigation switches, with SP fixed to 1, with BS fixed to 1.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

from xema_ray.plan import ExecutionConfig, Mitigation, PlanEntry, PlanPrediction
from xema_ray.vocabulary import LatencySource, PlanLatencySource
from xema_ray.templates import RequestTemplate

from planner.model import PlannerModel
from planner.stages import (
    CountingModel,
    Scored,
    StageLog,
    TemplatePlan,
    confirmed,
    factors,
    plan_template,
    sp_split,
    stage4,
    why_lost,
    with_actions,
)

# every primitive of Xema's library, each switched on globally at full intensity
EXTENDED_LIBRARY = ("block_offload", "hsdp", "dit_chunking", "vae_chunking", "activation_offload", "temporary_serialization")
BASELINES = ("grid", "heuristic", "vllm-omni", "extendedlib", "no-memory-planning", "no-parallelism-planning", "no-concurrency")


@dataclass(frozen=True)
class SearchSpace:
    gpus: int
    budget: int
    slo_s: float
    max_batch: int


def _layouts(template: RequestTemplate, gpus: int, sps: Iterable[int] | None = None) -> list[tuple[int, int, int]]:
    heads = template.spec.attention_heads
    return [(*sp_split(sp, heads), gpus // sp) for sp in (sps or factors(gpus))]


def _base_configs(template: RequestTemplate, space: SearchSpace, sps: Iterable[int] | None = None,
                  batches: Iterable[int] | None = None) -> list[ExecutionConfig]:
    out = []
    for u, r, dp in _layouts(template, space.gpus, sps):
        for bs in batches or range(1, space.max_batch + 1):
            try:
                out.append(ExecutionConfig(template=template, ulysses=u, ring=r, dp=dp, batch=bs))
            except ValueError:
                continue
    return out


def _entry(model: CountingModel, ranked: list[Scored], space: SearchSpace, source: str) -> PlanEntry | None:
    """The best-ranked configuration that survives traced confirmation, as Xema's is confirmed:
    every planner's choice is checked against the same analyzer before it is served."""
    slo_s = space.slo_s
    ranked = confirmed(model, ranked, space.budget, slo_s, StageLog())
    if not ranked or ranked[0].goodput == 0:
        return None
    best = ranked[0]
    return PlanEntry(
        config=best.config,
        prediction=PlanPrediction(peak_bytes=best.peak, latency_s=best.latency, goodput_rps=best.goodput,
                                  slo_s=slo_s, latency_source=source),
        runner_up=why_lost(best, ranked[1], slo_s) if len(ranked) > 1 else None,
        candidates_profiled=len(model.counter.profiled),
    )


def global_switches(model: PlannerModel, cfg: ExecutionConfig, kinds: tuple[str, ...]) -> list[tuple[Mitigation, ...]]:
    """Every subset of the model's full-intensity mitigations whose kind is in ``kinds``
    (each subset = one combination of global on/off switches)."""
    full = [m for m in model.full_mitigation(cfg) if m.kind in kinds]
    if "hsdp" in kinds and cfg.sp > 1:
        offload = next((m for m in model.full_mitigation(cfg) if m.kind == "block_offload"), None)
        if offload is not None:
            full.append(Mitigation(kind="hsdp", blocks=offload.blocks, intensity=offload.intensity))
    subsets = []
    for r in range(len(full) + 1):
        for combo in itertools.combinations(full, r):
            blocks = [m for m in combo if m.kind in ("block_offload", "hsdp")]
            if len(blocks) <= 1:  # a block is either offloaded or sharded, not both
                subsets.append(combo)
    return subsets


def grid_over(model: CountingModel, bases: list[ExecutionConfig], space: SearchSpace,
              mitigation_sets, deadline: float | None = None) -> tuple[list[Scored], bool]:  # type: ignore[no-untyped-def]
    """Evaluate every base × mitigation set; returns (ranked configurations that fit, finished).

    Bases come per layout in increasing batch; once nothing fits at some batch, larger batches of
    that layout are skipped (memory only grows with the batch), as any grid search would."""
    fits = []
    dead: set[tuple[int, int, int]] = set()
    for base in bases:
        layout = (base.ulysses, base.ring, base.dp)
        if layout in dead:
            continue
        any_fit = False
        for actions in mitigation_sets(base):
            if deadline is not None and time.monotonic() > deadline:
                return stage4(model, fits, space.budget, space.slo_s), False
            cfg = with_actions(base, tuple(actions))
            model.latency(cfg)  # the grid profiles every point it visits
            if model.memory(cfg, space.budget).fits:
                fits.append(cfg)
                any_fit = True
        if not any_fit:
            dead.add(layout)
    return stage4(model, fits, space.budget, space.slo_s), True


def catalogue(model: PlannerModel, cfg: ExecutionConfig, budget: int) -> list[tuple[Mitigation, ...]]:
    """Every combination of at most one option per kind, over the options stage 3 could pick for
    the base configuration's intervals: the space Xema searches, enumerated exhaustively."""
    base_view = model.memory(cfg, budget)
    per_kind: dict[str, set[Mitigation]] = {}
    for iv in base_view.intervals:
        for opt in model.options(cfg, iv):
            for a in opt.actions:
                per_kind.setdefault(a.kind, set()).add(a)
    kinds = sorted(per_kind)
    choices = [[None, *sorted(per_kind[k], key=lambda m: m.model_dump_json())] for k in kinds]
    out = []
    for combo in itertools.product(*choices):
        acts = tuple(a for a in combo if a is not None)
        if sum(a.kind in ("block_offload", "hsdp") for a in acts) <= 1:
            out.append(acts)
    return out


def run_baseline(name: str, model: PlannerModel, template: RequestTemplate, space: SearchSpace,
                 source: PlanLatencySource = LatencySource.ESTIMATED, time_limit_s: float | None = None) -> tuple[PlanEntry | None, CountingModel, bool]:
    """Plan ``template`` with a baseline; returns (entry, counting model, finished)."""
    counting = CountingModel(model)
    deadline = time.monotonic() + time_limit_s if time_limit_s else None
    if name == "grid":
        counting.compact = True  # only fits / peak are asked of the points it visits
        bases = _base_configs(template, space)
        ranked, done = grid_over(counting, bases, space, lambda b: catalogue(counting, b, space.budget), deadline)
        return _entry(counting, ranked, space, source), counting, done
    if name == "vllm-omni":
        kinds = ("block_offload", "hsdp", "temporary_serialization")

        def native(b: ExecutionConfig) -> list[tuple[Mitigation, ...]]:
            # VAE slicing decodes one request at a time: serialization of the VAE only
            return [tuple(m for m in s if not (m.kind == "temporary_serialization" and m.modules != ("vae.decoder",)))
                    for s in global_switches(counting, b, kinds)]

        ranked, done = grid_over(counting, _base_configs(template, space), space, native, deadline)
        return _entry(counting, ranked, space, source), counting, done
    if name == "extendedlib":
        kinds = EXTENDED_LIBRARY
        ranked, done = grid_over(counting, _base_configs(template, space), space,
                                 lambda b: global_switches(counting, b, kinds), deadline)
        return _entry(counting, ranked, space, source), counting, done
    if name == "heuristic":
        return _heuristic(counting, template, space, source), counting, True
    if name in ("no-memory-planning", "no-parallelism-planning", "no-concurrency"):
        plan = _ablation(name, counting, template, space, source)
        return plan.entry, counting, True
    raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")


def _global_resolve(model: CountingModel, cfg: ExecutionConfig, budget: int, log: StageLog) -> ExecutionConfig | None:
    """Stage 3 without memory-control planning: the fastest set of global switches that fits."""
    kinds = EXTENDED_LIBRARY
    fits = [with_actions(cfg, s) for s in global_switches(model, cfg, kinds)]
    fits = [c for c in fits if model.memory(c, budget).fits]
    if not fits:
        log.infeasible.append(cfg.describe())
        return None
    return min(fits, key=lambda c: model.latency(c))


def ablation_plan(name: str, model: CountingModel, template: RequestTemplate, space: SearchSpace,
                  source: PlanLatencySource = LatencySource.ESTIMATED) -> TemplatePlan:
    """One of Figure 14's ablations as a full template plan (its stage-4 ranking included, from
    which the load-aware choice picks)."""
    if name not in ("no-memory-planning", "no-parallelism-planning", "no-concurrency"):
        raise ValueError(f"{name!r} is not an ablation")
    return _ablation(name, model, template, space, source)


def _ablation(name: str, model: CountingModel, template: RequestTemplate, space: SearchSpace, source: str) -> TemplatePlan:
    kwargs: dict = {"slo_s": space.slo_s, "latency_source": source}
    if name == "no-memory-planning":
        kwargs["resolve_fn"] = _global_resolve
    elif name == "no-parallelism-planning":
        kwargs["sp_degrees"] = [1]
    max_batch = 1 if name == "no-concurrency" else space.max_batch
    return plan_template(model, template, space.gpus, space.budget, max_batch=max_batch, **kwargs)


def _heuristic(model: CountingModel, template: RequestTemplate, space: SearchSpace, source: str) -> PlanEntry | None:
    """Greedy: for SP = 1, 2, ...: at each batch, add the option that frees the most memory until
    the configuration fits; keep the first SP whose fitted single request meets the SLO and grow
    its batch while goodput improves."""
    def greedy_fit(cfg: ExecutionConfig) -> ExecutionConfig | None:
        for _ in range(64):
            view = model.memory(cfg, space.budget)
            if view.fits:
                return cfg
            opts = model.options(cfg, view.intervals[0])
            if not opts:
                return None
            best = min(opts, key=lambda o: model.memory(with_actions(cfg, o.actions), space.budget).peak_bytes)
            nxt = with_actions(cfg, best.actions)
            if model.memory(nxt, space.budget).peak_bytes >= view.peak_bytes:
                return None
            cfg = nxt
        return None

    for u, r, dp in _layouts(template, space.gpus):
        chosen: list[ExecutionConfig] = []
        for bs in range(1, space.max_batch + 1):
            try:
                base = ExecutionConfig(template=template, ulysses=u, ring=r, dp=dp, batch=bs)
            except ValueError:
                break
            fitted = greedy_fit(base)
            if fitted is None:
                break
            if bs == 1 and model.latency(fitted) > space.slo_s:
                break  # this SP cannot meet the SLO even alone: greedily try the next one
            if chosen and stage4(model, [chosen[-1], fitted], space.budget, space.slo_s)[0].config != fitted:
                break  # goodput stopped improving
            chosen.append(fitted)
        if chosen:
            ranked = stage4(model, chosen, space.budget, space.slo_s)
            return _entry(model, ranked, space, source)
    return None
