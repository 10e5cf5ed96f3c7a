"""The paper's four stages (§7.3, Figure 8) that the ``templates`` pass (``planner.pipeline.PASSES``)
runs for each template, against ``PlannerModel``.

1. Parallelism and batch search: SP ∈ factors(N), DP = N / SP, BS = 1, 2, ... per layout, pruned
   by the SLO rule (unmitigated latency already over the SLO; checked first, it needs no trace)
   and the memory rule (infeasible even with every mitigation at full intensity); a layout stops
   growing its batch once pruned.
2. Locate where memory exceeds the budget: the candidate's pressure intervals.
3. Mitigation search per interval: zero-overhead choices first, then the remaining options; keep
   those that bring the interval under budget; the lowest-latency one wins (profiled). Options
   come in families that differ only in intensity (offload / shard K blocks, chunk by c, ...):
   memory falls and latency rises along a family, so only its mildest clearing option is
   profiled (found by binary search on memory), a coarse rung is taken down block by block where
   the model can (``RefiningModel.milder``), and combinations are enumerated as pairs of an
   activation option too weak alone with the mildest weight option that then clears; when no
   single option clears, the steepest one is applied and the interval is searched again.
4. Select: latency and goodput per assembled configuration, SLO filter, best goodput.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from xema_ray.memory.analysis import PressureInterval
from xema_ray.plan import ExecutionConfig, Mitigation, PlanEntry, PlanPrediction
from xema_ray.vocabulary import LatencySource, PlanLatencySource
from xema_ray.templates import RequestTemplate

from planner.model import CostCounter, MemoryView, MitigationOption, PlannerModel

SLO_FACTOR = 2.5  # §9.1: SLO = 2.5 × latency of the template's best feasible configuration
REPLACEABLE = ("block_offload", "hsdp")
#: kinds of which a configuration holds one action: a later one replaces it wherever it is
#: (VAE chunking shapes overlap: per-unit paths and chains over the same up-blocks)
SINGLE = ("vae_chunking",)
MAX_ROUNDS = 4096  # stage-3 rounds per candidate; a 4K video has over a thousand intervals (per block, per step, per VAE unit)


@dataclass
class StageLog:
    """What each stage did, for the summary table and the tests."""

    pruned_memory: list[str] = field(default_factory=list)
    pruned_slo: list[str] = field(default_factory=list)
    survivors: list[str] = field(default_factory=list)
    intervals: dict[str, int] = field(default_factory=dict)
    infeasible: list[str] = field(default_factory=list)
    assembled: dict[str, float] = field(default_factory=dict)  # config -> latency


@dataclass
class CountingModel:
    """Wraps a model to memoise by configuration and count distinct profiled / analysed configs."""

    model: PlannerModel
    counter: CostCounter = field(default_factory=CostCounter)
    #: keep only each view's peak and first interval (enough for fits / peak): grid search visits
    #: tens of thousands of configurations, and a video view can hold a hundred VAE intervals
    compact: bool = False
    _lat: dict[str, float] = field(default_factory=dict)
    _mem: dict[tuple[str, int], MemoryView] = field(default_factory=dict)

    def memory(self, cfg: ExecutionConfig, budget: int) -> MemoryView:
        key = (_key(cfg), budget)
        if key not in self._mem:
            self.counter.analysed.add(key[0])
            view = self.model.memory(cfg, budget)
            self._mem[key] = MemoryView(view.peak_bytes, view.intervals[:1]) if self.compact else view
        return self._mem[key]

    def latency(self, cfg: ExecutionConfig) -> float:
        key = _key(cfg)
        if key not in self._lat:
            self.counter.profiled.add(key)
            self._lat[key] = self.model.latency(cfg)
        return self._lat[key]

    def options(self, cfg: ExecutionConfig, interval: PressureInterval):  # type: ignore[no-untyped-def]
        return self.model.options(cfg, interval)

    def full_mitigation(self, cfg: ExecutionConfig) -> tuple[Mitigation, ...]:
        return self.model.full_mitigation(cfg)


def _key(cfg: ExecutionConfig) -> str:
    return cfg.model_dump_json()


def factors(n: int) -> list[int]:
    if n < 1:
        raise ValueError(f"GPU count must be >= 1, got {n}")
    return [d for d in range(1, n + 1) if n % d == 0]


def sp_split(sp: int, heads: int) -> tuple[int, int]:
    """(ulysses, ring) for an SP degree: as much Ulysses as the heads allow (all-to-all is cheaper
    than ring passes on one node), the rest as ring."""
    ulysses = math.gcd(sp, heads)
    return ulysses, sp // ulysses


def with_actions(cfg: ExecutionConfig, actions: tuple[Mitigation, ...]) -> ExecutionConfig:
    """``cfg`` plus ``actions``; a block offload / HSDP action replaces any earlier weight action,
    a chunking or serialization action replaces one of its kind at the same location."""
    current = list(cfg.mitigations)
    for a in actions:
        current = [
            m for m in current
            if not (
                # a block's weights are either offloaded or sharded: one weight action at a time
                (a.kind in REPLACEABLE and m.kind in REPLACEABLE)
                or (a.kind in SINGLE and m.kind == a.kind)
                or (m.kind == a.kind and (m.modules, m.events, m.blocks) == (a.modules, a.events, a.blocks))
            )
        ]
        current.append(a)
    return cfg.model_copy(update={"mitigations": tuple(current)})


def merged(cfg: ExecutionConfig) -> ExecutionConfig:
    """One DiT chunking action per chunk count: stage 3 chunks the blocks of each interval it
    meets (a long video has an interval per block and step), the plan lists them together."""
    chunking = [m for m in cfg.mitigations if m.kind == "dit_chunking" and m.blocks is not None]
    if len(chunking) < 2:
        return cfg
    by_chunks: dict[int, set[int]] = {}
    for m in chunking:
        by_chunks.setdefault(m.intensity, set()).update(m.blocks or ())
    rest = [m for m in cfg.mitigations if m not in chunking]
    joined = [Mitigation(kind="dit_chunking", blocks=tuple(sorted(b)), intensity=c) for c, b in sorted(by_chunks.items())]
    return cfg.model_copy(update={"mitigations": (*rest, *joined)})


def _overlaps(a: PressureInterval, b: PressureInterval) -> bool:
    return a.start < b.stop and b.start < a.stop


ResolveFn = Callable[["CountingModel", ExecutionConfig, int, StageLog], "ExecutionConfig | None"]


# ---------------------------------------------------------------------------- stage 1
def stage1(
    model: CountingModel,
    template: RequestTemplate,
    gpus: int,
    budget: int,
    slo_s: float | None,
    max_batch: int,
    log: StageLog,
    sp_degrees: list[int] | None = None,
) -> list[ExecutionConfig]:
    """Candidates (SP, DP, BS) surviving the memory and SLO rules."""
    heads = template.spec.attention_heads
    survivors = []
    for sp in sp_degrees or factors(gpus):
        ulysses, ring = sp_split(sp, heads)
        for bs in range(1, max_batch + 1):
            try:
                cfg = ExecutionConfig(template=template, ulysses=ulysses, ring=ring, dp=gpus // sp, batch=bs)
            except ValueError as e:  # e.g. more ranks than tokens
                log.pruned_memory.append(f"SP{sp} BS{bs}: invalid ({e})")
                break
            # the SLO rule first: the unmitigated latency needs no trace (mitigations only add
            # time, so it bounds every mitigated one from below), while the memory rule needs
            # the analyzer's trace of this batch size: a batch too slow for the SLO is never traced
            if slo_s is not None and model.latency(cfg) > slo_s:
                log.pruned_slo.append(cfg.describe())
                break
            full = with_actions(cfg, model.full_mitigation(cfg))
            if not model.memory(full, budget).fits:
                log.pruned_memory.append(cfg.describe())
                break
            survivors.append(cfg)
            log.survivors.append(cfg.describe())
    return survivors


# ---------------------------------------------------------------------------- stages 2 + 3
def resolve(model: CountingModel, cfg: ExecutionConfig, budget: int, log: StageLog) -> ExecutionConfig | None:
    """Stages 2 and 3 for one survivor: locate pressure intervals, mitigate each, assemble.

    Returns the mitigated configuration, or None if some interval cannot be brought under budget.
    """
    current = cfg
    view = model.memory(current, budget)
    log.intervals[cfg.describe()] = len(view.intervals)
    # candidates met on the way that already fit everywhere: per-interval choices are greedy,
    # and one option that clears every interval can beat the sum of cheaper local ones
    complete: list[tuple[float, ExecutionConfig]] = []
    for _ in range(MAX_ROUNDS):  # each round removes at least one interval
        if view.fits:
            current = _relaxed(model, cfg, current, budget)
            if complete:
                lat, best = min(complete, key=lambda c: (c[0], len(c[1].mitigations)))
                if lat < model.latency(current):
                    return merged(best)
            return merged(current)
        interval = view.intervals[0]
        opts = model.options(current, interval)

        def relieves(candidate: ExecutionConfig, iv: PressureInterval = interval) -> MemoryView | None:
            v = model.memory(candidate, budget)
            return v if not any(_overlaps(iv, other) for other in v.intervals) else None

        chosen: tuple[ExecutionConfig, MemoryView] | None = None
        for opt in opts:  # zero-overhead choices first: the mildest that works costs nothing
            if opt.zero_overhead:
                cand = with_actions(current, opt.actions)
                v = relieves(cand)
                if v is not None:
                    chosen = (cand, v)
                    break
        if chosen is None:
            feasible = _cheapest_clearing(model, current, opts, interval, budget, relieves)
            if not feasible:
                # no single option clears the interval: combine (stage 3's enumeration of
                # combinations) by taking the one that lowers the interval's peak the most and
                # going round again; give up when nothing lowers it
                step = _steepest(model, current, opts, interval, budget)
                if step is None:
                    log.infeasible.append(cfg.describe())
                    return None
                current, view = step
                continue
            complete += [(lat, c) for lat, c, fv in feasible if fv.fits]
            _, cand, v = min(feasible, key=lambda f: (f[0], len(f[1].mitigations)))
            chosen = (cand, v)
        current, view = chosen
    log.infeasible.append(cfg.describe())
    return None


Relieves = Callable[[ExecutionConfig], "MemoryView | None"]


def _relaxed(model: CountingModel, base: ExecutionConfig, done: ExecutionConfig, budget: int) -> ExecutionConfig:
    """One pass over the assembled mitigations: each activation action is taken down to a milder
    member of its family — alone if the others still fit, or traded for the fewest weight blocks
    that then fit (profiled, kept if faster). An action chosen for an early interval, or on the
    steepest-descent path, can be stronger than the later ones leave necessary."""
    added = [m for m in done.mitigations if m not in base.mitigations]
    if len(added) < 2:
        return done  # a single action is already its family's mildest that clears
    families: dict[str, list[MitigationOption]] = {}
    for iv in model.memory(base, budget).intervals[:8]:  # the options of the first intervals
        for fam in _families(model.options(base, iv)):
            families.setdefault(fam[0].family_key, fam)
    weights = [f for f in families.values() if _is_weight(f[0])]

    def fits(c: ExecutionConfig) -> MemoryView | None:
        v = model.memory(c, budget)
        return v if v.fits else None

    current = done
    for action in added:
        if action.kind in REPLACEABLE:
            continue
        fam = next((f for f in families.values() if any(o.actions == (action,) for o in f)), None)
        if fam is None:
            continue
        at = next(i for i, o in enumerate(fam) if o.actions == (action,))
        best = (model.latency(current), current)
        for o in fam[:at]:
            cand = with_actions(current, o.actions)
            if fits(cand) is not None:
                best = min(best, (model.latency(cand), cand), key=lambda b: b[0])
                break
            for wf in weights:
                _, traded, _ = _first_clearing(model, cand, wf, fits)
                if traded is not None:
                    best = min(best, (model.latency(traded), traded), key=lambda b: b[0])
        current = best[1]
    return _fewest_weight_blocks(model, current, weights, fits)


def _fewest_weight_blocks(model: CountingModel, done: ExecutionConfig, weights: list[list[MitigationOption]],
                          fits: Relieves) -> ExecutionConfig:
    """The assembled weight action taken down to the fewest blocks (none at all) with which the
    configuration still fits, when that is not slower: an interval met early may have been
    cleared by offloading weights that the activation actions chosen later make unnecessary."""
    action = next((m for m in done.mitigations if m.kind in REPLACEABLE), None)
    if action is None:
        return done
    without = done.model_copy(update={"mitigations": tuple(m for m in done.mitigations if m is not action)})
    if fits(without) is not None:
        return without if model.latency(without) <= model.latency(done) else done
    best = done
    for wf in weights:
        if wf[0].actions[0].kind != action.kind:
            continue
        _, cand, _ = _first_clearing(model, without, wf, fits)
        if cand is not None and _weight_blocks(cand) < _weight_blocks(best) and model.latency(cand) <= model.latency(best):
            best = cand
    return best


def _families(opts: list[MitigationOption]) -> list[list[MitigationOption]]:
    fams: dict[str, list[MitigationOption]] = {}
    for o in opts:
        if not o.zero_overhead:
            fams.setdefault(o.family_key, []).append(o)
    return list(fams.values())


def _first_clearing(model: CountingModel, current: ExecutionConfig, family: list[MitigationOption],
                    relieves: Relieves) -> tuple[int, ExecutionConfig | None, MemoryView | None]:
    """Binary search (memory falls with intensity) for the family's mildest option that clears,
    taken down further where the model's ladder is coarser than the primitive (``_milder``);
    returns (its index or len(family), config, view)."""
    lo, hi, hit = 0, len(family), None
    while lo < hi:
        mid = (lo + hi) // 2
        cand = with_actions(current, family[mid].actions)
        v = relieves(cand)
        if v is not None:
            hi, hit = mid, (cand, v)
        else:
            lo = mid + 1
    if hit is None or lo >= len(family):
        return len(family), None, None
    return (lo, *_milder(model, *hit, family[lo].actions, relieves))


def _cheapest_clearing(model: CountingModel, current: ExecutionConfig, opts: list[MitigationOption],
                       interval: PressureInterval, budget: int,
                       relieves: Relieves) -> list[tuple[float, ExecutionConfig, MemoryView]]:
    """Stage 3's candidates for one interval, each with its profiled latency: per family, the
    mildest option that clears it (a stronger one of the same family only costs more); then
    pairs — an activation option too weak alone (chunking, serialization, activation offload)
    plus the mildest weight option that clears what it leaves, when that is milder than the
    weight option needed alone (the combinations grid search finds: e.g. Flux.2 at 256² fits
    with fewer sharded blocks once the batch's requests are serialized)."""
    feasible, alone_weight = [], {}
    partials: list[MitigationOption] = []
    for fam in _families(opts):
        i, cand, v = _first_clearing(model, current, fam, relieves)
        if cand is not None and v is not None:
            feasible.append((model.latency(cand), cand, v))
            if _is_weight(fam[i]):
                alone_weight[fam[i].family_key] = _weight_blocks(cand)
        if not _is_weight(fam[0]):
            partials += fam[:i]
    if not alone_weight:
        return feasible
    for p in partials:
        base = with_actions(current, p.actions)
        if base.mitigations == current.mitigations:
            continue
        left = [iv for iv in model.memory(base, budget).intervals if _overlaps(iv, interval)]
        if not left or max(iv.peak_bytes for iv in left) >= interval.peak_bytes:
            continue  # clears alone (then it was no partial) or does not help here
        for fam in _families(model.options(base, max(left, key=lambda iv: iv.peak_bytes))):
            needed = alone_weight.get(fam[0].family_key)
            if needed is None or not _is_weight(fam[0]):
                continue
            i, cand, v = _first_clearing(model, base, fam, relieves)
            if cand is not None and v is not None and _weight_blocks(cand) < needed:
                feasible.append((model.latency(cand), cand, v))
    return feasible


def _weight_blocks(cfg: ExecutionConfig) -> int:
    """How many blocks the configuration's weight action (offload or HSDP) covers."""
    return max((m.intensity for m in cfg.mitigations if m.kind in REPLACEABLE), default=0)


def _is_weight(opt: MitigationOption) -> bool:
    return len(opt.actions) == 1 and opt.actions[0].kind in REPLACEABLE


def _milder(model: CountingModel, cand: ExecutionConfig, view: MemoryView, actions: tuple[Mitigation, ...],
            relieves: Relieves) -> tuple[ExecutionConfig, MemoryView]:
    """Take a weight action down to the mildest intensity that still clears, where the model's
    option ladder is coarser than its primitive (``RefiningModel.milder``): memory only."""
    milder = getattr(model.model, "milder", None)
    if milder is None or len(actions) != 1 or actions[0].kind not in REPLACEABLE:
        return cand, view
    best = (cand, view)
    for action in milder(cand, actions[0]):
        c = with_actions(cand, (action,))
        v = relieves(c)
        if v is None:
            break
        best = (c, v)
    return best


def _interval_peak(view: MemoryView, interval: PressureInterval) -> int:
    return max((iv.peak_bytes for iv in view.intervals if _overlaps(iv, interval)), default=0)


def _steepest(model: CountingModel, current: ExecutionConfig, opts: list, interval: PressureInterval,  # type: ignore[type-arg]
              budget: int) -> tuple[ExecutionConfig, MemoryView] | None:
    """The option that lowers ``interval``'s peak the most (ties: lower latency), or None."""
    best: tuple[int, float, ExecutionConfig, MemoryView] | None = None
    for opt in opts:
        cand = with_actions(current, opt.actions)
        if cand.mitigations == current.mitigations:
            continue
        v = model.memory(cand, budget)
        key = (_interval_peak(v, interval), model.latency(cand))
        if key[0] < interval.peak_bytes and (best is None or key < best[:2]):
            best = (*key, cand, v)
    return None if best is None else (best[2], best[3])


# ---------------------------------------------------------------------------- stage 4
@dataclass(frozen=True)
class Scored:
    config: ExecutionConfig
    latency: float
    goodput: float
    peak: int


def goodput(cfg: ExecutionConfig, latency: float, slo_s: float) -> float:
    """Requests per second that meet the SLO: each of the DP groups finishes ``batch`` requests
    every ``latency`` seconds, or none in time if the batch latency exceeds the SLO."""
    return cfg.dp * cfg.batch / latency if latency <= slo_s else 0.0


def stage4(model: CountingModel, configs: list[ExecutionConfig], budget: int, slo_s: float) -> list[Scored]:
    """Score assembled configurations, best first (goodput, then lower latency, then fewer GPUs per group)."""
    scored = []
    for cfg in configs:
        lat = model.latency(cfg)
        scored.append(Scored(cfg, lat, goodput(cfg, lat, slo_s), model.memory(cfg, budget).peak_bytes))
    scored.sort(key=_rank)
    return scored


def _rank(s: Scored) -> tuple[float, float, int, int]:
    return (-s.goodput, s.latency, s.config.sp, len(s.config.mitigations))


def why_lost(best: Scored, other: Scored, slo_s: float) -> str:
    if other.goodput == 0:
        return f"{other.config.describe()}: latency {other.latency:.2f} s over the SLO {slo_s:.2f} s"
    return (f"{other.config.describe()}: goodput {other.goodput * 60:.2f}/min < {best.goodput * 60:.2f}/min "
            f"(latency {other.latency:.2f} s)")


def partial_batch_latencies(model: CountingModel, cfg: ExecutionConfig) -> dict[int, float]:
    """Latency of the config run with fewer requests than its batch (the dispatcher starts a
    partial batch when its wait window expires); the simulator replays these."""
    return {n: model.latency(cfg.for_batch(n)) for n in range(1, cfg.batch)}


MAX_CONFIRMATIONS = 6  # traced confirmations per template before giving up on the ranking


def confirmed(model: CountingModel, ranked: list[Scored], budget: int, slo_s: float, log: StageLog,
              resolve_fn: ResolveFn | None = None) -> list[Scored]:
    """Drop leading configurations that the model's ``confirm`` (a trace with the mitigations
    applied) rejects; models without ``confirm`` (synthetic ones) are taken at their word.

    With ``resolve_fn``, a configuration that runs but overshoots the budget is resolved again
    (stages 2-3) against a budget tighter by the overshoot, and the result competes in the
    ranking: the analytic memory model was that far off for this candidate, so only its
    mitigation, not its parallelism or batch, was wrong. If that overshoots as well, the budget
    is tightened again by the new overshoot (up to a quarter of the budget in all)."""
    confirm = getattr(model.model, "confirm", None)
    if confirm is None:
        return ranked
    out = list(ranked)
    tightened: dict[str, int] = {}  # base config -> how far its budget was tightened so far
    for _ in range(MAX_CONFIRMATIONS):
        if not out or out[0].goodput == 0:
            break
        top = out[0]
        rejection = confirm(top.config, budget)
        if rejection is None:
            break
        log.infeasible.append(f"{top.config.describe()}: {rejection.reason}")
        out.pop(0)
        base = top.config.model_copy(update={"mitigations": ()})
        key = base.describe()
        # tighter by this overshoot on top of earlier ones (+ 0.5 % slack): the model was at
        # least that optimistic for this base configuration
        tighter = tightened.get(key, 0) + rejection.overshoot_bytes + budget // 200
        if resolve_fn is not None and rejection.overshoot_bytes > 0 and tightened.get(key, 0) < budget // 4 < budget - tighter:
            tightened[key] = tighter
            again = resolve_fn(model, base, budget - tighter, log)
            if again is not None:
                out = sorted([*out, *stage4(model, [again], budget, slo_s)], key=_rank)
    return out


# ---------------------------------------------------------------------------- whole template
@dataclass
class TemplatePlan:
    entry: PlanEntry | None
    log: StageLog
    counter: CostCounter
    slo_s: float | None
    ranked: list[Scored]


def best_feasible_latency(model: CountingModel, template: RequestTemplate, gpus: int, budget: int,
                          log: StageLog, sp_degrees: list[int] | None = None) -> float | None:
    """Latency of the template's best feasible configuration at batch 1 (the SLO's reference)."""
    cands = stage1(model, template, gpus, budget, None, 1, log, sp_degrees)
    done = [c for c in (resolve(model, c, budget, log) for c in cands) if c is not None]
    return min((model.latency(c) for c in done), default=None)


def plan_template(
    model: PlannerModel,
    template: RequestTemplate,
    gpus: int,
    budget: int,
    slo_scale: float = 1.0,
    slo_s: float | None = None,
    max_batch: int = 8,
    latency_source: PlanLatencySource = LatencySource.ESTIMATED,
    sp_degrees: list[int] | None = None,
    resolve_fn: ResolveFn = resolve,
) -> TemplatePlan:
    """Run the four stages for one template. ``slo_s`` overrides the 2.5×-best-latency SLO."""
    counting = model if isinstance(model, CountingModel) else CountingModel(model)
    log = StageLog()
    if slo_s is None:
        ref = best_feasible_latency(counting, template, gpus, budget, StageLog(), sp_degrees)
        if ref is None:
            return TemplatePlan(None, log, counting.counter, None, [])
        slo_s = SLO_FACTOR * ref * slo_scale
    survivors = stage1(counting, template, gpus, budget, slo_s, max_batch, log, sp_degrees)
    assembled = [c for c in (resolve_fn(counting, c, budget, log) for c in survivors) if c is not None]
    ranked = stage4(counting, assembled, budget, slo_s)
    for s in ranked:
        log.assembled[s.config.describe()] = s.latency
    ranked = confirmed(counting, ranked, budget, slo_s, log, resolve_fn)
    if not ranked or ranked[0].goodput == 0:
        return TemplatePlan(None, log, counting.counter, slo_s, ranked)
    best = ranked[0]
    # the traced confirmation's peak where there is one (the analytic transform only ranks)
    traced = getattr(counting.model, "traced_peaks", {}).get(best.config.model_dump_json())
    entry = PlanEntry(
        config=best.config,
        prediction=PlanPrediction(peak_bytes=traced if traced is not None else best.peak, latency_s=best.latency, goodput_rps=best.goodput,
                                  slo_s=slo_s, latency_source=latency_source,
                                  latency_by_batch=partial_batch_latencies(counting, best.config)),
        runner_up=why_lost(best, ranked[1], slo_s) if len(ranked) > 1 else None,
        candidates_profiled=len(counting.counter.profiled),
    )
    return TemplatePlan(entry, log, counting.counter, slo_s, ranked)
