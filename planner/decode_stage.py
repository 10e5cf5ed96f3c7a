"""The ``decode_stage`` group pass: per template, the decode in place on the DiT workers (with the
mitigations it needs there) or a decode pool of its own (``ExecutionConfig.decode``), as
``xema plan --stages joint|split|auto`` asks.

In the traces of video templates the VAE decode is where memory peaks (``decode.vae``), and in
time the DiT workers, often an SP group, wait for it. A pool takes the latents when the last step
ends and frees the DiT workers for the next batch; it costs GPUs the DiT no longer has, a
hand-over per request, and a decode of its own per request. What is compared, per template:

- latency: in place, the entry's; with a pool, the DiT workers' stage (the entry's latency less its
  decode) + the hand-over + one request's decode on a decode worker (slower on a GPU fraction);
- memory: the DiT workers' peak without the decode interval (the trace's decode and post events
  left out, the entry's VAE mitigations dropped), and a decode worker's peak: the decode of one
  request with only the decoder's weights resident (``ModelSpec.decode_components``), unmitigated
  where that fits the worker's share of the budget, else with the entry's VAE mitigations;
- the pool's size and placement: ``p`` of the group's GPUs for the pool (the DiT keeps
  ``(gpus - p) // sp`` data-parallel groups), its workers on whole GPUs or on fractions that divide
  one (``DECODE_GPU_FRACTIONS``) where a decode fits the fraction's memory;
- goodput at the template's load: without a load, the two-stage pipeline's capacity is the slower
  stage's (``dp * batch / dit_s`` against ``workers * fraction / decode_s``), 0 over the SLO; with
  an expected load (``--load``) each side serves the template's share of it in the simulator
  (``xema_ray.sim``: the serving dispatcher, a pooled plan as two stages), so queueing counts: the
  goodput is the requests that met their SLO. A tie (within 1 %) goes to the lower latency, then
  to in place.

``split`` takes the best pool wherever one fits (in place, saying why, where none does); ``auto``
takes whichever serves more; ``joint`` (the default) does not run this pass, so a table planned
without ``--stages`` is the one planned before the pass existed.

The memory figures are measured in the planning task, where the template's trace is
(``decode_facts``: ``DecodeFacts`` crosses back as JSON); the choice is arithmetic in the driver,
after the residency and text-encoder passes changed the entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.memory.trace import Category
from xema_ray.plan import (DECODE_GPU_FRACTIONS, DecodeChoice, DecodeStage, ExecutionConfig, Mitigation, PlanEntry,
                           PlanTable)
from xema_ray.profiling.hardware import HardwareProfile
from xema_ray.vocabulary import Phase

if TYPE_CHECKING:
    from planner.latency import LatencyModel
    from planner.trace_model import TracePlannerModel

Stages = Literal["joint", "split", "auto"]
STAGES: tuple[str, ...] = ("joint", "split", "auto")
#: Ray's fixed cost of one object-store hand-over on one node (put + get of a small object), seconds
HANDOVER_FIXED_S = 0.005
#: a tie in goodput (relative) is broken by latency
GOODPUT_TIE = 0.01


class DitStage(BaseModel):
    """One way the DiT workers may run beside a pool (one data-parallel group), and its peak per GPU
    without the decode interval."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: ExecutionConfig
    peak_bytes: int = Field(ge=0)


class DecodeFacts(BaseModel):
    """What the choice needs from a template's trace, measured in its planning task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    template: str = Field(description="the template's shape key")
    config: ExecutionConfig = Field(description="the configuration the figures were taken for (the task's entry)")
    dit_peak_bytes: int = Field(ge=0, description="per GPU, the DiT workers' reserved peak outside the decode and "
                                                   "post events, the entry's VAE mitigations dropped")
    dit_stages: tuple[DitStage, ...] = Field(
        default=(), description="the DiT stages a pool may sit beside, each with its peak: at each Ulysses degree "
                                "the template runs at within the group (a pool's GPUs may leave another SP the better "
                                "one), with the entry's DiT mitigations and without any (the decode was often why "
                                "they were needed)")
    decode_peak_bytes: int = Field(ge=0, description="a decode worker's reserved peak for one request, unmitigated")
    decode_mitigated_peak_bytes: int | None = Field(
        default=None, ge=0, description="the same with the entry's VAE mitigations (None: the entry has none)")
    latent_bytes: int = Field(ge=0, description="one request's latents, handed from the DiT to the pool")


def vae_mitigations(config: ExecutionConfig) -> tuple[Mitigation, ...]:
    """The entry's mitigations that act on the VAE (what a decode worker might need)."""
    return tuple(m for m in config.mitigations if m.modules and all(p.startswith("vae") for p in m.modules))


