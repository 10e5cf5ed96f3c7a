"""The ``load_aware`` pass (``planner.pipeline.PASSES``): stage 4 under load, a model group's plans
chosen for the load it will see, not in isolation.

Stage 4 alone ranks each template's assembled configurations by isolated goodput (``stages.stage4``):
the most requests per second one template's plan finishes within its SLO when it has the GPUs to
itself. Under Poisson load that choice can lose: batches whose latency is most of the SLO queue
behind long requests of other templates and miss, where faster batch-1 or wider-SP plans keep
headroom; and past saturation, serving every template makes most requests miss.

Given the expected load of a model group (rate and mix, from a deployment, a traffic profile or a
figure's setting), ``choose_under_load`` picks one configuration per template among the ones
stages 1-3 assembled (``load_candidates``: distinct SP × batch, each confirmed like the goodput
choice), and the group's admission policy (``xema_ray.plan.AdmissionPolicy``: what happens to
requests that can no longer meet their SLO, and which templates are not admitted at this load), to
maximise the group's SLO attainment as estimated by a short run of the very dispatcher the simulator
and the live group use (``xema_ray.sim.simulate``), on its own seeds (not those of any evaluation).

The search is a local one from the goodput choice: the late-request policy, then each template's
configuration in turn (templates holding the most GPU time first), then refusing templates (those
costing the most GPU time per request first), then configurations again; a change is kept only when
it raises the estimated attainment by more than ``MIN_GAIN``. No load: the goodput choice stands.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.plan import AdmissionPolicy, PlanEntry, PlannedLoad, PlanPrediction, PlanTable
from xema_ray.vocabulary import PlanLatencySource
from xema_ray.sim.simulate import Arrival, SimulationConfig, poisson_arrivals, simulate

from planner.stages import CountingModel, Scored, StageLog, confirmed, partial_batch_latencies, why_lost

PLAN_SEEDS = (1001, 1002)  # the estimate's arrival seeds (figures evaluate on seeds 0, 1, 2)
PLAN_REQUESTS = 300  # arrivals per seed in one estimate
MIN_GAIN = 0.002  # a change must raise the estimated attainment by more than this (0.2 pp)
MAX_CANDIDATES = 10  # configurations kept per template
LATE_POLICIES = ("serve", "deprioritise", "shed")


class GroupLoad(BaseModel):
    """The load a model group is planned for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rate_per_min: float = Field(gt=0, description="requests/min arriving at the group")
    mix: dict[str, float] = Field(default_factory=dict, description="template shape key -> weight (empty: uniform)")
    slo_scale: float = Field(default=1.0, gt=0)


class CandidateTable(BaseModel):
    """Each template's assembled, confirmed configurations (goodput choice first): what the
    load-aware choice picks among, kept on disk so a figure can plan each of its points again."""

    model_config = ConfigDict(extra="forbid")

    entries: dict[str, list[PlanEntry]] = Field(default_factory=dict)


@dataclass(frozen=True)
class LoadChoice:
    entries: dict[str, PlanEntry]
    admission: AdmissionPolicy
    planned: PlannedLoad
    evaluations: int


def load_candidates(model: CountingModel, ranked: list[Scored], budget: int, slo_s: float,
                    latency_source: PlanLatencySource, limit: int = MAX_CANDIDATES) -> list[PlanEntry]:
    """The distinct (SP, batch) configurations of a template's stage-4 ranking that meet the SLO,
    best goodput first, each confirmed by the model's traced check where it has one; the first is
    the goodput choice. Every SP's batch-1 configuration is kept (the fastest per request)."""
    seen: set[tuple[int, int]] = set()
    picked: list[Scored] = []
    for s in ranked:
        key = (s.config.sp, s.config.batch)
        if s.goodput == 0 or key in seen:
            continue
        seen.add(key)
        if len(picked) < limit or s.config.batch == 1:
            picked.append(s)
    out = []
    for s in picked:
        if not confirmed(model, [s], budget, slo_s, StageLog()):
            continue  # the traced run rejects it
        out.append(entry_of(model, s, ranked, slo_s, latency_source))
    return out