def _held_outside_decoder(model: TracePlannerModel, batch: int) -> int:
    """Weight bytes of the trace's components a decode worker does not hold."""
    trace = model._profile(batch).trace  # noqa: SLF001 — the planner model's cached trace profile
    keep = set(model.template.spec.decode_components())
    is_w = trace.category == Category.WEIGHT
    comps = np.array([m.split(".", 1)[0] for m in trace.modules] + ["?"])
    owner = comps[np.where(trace.module >= 0, trace.module, len(trace.modules))]
    return int(trace.size[is_w & ~np.isin(owner, list(keep))].sum())


def _decode_peak(model: TracePlannerModel, config: ExecutionConfig) -> int:
    curve, prof = model.reserved_curve(config)
    in_decode = prof.in_group(Phase.DECODE)
    if not in_decode.any():
        raise ValueError(f"{config.template.shape_key}: the trace has no decode phase")
    return max(0, int(curve[in_decode].max()) - _held_outside_decoder(model, config.batch))


def dit_stage_configs(config: ExecutionConfig, gpus: int) -> list[ExecutionConfig]:
    """The DiT stage of ``config`` (its VAE mitigations dropped, one data-parallel group) at its own
    SP and at each other Ulysses degree that fits ``gpus`` with a GPU left for a pool."""
    kept = tuple(m for m in config.mitigations if m not in vae_mitigations(config))
    own = config.model_copy(update={"mitigations": kept, "dp": 1, "decode": None, "layout_ref": None})
    out = [own] + ([own.model_copy(update={"mitigations": ()})] if kept else [])
    sp = 1
    while sp < gpus:
        if sp != config.sp:
            for mitigations in {kept, ()}:
                try:
                    out.append(ExecutionConfig.model_validate({**own.model_dump(), "ulysses": sp, "ring": 1,
                                                               "mitigations": [m.model_dump() for m in mitigations]}))
                except ValueError:
                    pass  # the template has no split at this degree, or a mitigation needs another SP
        sp *= 2
    return out


def _dit_peak(model: TracePlannerModel, config: ExecutionConfig) -> int:
    curve, prof = model.reserved_curve(config)
    outside = ~(prof.in_group(Phase.DECODE) | prof.in_group(Phase.POST))
    return int(curve[outside].max())


def decode_facts(model: TracePlannerModel, config: ExecutionConfig, gpus: int) -> DecodeFacts:
    """The DiT workers' peak without the decode interval (at each SP the group's ``gpus`` allow) and
    a decode worker's peak, from the template's trace under ``config`` (the task's chosen entry)."""
    stages = tuple(DitStage(config=c, peak_bytes=_dit_peak(model, c)) for c in dit_stage_configs(config, gpus))
    one = ExecutionConfig(template=config.template)
    vae = vae_mitigations(config)
    mitigated = _decode_peak(model, one.model_copy(update={"mitigations": vae})) if vae else None
    return DecodeFacts(template=config.template.shape_key, config=config, dit_peak_bytes=stages[0].peak_bytes,
                       dit_stages=stages,
                       decode_peak_bytes=_decode_peak(model, one), decode_mitigated_peak_bytes=mitigated,
                       latent_bytes=int(math.prod(config.template.latent_shape())) * 4)


@dataclass(frozen=True)
class PoolOption:
    """One pool and what the two-stage pipeline does with it."""

    pool: DecodeStage
    dit: ExecutionConfig  #: the DiT stage beside the pool (its SP, the data-parallel groups left)
    latency_s: float
    goodput_rps: float
    decode_s: float
    decode_peak_bytes: int
    dit_peak_bytes: int

    @property
    def dp(self) -> int:
        return self.dit.dp


def handover_s(latent_bytes: int, hw: HardwareProfile) -> float:
    """One request's latents from a DiT worker to a decode worker on the same node: off the device,
    through Ray's object store (shared memory), onto the decode worker's device."""
    return HANDOVER_FIXED_S + 2 * latent_bytes / (hw.h2d_gbps * 1e9)


#: arrivals simulated per side at a load (Poisson), and the seeds they are drawn with
SIM_REQUESTS = 400
SIM_SEEDS = (0, 1)


def _served(entry: PlanEntry, goodput: float, load_rps: float | None, gpus: int, budget: int) -> float:
    """Requests/s that meet the SLO: the capacity without a load, else simulated at it."""
    if load_rps is None:
        return goodput
    from xema_ray.sim.simulate import poisson_arrivals, simulate

    table = PlanTable(hardware="planning", gpus=gpus, budget_bytes=budget,
                      entries={entry.config.template.shape_key: entry})
    duration = SIM_REQUESTS / load_rps
    met = [simulate(table, poisson_arrivals(load_rps * 60, duration, {entry.config.template.shape_key: 1.0},
                                            seed=s)).met for s in SIM_SEEDS]
    return sum(met) / len(met) / duration


def pool_options(entry: PlanEntry, facts: DecodeFacts, latency: LatencyModel, gpus: int, budget: int
                 ) -> list[PoolOption]:
    """Every pool that fits beside the entry's SP groups on the group's ``gpus``, the DiT's peak and
    a decode worker's within their budgets (a fraction of a GPU: that share of its memory)."""
    cfg, pred = entry.config, entry.prediction
    # what the entry's latency holds beside the cost model's batch (the text encoder's placement)
    extra = max(0.0, pred.latency_s - latency.seconds(cfg))
    stages = []
    for s in facts.dit_stages:
        # the entry's own text-encoder placement (the residency and encoder passes ran after the facts)
        dit, peak = s.config.model_copy(update={"text_encoder": cfg.text_encoder}), s.peak_bytes
        if peak > budget or dit.sp > gpus - 1:
            continue
        est = latency.estimate(dit)
        stages.append((dit, peak, max(1e-9, latency.seconds(dit) - est.per_phase.get(Phase.DECODE, 0.0) + extra)))
    vae = vae_mitigations(cfg)
    hand = handover_s(facts.latent_bytes, latency.hardware)
    out = []
    for fraction in (1.0, *DECODE_GPU_FRACTIONS):
        share = budget * fraction
        if facts.decode_peak_bytes <= share:
            mitigations: tuple[Mitigation, ...] = ()
            peak = facts.decode_peak_bytes
        elif facts.decode_mitigated_peak_bytes is not None and facts.decode_mitigated_peak_bytes <= share:
            mitigations, peak = vae, facts.decode_mitigated_peak_bytes
        else:
            continue
        worker = ExecutionConfig(template=cfg.template, mitigations=mitigations)
        one_s = latency.estimate(worker).per_phase.get(Phase.DECODE, 0.0) + hand
        per_request = one_s / fraction  # a fraction of a GPU's compute
        for dit, dit_peak, dit_s in stages:
            for pool_gpus in range(1, gpus - dit.sp + 1):
                dp = (gpus - pool_gpus) // dit.sp
                if dp < 1:
                    break
                workers = int(round(pool_gpus / fraction))
                waves = math.ceil(cfg.batch / workers)
                lat = dit_s + waves * per_request
                rate = min(dp * cfg.batch / dit_s, workers / per_request)
                good = rate if lat <= pred.slo_s else 0.0
                out.append(PoolOption(DecodeStage(workers=workers, gpus_per_worker=fraction, mitigations=mitigations),
                                      dit.model_copy(update={"dp": dp}), lat, good, per_request, peak, dit_peak))
    return out


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """(served goodput, latency) ``a`` beats ``b``: more served beyond the tie, else lower latency."""
    if a[0] > b[0] * (1 + GOODPUT_TIE) + 1e-12:
        return True
    if b[0] > a[0] * (1 + GOODPUT_TIE) + 1e-12:
        return False
    return a[1] < b[1] - 1e-9