def batch_candidates(entry: PlanEntry) -> list[PlanEntry]:
    """The plan run with fewer requests per batch (n = batch-1 .. 1): the very partial batches the
    dispatcher already starts with this plan when its wait window expires, so they fit its memory
    (activations shrink with the batch, weights and mitigations stay) and their latency is the
    plan's own ``latency_by_batch[n]``. Needs no planning: a plan table alone yields them."""
    out = []
    p = entry.prediction
    for n in range(entry.config.batch - 1, 0, -1):
        lat = p.latency_by_batch.get(n)
        if lat is None:
            continue
        cfg = entry.config.for_batch(n)
        pred = p.model_copy(update={"latency_s": lat, "goodput_rps": cfg.dp * n / lat if lat <= p.slo_s else 0.0,
                                    "latency_by_batch": {m: v for m, v in p.latency_by_batch.items() if m < n}})
        out.append(entry.model_copy(update={"config": cfg, "prediction": pred,
                                            "runner_up": f"batch {n} of {entry.config.describe()} (load-aware candidate)"}))
    return out


def candidate_pool(entries: list[PlanEntry]) -> list[PlanEntry]:
    """``entries`` (the goodput choice first) and each one's smaller batches, without repeats and
    without any over its SLO."""
    out: list[PlanEntry] = []
    for e in entries:
        for c in (e, *batch_candidates(e)):
            if c.prediction.latency_s <= c.prediction.slo_s and all(c.config != o.config for o in out):
                out.append(c)
    return out


def entry_of(model: CountingModel, s: Scored, ranked: list[Scored], slo_s: float, latency_source: PlanLatencySource) -> PlanEntry:
    other = next((r for r in ranked if r is not s), None)
    traced = getattr(model.model, "traced_peaks", {}).get(s.config.model_dump_json())
    return PlanEntry(
        config=s.config,
        prediction=PlanPrediction(peak_bytes=traced if traced is not None else s.peak, latency_s=s.latency,
                                  goodput_rps=s.goodput, slo_s=slo_s, latency_source=latency_source,
                                  latency_by_batch=partial_batch_latencies(model, s.config)),
        runner_up=why_lost(s, other, slo_s) if other is not None else None,
        candidates_profiled=len(model.counter.profiled),
    )


def _arrivals(load: GroupLoad, keys: list[str], seeds: tuple[int, ...], requests: int) -> list[list[Arrival]]:
    weights = {k: load.mix.get(k, 1.0 if not load.mix else 0.0) for k in keys}
    weights = {k: w for k, w in weights.items() if w > 0}
    duration_s = requests / load.rate_per_min * 60.0
    return [poisson_arrivals(load.rate_per_min, duration_s, weights, seed=s) for s in seeds]


def choose_under_load(table: PlanTable, candidates: dict[str, list[PlanEntry]], slos: dict[str, float],
                      load: GroupLoad, seeds: tuple[int, ...] = PLAN_SEEDS, requests: int = PLAN_REQUESTS) -> LoadChoice:
    """The configurations and admission policy of one model group (``table`` holds its goodput
    choices; ``candidates`` each template's alternatives, goodput choice first; ``slos`` every
    template of the group, planned or not, at scale 1) that maximise the estimated attainment."""
    keys = sorted(slos)
    models = {e.config.template.model for e in table.entries.values()}
    if len(models) > 1:
        raise ValueError(f"load-aware choice is per model group; the table holds {sorted(models)}")
    model = next(iter(models), "")
    arrivals = _arrivals(load, keys, seeds, requests)
    cands = {k: list(candidates.get(k) or ([table.entries[k]] if k in table.entries else [])) for k in keys}
    evaluations = 0

    def score(entries: dict[str, PlanEntry], adm: AdmissionPolicy | None) -> float:
        nonlocal evaluations
        evaluations += 1
        t = table.model_copy(update={"entries": entries, "admission": {model: adm} if adm is not None else {}})
        return sum(simulate(t, a, SimulationConfig(slo_scale=load.slo_scale, slos=slos)).attainment for a in arrivals) / len(arrivals)

    current = {k: c[0] for k, c in cands.items() if c}
    goodput_att = score(dict(current), None)
    adm = AdmissionPolicy()
    best = score(current, adm)
    if best >= 1.0 - 1e-9:
        return _choice(table, current, adm, load, best, goodput_att, evaluations)

    def weight(k: str) -> float:
        return load.mix.get(k, 1.0) if load.mix else 1.0

    def gpu_s(e: PlanEntry) -> float:  # GPU-seconds one request of the plan costs
        return e.config.sp * e.prediction.latency_s / e.config.batch

    def try_late() -> None:
        nonlocal adm, best
        for late in LATE_POLICIES:
            if late == adm.late:
                continue
            cand = adm.model_copy(update={"late": late})
            s = score(current, cand)
            if s > best + MIN_GAIN:
                adm, best = cand, s

    def try_configs() -> bool:
        nonlocal best
        moved = False
        for k in sorted(current, key=lambda k: -weight(k) * gpu_s(current[k])):
            if k in adm.refused:
                continue
            for c in cands[k]:
                if c is current[k]:
                    continue
                trial = {**current, k: c}
                s = score(trial, adm)
                if s > best + MIN_GAIN:
                    current[k], best, moved = c, s, True
        return moved

    def try_refuse() -> bool:
        nonlocal adm, best
        moved = False
        for k in sorted(current, key=lambda k: -gpu_s(current[k])):
            if k in adm.refused or len(adm.refused) + 1 >= len(current):
                continue  # a group serves at least one template
            cand = adm.model_copy(update={"refused": tuple(sorted((*adm.refused, k)))})
            s = score(current, cand)
            if s > best + MIN_GAIN:
                adm, best, moved = cand, s, True
        return moved

    try_late()
    try_configs()
    if try_refuse():
        try_late()
        try_configs()
    return _choice(table, current, adm, load, best, goodput_att, evaluations)