def choose_decode(entry: PlanEntry, facts: DecodeFacts | None, latency: LatencyModel, gpus: int, budget: int,
                  stages: Stages, load_rps: float | None = None,
                  pool: tuple[int, float] | None = None) -> tuple[PlanEntry, DecodeChoice | None]:
    """The entry with its decode where ``stages`` puts it, and the choice with its figures (None
    for ``joint``, or a template whose model offers no decode stage). ``pool``: (workers,
    GPUs per worker) of the one pool the group runs (a deployment's ``decode:`` block); None: any."""
    cfg, pred = entry.config, entry.prediction
    if stages == "joint" or not cfg.template.spec.decode_components() or facts is None:
        return entry, None
    in_place = (_served(entry, pred.goodput_rps, load_rps, gpus, budget), pred.latency_s)
    base = dict(asked=stages, load_rps=load_rps, in_place_latency_s=pred.latency_s,
                in_place_goodput_rps=pred.goodput_rps, in_place_peak_bytes=pred.peak_bytes,
                dit_peak_bytes=facts.dit_peak_bytes, decode_peak_bytes=facts.decode_peak_bytes)
    options = [o for o in pool_options(entry, facts, latency, gpus, budget)
               if pool is None or (o.pool.workers, o.pool.gpus_per_worker) == pool]
    if not options:
        why = (f"the DiT workers' peak without the decode, {facts.dit_peak_bytes / 1e9:.2f} GB, is over the budget"
               if min((s.peak_bytes for s in facts.dit_stages), default=facts.dit_peak_bytes) > budget else
               f"no pool fits: {gpus} GPU(s) leave none beside an SP group" if gpus < 2 else
               f"no pool fits beside a DiT SP group on {gpus} GPUs with a decode worker's peak of "
               f"{facts.decode_peak_bytes / 1e9:.2f} GB (unmitigated) within a GPU's budget")
        return entry, DecodeChoice(stage="in_place", reason=why, **base)
    best = options[0]
    for o in options[1:]:
        if _better((o.goodput_rps, o.latency_s), (best.goodput_rps, best.latency_s)):
            best = o
    candidate = _pooled_entry(entry, best)
    pooled = (_served(candidate, best.goodput_rps, load_rps, gpus, budget), best.latency_s)
    base.update(pool=best.pool, pool_dp=best.dp, pool_latency_s=best.latency_s, pool_goodput_rps=best.goodput_rps,
                decode_peak_bytes=best.decode_peak_bytes, dit_peak_bytes=best.dit_peak_bytes)
    wins = _better(pooled, in_place)
    if stages == "auto" and not wins:
        lose = ("the GPUs it takes from the DiT cost more goodput than the decode it frees them of"
                if _better((in_place[0], 0.0), (pooled[0], 0.0)) else "it serves as much but is no faster")
        why = (f"in place serves {in_place[0] * 60:.2f}/min at {in_place[1]:.1f} s; the best pool "
               f"({best.pool.describe()}, DiT SP{best.dit.sp} DP{best.dp}) serves {pooled[0] * 60:.2f}/min at "
               f"{pooled[1]:.1f} s: {lose}")
        return entry, DecodeChoice(stage="in_place", reason=why, **base)
    why = (f"the pool ({best.pool.describe()}, DiT SP{best.dit.sp} DP{best.dp}) serves {pooled[0] * 60:.2f}/min at {pooled[1]:.1f} s "
           f"against {in_place[0] * 60:.2f}/min at {in_place[1]:.1f} s in place" + ("" if wins else " (asked: split)"))
    return candidate, DecodeChoice(stage="pool", reason=why, **base)


def _pooled_entry(entry: PlanEntry, best: PoolOption) -> PlanEntry:
    """``entry`` with its decode on ``best``'s pool: the DiT stage's config and peak, the two
    stages' latency and goodput, a decode worker's peak and seconds."""
    pred = entry.prediction
    config = ExecutionConfig.model_validate({**best.dit.model_dump(), "decode": best.pool.model_dump()})
    prediction = pred.model_copy(update={
        "peak_bytes": best.dit_peak_bytes, "latency_s": best.latency_s, "goodput_rps": best.goodput_rps,
        "latency_by_batch": {}, "decode_peak_bytes": best.decode_peak_bytes, "decode_s": best.decode_s})
    note = f"decode in place: {pred.latency_s:.1f} s, {pred.goodput_rps * 60:.2f}/min"
    return entry.model_copy(update={"config": config, "prediction": prediction, "runner_up": note})


def one_pool(before: dict[str, PlanEntry], after: dict[str, PlanEntry], decodes: dict[str, DecodeChoice],
             gpus: int) -> tuple[dict[str, PlanEntry], dict[str, DecodeChoice]]:
    """A model group holds one decode pool, of the largest size its templates chose; the group's
    other GPUs are its DiT workers, which every template's SP group must still fit. Where one does
    not, the group keeps every decode in place (its choices say why)."""
    pool_gpus = max((e.config.decode.gpus for e in after.values() if e.config.decode is not None), default=0)
    if not pool_gpus:
        return after, decodes
    left = gpus - pool_gpus
    wide = sorted(k for k, e in after.items() if e.config.sp > left)
    if not wide:
        return after, decodes
    why = (f"the group's pool of {pool_gpus} GPU(s) would leave {left} for the DiT workers, fewer than "
           f"{', '.join(f'{k} (SP {after[k].config.sp})' for k in wide)} needs: every decode stays in place")
    back = {k: d.model_copy(update={"stage": "in_place", "reason": why}) if d.stage == "pool" else d
            for k, d in decodes.items()}
    return dict(before), back