def _choice(table: PlanTable, entries: dict[str, PlanEntry], adm: AdmissionPolicy, load: GroupLoad, att: float,
            goodput_att: float, evaluations: int) -> LoadChoice:
    changed = tuple(sorted(k for k, e in entries.items() if k in table.entries and e.config != table.entries[k].config))
    planned = PlannedLoad(rate_per_min=load.rate_per_min, mix=dict(load.mix), slo_scale=load.slo_scale,
                          expected_attainment=min(1.0, att), goodput_attainment=min(1.0, goodput_att), changed=changed)
    return LoadChoice(entries, adm, planned, evaluations)


def apply_choice(table: PlanTable, model: str, choice: LoadChoice) -> PlanTable:
    """``table`` with ``model``'s entries, admission policy and planned load replaced by ``choice``."""
    entries = {k: e for k, e in table.entries.items() if e.config.template.model != model}
    entries.update(choice.entries)
    return table.model_copy(update={
        "entries": entries,
        "admission": {**table.admission, model: choice.admission},
        "planned_load": {**table.planned_load, model: choice.planned},
    })


def read_loads(path: str) -> dict[str, GroupLoad]:
    """A traffic profile: JSON ``{model: {"rate_per_min": ..., "mix": {template: weight}, "slo_scale": ...}}``."""
    from pathlib import Path

    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(dict[str, GroupLoad]).validate_json(Path(path).read_text())
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"{path}: {'.'.join(str(x) for x in err['loc'])}: {err['msg']} (expected "
                         '{"MODEL": {"rate_per_min": R, "mix": {"TEMPLATE": W}, "slo_scale": S}})') from None


def plan_groups_for_load(table: PlanTable, candidates: dict[str, list[PlanEntry]], slos: dict[str, float],
                         loads: dict[str, GroupLoad]) -> PlanTable:
    """``table`` (goodput choices) with each loaded model group's plans, admission policy and
    planned load chosen by ``choose_under_load``; groups without a load keep their goodput plans."""
    unknown = sorted(set(loads) - {e.config.template.model for e in table.entries.values()})
    if unknown:
        raise ValueError(f"the traffic profile names {', '.join(unknown)}, which the table does not plan")
    for model, load in loads.items():
        keys = [k for k, e in table.entries.items() if e.config.template.model == model]
        mix_unknown = sorted(set(load.mix) - set(keys))
        if mix_unknown:
            raise ValueError(f"{model}: the load's mix names templates it does not plan: {', '.join(mix_unknown)}")
        sub = table.model_copy(update={"entries": {k: table.entries[k] for k in keys},
                                       "gpus": table.group_gpus.get(model, table.gpus)})
        choice = choose_under_load(sub, {k: candidate_pool(candidates.get(k) or [table.entries[k]]) for k in keys},
                                   {k: slos[k] for k in keys}, load)
        table = apply_choice(table, model, choice)
    return table
