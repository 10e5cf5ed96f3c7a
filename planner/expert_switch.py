"""The expert switch of a two-expert model (Wan2.2-A14B) as a planned event.

The analyzer's trace says how big each expert is, which steps each runs, and how much the steps
and the decode allocate (``xema_ray.memory.analysis.expert_uses``). Under a per-GPU budget this
module prices the ways to hold the experts and keeps the one with the lowest predicted latency
(the highest goodput of one group), the way ``planner.residency_choice`` prices residencies:

- ``hold_both``: both experts stay on the device; nothing moves (only when they fit).
- ``swap_prefetched``: one expert on the device at a time, both on pinned host memory; the
  device memory for one expert's blocks is placed at load and the two experts take it in turn
  (block ``i`` of either in slot ``i``). During the last high-noise steps the side stream copies
  as many of the low-noise expert's blocks as the free memory holds (the prefetch, request
  memory until the decode); at the switch the high-noise expert leaves its slots (its pinned host
  copy stays, so nothing is copied back) and the rest of the low-noise expert is streamed into
  them block by block, ahead of the first low-noise forward. When the decode starts the
  low-noise expert is released and the high-noise blocks return to their slots under it. This is
  what the worker executes (``xema_ray.mitigation.expert_swap``), so ``xema verify`` counts it and
  the static layout holds the request's activations and the prefetch only.
- ``split_blocks``: K blocks of each expert live on the host and stream through the device in
  every forward (block offload); the smallest K that fits, so no switch event at all.

The baseline it is compared with is what a pipeline without a plan does when both experts do not
fit (diffusers' model CPU offload of the two transformers): at the switch the high-noise expert is
copied to the host and the low-noise one to the device, blocking, and the reverse at the next
request's start.

Compute times are the roofline cost model's (``xema_ray.profiling.costmodel``), memory is the
trace's with the runtime allocator's margins (``xema_ray.allocator.margins``); every figure here
is a prediction.

The planner makes the choice a template's entry in its model group's last group pass
(``switch_group``, ``planner.finishing``), so the static layout, the residency and the node's host
memory (both experts pinned: ``xema_ray.runtime.host_bytes.config_host_bytes``) are the switch's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.allocator.margins import DYNAMIC_FRACTION, LAYOUT_OVERHEAD
from xema_ray.memory.analysis import ExpertUse, expert_uses
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.plan import ExecutionConfig, ExpertSwap, Mitigation, PlanEntry, PlanPrediction
from xema_ray.profiling.costmodel import cost_model_estimate
from xema_ray.profiling.hardware import HardwareProfile
from xema_ray.runtime.residency import block_sizes
from xema_ray.templates import RequestTemplate

Strategy = Literal["hold_both", "swap_prefetched", "split_blocks", "offload_whole_expert"]


class StrategyCost(BaseModel):
    """One way to hold the experts, priced."""

    model_config = ConfigDict(frozen=True)

    strategy: Strategy
    fits: bool = Field(description="its per-GPU peak fits the budget")
    peak_bytes: int = Field(ge=0, description="predicted per-GPU peak, the switch included (reserved, with margins)")
    switch_peak_bytes: int = Field(ge=0, description="predicted per-GPU peak while the experts change places")
    latency_s: float = Field(ge=0, description="predicted request latency (compute + stalls)")
    stall_s: float = Field(ge=0, description="seconds the request waits on copies (the switch and the way back)")
    h2d_bytes: int = Field(ge=0, description="weight bytes copied host->device per request")
    prefetch_bytes: int = Field(default=0, ge=0, description="low-noise expert bytes copied before the switch")
    prefetch_steps: int = Field(default=0, ge=0, description="last high-noise steps the prefetch runs under")
    host_blocks_per_expert: int = Field(default=0, ge=0, description="split_blocks: blocks of each expert on the host")
    prefetch_blocks: int = Field(default=0, ge=0, description="swap: low-noise blocks copied before the switch")
    decode_blocks: int = Field(default=0, ge=0, description="swap: high-noise blocks that return under the VAE decode")
    live_peak_bytes: int | None = Field(default=None, ge=0, description="swap: the most bytes live at once before "
                                                                        "the layout's margins (what xema verify counts)")
    note: str = ""


class ExpertSwitchPlan(BaseModel):
    """What a plan does at the expert switch of one template on one GPU group."""

    model_config = ConfigDict(frozen=True)

    template: str
    gpus: int = Field(ge=1, description="the SP group (Ulysses) one request runs on")
    replicas: int = Field(default=1, ge=1, description="data-parallel replicas, each planned alike")
    alternatives: list[str] = Field(default_factory=list, description="every split of the group priced (SP x "
                                                                      "replicas), best goodput first")
    budget_bytes: int = Field(ge=0)
    hardware: str
    experts: list[ExpertUse]
    chosen: Strategy
    strategies: list[StrategyCost] = Field(description="every strategy priced, the baseline last")

    def cost(self, strategy: Strategy) -> StrategyCost:
        return next(s for s in self.strategies if s.strategy == strategy)


def _reserved(weights: float, activations: float) -> int:
    """Device bytes for resident weights and a request's activations under the static layout."""
    return int(weights + activations * LAYOUT_OVERHEAD * (1 + DYNAMIC_FRACTION))


def _stage_activation_peak(trace: MemoryTrace, first_event: int, last_event: int, curve: np.ndarray) -> int:
    """Peak above the resident weights and inputs between two events."""
    floor = int(trace.size[trace.category != Category.ACTIVATION].sum())
    return max(0, int(curve[first_event:last_event + 1].max()) - floor)


def _streamed_stall(prefetched_blocks: int, n_blocks: int, block_s: float, block_compute_s: float) -> float:
    """Seconds the first forward after the switch waits when blocks ``prefetched_blocks..`` arrive one
    by one (``block_s`` each) while the forward runs the blocks already there (``block_compute_s``
    each): the block-offload prefetch at the switch."""
    ready = 0.0  # when the copy of the next block finishes
    t = 0.0  # compute clock with stalls
    for i in range(n_blocks):
        if i >= prefetched_blocks:
            ready += block_s
            t = max(t, ready)
        t += block_compute_s
    return max(0.0, t - n_blocks * block_compute_s)


@dataclass(frozen=True)
class _Stages:
    """What every strategy is priced from: the trace's experts, stages and activations on ``gpus``,
    and the cost model's times of one request."""

    template: RequestTemplate
    experts: list[ExpertUse]
    budget: int
    gpus: int
    weights: int  # every weight of the trace
    act_hi: float  # activations above the weights, per GPU, while each stage runs
    act_lo: float
    act_decode: int  # one rank decodes
    act_text: int
    bw: float  # host->device bytes per second
    n_blocks: int
    base: ExecutionConfig
    total_s: float
    step_s: float
    passes: int
    decode_s: float
    high_steps: int

    @property
    def block_compute_s(self) -> float:
        return self.step_s / self.passes / self.n_blocks

    @property
    def block_bytes(self) -> list[float]:
        return [e.weight_bytes / self.n_blocks for e in self.experts]  # the blocks hold ~all of an expert


def _stages(template: RequestTemplate, trace: MemoryTrace, budget: int, hw: HardwareProfile, gpus: int) -> _Stages:
    experts = expert_uses(trace)
    if len(experts) != 2:
        raise ValueError(f"{template.key}: the trace shows {len(experts)} experts; the switch plan is for two")
    hi, lo = experts
    curve = trace.active_curve()
    base = ExecutionConfig(template=template, ulysses=gpus)
    est = cost_model_estimate(base, hw)
    return _Stages(
        template=template, experts=experts, budget=budget, gpus=gpus,
        weights=int(trace.size[trace.category == Category.WEIGHT].sum()),
        act_hi=_stage_activation_peak(trace, hi.first_event, hi.last_event, curve) / gpus,
        act_lo=_stage_activation_peak(trace, lo.first_event, lo.last_event, curve) / gpus,
        act_decode=_stage_activation_peak(trace, lo.last_event + 1, trace.n_events - 1, curve),
        act_text=_stage_activation_peak(trace, 0, hi.first_event, curve), bw=hw.h2d_gbps * 1e9,
        n_blocks=template.spec.num_dit_blocks, base=base, total_s=est.total_s,
        step_s=est.per_step_s or est.per_phase.get("denoise", 0.0) / template.steps,
        passes=len(template.spec.transformer_passes_per_step()), decode_s=float(est.per_phase.get("decode", 0.0)),
        high_steps=hi.last_step - hi.first_step + 1)


def _hold_both(f: _Stages) -> StrategyCost:
    """Both experts stay on the device: nothing moves."""
    both = max(_reserved(f.weights, max(f.act_hi, f.act_lo)), _reserved(f.weights, f.act_decode))
    return StrategyCost(strategy="hold_both", fits=both <= f.budget, peak_bytes=both, switch_peak_bytes=both,
                        latency_s=f.total_s, stall_s=0.0, h2d_bytes=0)


def _swap_prefetched(f: _Stages) -> StrategyCost:
    """One expert on the device at a time, as ``xema_ray.mitigation.expert_swap`` runs it (both
    experts' DiT blocks homed on pinned host memory; their other layers stay on the device)."""
    expert_blocks = sum(block_sizes(f.template.spec))
    blk, n = expert_blocks / f.n_blocks, f.n_blocks
    kept = f.weights - 2 * expert_blocks  # encoder, VAE, both experts' embeddings and heads
    act = max(f.act_hi, f.act_text, f.act_lo)
    # the prefetch is request memory (the static layout places it among the activations until the
    # decode), so it takes the layout's margins as they do; the slots are weights placed at load
    pre_blocks = next((k for k in range(n, 0, -1) if _reserved(kept + expert_blocks, act + k * blk) <= f.budget), 0)
    pre_bytes = int(pre_blocks * blk)
    pre_steps = min(f.high_steps, max(1, math.ceil(pre_bytes / f.bw / f.step_s))) if pre_bytes else 0
    stall_switch = _streamed_stall(pre_blocks, n, blk / f.bw, f.block_compute_s)
    # the two experts take turns in one region of one expert's blocks, placed at load (block i of
    # either in slot i): the low-noise blocks not prefetched are copied into the slots the
    # high-noise ones leave at the switch, and when the decode starts every high-noise block
    # returns into its slot under it (no request memory: the static layout holds the activations
    # and the prefetch, which stays until the decode)
    dec_blocks = n
    stall_back = max(0.0, n * blk / f.bw - f.decode_s)
    live = (kept + expert_blocks + pre_bytes + max(f.act_hi, f.act_text), kept + expert_blocks + pre_bytes + f.act_lo,
            kept + expert_blocks + f.act_decode)  # the prefetch, the low-noise steps, the decode
    peak = max(_reserved(kept + expert_blocks, act + pre_bytes), _reserved(kept + expert_blocks, f.act_decode))
    return StrategyCost(
        strategy="swap_prefetched", fits=peak <= f.budget, peak_bytes=peak, live_peak_bytes=int(max(live)),
        switch_peak_bytes=_reserved(kept + expert_blocks, f.act_hi + pre_bytes),
        latency_s=f.total_s + stall_switch + stall_back, stall_s=stall_switch + stall_back,
        h2d_bytes=2 * expert_blocks, prefetch_bytes=pre_bytes, prefetch_steps=pre_steps,
        prefetch_blocks=pre_blocks, decode_blocks=dec_blocks,
        note=f"{pre_blocks} of {n} low-noise blocks prefetched during the last {pre_steps} high-noise step(s); "
             f"the other {n - pre_blocks} stream in under the first low-noise forward; "
             f"into the slots the high-noise ones leave; the high-noise blocks return to them under the VAE decode")


def _split_blocks(f: _Stages, hw: HardwareProfile) -> StrategyCost | None:
    """K blocks of each expert on the host, streamed every forward: the smallest K that fits
    (None: none does)."""
    bb = f.block_bytes

    def peak_of(k: int) -> int:  # two blocks in flight while K of each expert stream
        left = f.weights - k * (bb[0] + bb[1])
        return max(_reserved(left + 2 * max(bb), max(f.act_hi, f.act_lo)), _reserved(left, f.act_decode))

    k = next((k for k in range(f.n_blocks + 1) if peak_of(k) <= f.budget), None)
    if k is None:
        return None
    cfg = f.base if k == 0 else f.base.model_copy(update={"mitigations": (
        Mitigation(kind="block_offload", blocks=tuple(range(k)), intensity=k),)})
    split_s = cost_model_estimate(cfg, hw).total_s
    steps = f.template.steps
    return StrategyCost(
        strategy="split_blocks", fits=True, peak_bytes=peak_of(k), switch_peak_bytes=peak_of(k),
        latency_s=split_s, stall_s=max(0.0, split_s - f.total_s),
        h2d_bytes=int(k * (bb[0] * f.high_steps + bb[1] * (steps - f.high_steps)) * f.passes),
        host_blocks_per_expert=k, note=f"{k} blocks of each expert stream through the device in every forward")


def _offload_whole_expert(f: _Stages) -> StrategyCost:
    """The baseline: the whole inactive expert offloaded and the active one loaded, blocking, at
    both switches."""
    hi, lo = f.experts
    expert_blocks = sum(block_sizes(f.template.spec))
    kept = f.weights - 2 * expert_blocks
    whole = (hi.weight_bytes + lo.weight_bytes) * 2 / f.bw
    peak = max(_reserved(kept + expert_blocks, max(f.act_hi, f.act_text)), _reserved(kept + expert_blocks, f.act_lo),
               _reserved(f.weights - hi.weight_bytes - lo.weight_bytes, f.act_decode))
    return StrategyCost(
        strategy="offload_whole_expert", fits=peak <= f.budget, peak_bytes=peak, switch_peak_bytes=peak,
        latency_s=f.total_s + whole, stall_s=whole, h2d_bytes=hi.weight_bytes + lo.weight_bytes,
        note="baseline: at the switch and at the next request's start the departing expert is copied to the host "
             "and the arriving one to the device, blocking (diffusers' model CPU offload of the two transformers)")


def plan_expert_switch(template: RequestTemplate, trace: MemoryTrace, budget: int, hw: HardwareProfile,
                       gpus: int = 1) -> ExpertSwitchPlan:
    """Price every way of holding a two-expert model's experts and choose one.

    The stage split priced is the trace's (``ModelSpec.expert_stages`` at the template's steps, on
    the scheduler the trace was labelled with: the checkpoint's the group serves, else the spec's;
    ``expert_switch_plans``).

    Args:
        template: the template (batch 1), of a model with two expert stages.
        trace: its unmitigated trace (``xema_ray.analyzer.run.trace_template``), all steps.
        budget: per-GPU bytes.
        hw: the hardware (h2d bandwidth, the cost model's roofline).
        gpus: the SP group: DiT activations split across it, each GPU holds the experts it runs.

    Example:
        >>> from xema_ray.analyzer.run import trace_template
        >>> from xema_ray.profiling.hardware import get_hardware
        >>> t = RequestTemplate(model="tiny-wan2.2", height=64, width=64, frames=9, steps=6)
        >>> p = plan_expert_switch(t, trace_template(t), 8 * 2**20, get_hardware("a6000x8"))
        >>> p.chosen
        'hold_both'
    """
    f = _stages(template, trace, budget, hw, gpus)
    split = _split_blocks(f, hw)
    out = [_hold_both(f), _swap_prefetched(f), *([split] if split is not None else []), _offload_whole_expert(f)]
    planned = [s for s in out if s.fits and s.strategy != "offload_whole_expert"]
    if not planned:
        one = _reserved(f.weights - sum(block_sizes(template.spec)), max(f.act_hi, f.act_text))
        raise ValueError(f"{template.key}: no way of holding the experts fits {budget / 1e9:.1f} GB per GPU on {gpus} "
                         f"GPU(s) (one expert alone needs {one / 1e9:.1f} GB)")
    chosen = min(planned, key=lambda s: (s.latency_s, s.h2d_bytes)).strategy
    return ExpertSwitchPlan(template=template.key, gpus=gpus, budget_bytes=budget, hardware=hw.name,
                            experts=f.experts, chosen=chosen, strategies=out)


def describe(plan: ExpertSwitchPlan) -> str:
    """A few lines for ``xema plan``: the choice, what it does at the switch, the baseline."""
    hi, lo = plan.experts
    c, b = plan.cost(plan.chosen), plan.cost("offload_whole_expert")
    where = f"{plan.gpus} GPU(s)" + (f" x {plan.replicas} replicas" if plan.replicas > 1 else "")
    lines = [f"expert switch {plan.template} on {where}, {plan.budget_bytes / 1e9:.0f} GB each: "
             f"{hi.component} ({hi.weight_bytes / 1e9:.1f} GB) steps {hi.first_step}-{hi.last_step}, "
             f"{lo.component} ({lo.weight_bytes / 1e9:.1f} GB) steps {lo.first_step}-{lo.last_step}"]
    for s in plan.strategies:
        mark = "*" if s.strategy == plan.chosen else " "
        lines.append(f"  {mark} {s.strategy:<21} {'fits' if s.fits else 'over':<5} peak {s.peak_bytes / 1e9:6.1f} GB  "
                     f"latency {s.latency_s:9.1f} s  stalls {s.stall_s:6.2f} s  h2d {s.h2d_bytes / 1e9:7.1f} GB"
                     + (f"  ({s.note})" if s.note and s.strategy == plan.chosen else ""))
    if len(plan.alternatives) > 1:
        lines.append("  splits of the group: " + "; ".join(plan.alternatives))
    lines.append(f"  chosen {plan.chosen}: {b.latency_s - c.latency_s:.2f} s faster than offloading the whole inactive "
                 f"expert every request ({b.latency_s / c.latency_s:.4f}x)")
    return "\n".join(lines)


def switch_config(template: RequestTemplate, plan: ExpertSwitchPlan, text_encoder: str | None = "streamed") -> ExecutionConfig:
    """The execution config that runs ``plan``'s choice (``ExecutionConfig.experts``): what the
    table's entry for a two-expert template holds, so the worker executes the priced switch.
    The switch is priced on the analyzer's trace of the denoiser and the VAE, without the text
    encoder's weights, so the encoder must not stay on the device: ``streamed`` (through the
    device during set-up only) or ``cpu``."""
    if text_encoder == "device":
        raise ValueError("the expert switch is priced without the text encoder on the device: streamed or cpu")
    c = plan.cost(plan.chosen)
    if c.strategy == "swap_prefetched":
        swap = ExpertSwap(strategy="swap_prefetched", prefetch_blocks=c.prefetch_blocks,
                          prefetch_steps=c.prefetch_steps if c.prefetch_blocks else 0, decode_blocks=c.decode_blocks)
    elif c.strategy == "split_blocks":
        swap = ExpertSwap(strategy="split_blocks", host_blocks=c.host_blocks_per_expert)
    else:
        swap = ExpertSwap(strategy="hold_both")
    return ExecutionConfig(template=template, ulysses=plan.gpus, dp=plan.replicas, experts=swap,
                           text_encoder=text_encoder)  # type: ignore[arg-type]


def switched_entry(old: PlanEntry, plan: ExpertSwitchPlan) -> PlanEntry:
    """The entry that runs ``plan``'s choice (config and prediction) in place of ``old``, the
    search's entry (on a trace that holds both experts), kept as the runner-up."""
    t, c = old.config.template, plan.cost(plan.chosen)
    slo = old.prediction.slo_s
    runner = (f"{old.config.describe()} on a trace holding both experts: {old.prediction.latency_s:.1f} s per "
              f"batch of {old.config.batch}, {old.prediction.peak_bytes / 1e9:.2f} GB")
    return PlanEntry(
        config=switch_config(t, plan, old.config.text_encoder if old.config.text_encoder != "device" else "streamed"),
        prediction=PlanPrediction(peak_bytes=c.peak_bytes, latency_s=c.latency_s,
                                  goodput_rps=plan.replicas / c.latency_s if c.latency_s <= slo else 0.0,
                                  slo_s=slo, latency_source="estimated"),
        runner_up=runner)


#: switch plans made in this process, by (template, budget, hardware, group GPUs, SLO): a group is
#: finished again while the host budget is fitted, and its switch plans do not change
_PLANS: dict[tuple[str, int, str, int, float, str], ExpertSwitchPlan] = {}
_TRACES: dict[tuple[str, str], MemoryTrace] = {}


def _scheduler_key(scheduler_config: Mapping[str, Any] | None) -> str:
    return json.dumps(scheduler_config, sort_keys=True, default=str) if scheduler_config is not None else ""


def switch_group(entries: dict[str, PlanEntry], budget: int, hw: HardwareProfile, gpus: int,
                 scheduler_config: Mapping[str, Any] | None = None
                 ) -> tuple[dict[str, PlanEntry], list[ExpertSwitchPlan]]:
    """One model group's entries (shape key -> entry, after its text-encoder placement) with each
    two-expert template's switch plan made its entry (``switched_entry``), and those plans; a group
    of one-expert models comes back as it is. What a group's ``expert_switch`` pass runs
    (``planner.finishing``), so the layouts, the residency and the node's host memory are those
    of the entries the worker will run. ``scheduler_config``: the scheduler of the checkpoint the
    group serves (its ``weights_dir``), on which the switch is priced; None: the spec's."""
    from planner.traces import PLANNER_TRACE, meta_pipeline
    from xema_ray.analyzer.run import trace_template

    out, plans = dict(entries), []
    sched = _scheduler_key(scheduler_config)
    for k, e in entries.items():
        t = e.config.template
        if e.config.experts is not None or len(t.spec.expert_stages(t, scheduler_config)) != 2:
            continue
        key = (t.key, budget, hw.name, gpus, e.prediction.slo_s, sched)
        if key not in _PLANS:
            if (t.key, sched) not in _TRACES:
                # as the planning tasks trace (DiT blocks replayed: exact; the process's meta pipeline)
                _TRACES[(t.key, sched)] = trace_template(t, PLANNER_TRACE, pipeline=meta_pipeline(t.model),
                                                         scheduler_config=scheduler_config)
            (_PLANS[key],) = expert_switch_plans([t], budget, hw, {}, gpus, slo_of={t.shape_key: e.prediction.slo_s},
                                                 traces={t.key: _TRACES[(t.key, sched)]},
                                                 scheduler_config=scheduler_config)
        plans.append(_PLANS[key])
        out[k] = switched_entry(e, _PLANS[key])
    return out, plans


class ExpertSwitchFile(BaseModel):
    """``<table>.experts.json``: the expert-switch plans ``xema plan`` made beside its table."""

    plans: list[ExpertSwitchPlan]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1))


def expert_switch_plans(templates: list[RequestTemplate], budget: int, hw: HardwareProfile,
                        gpus_of: dict[str, int], default_gpus: int,
                        slo_of: dict[str, float] | None = None,
                        traces: dict[str, MemoryTrace] | None = None,
                        scheduler_config: Mapping[str, Any] | None = None) -> list[ExpertSwitchPlan]:
    """The switch plan of every template whose model has two expert stages (others: none).

    A group of several GPUs runs each request sequence-parallel over ``sp`` of them, in
    ``gpus / sp`` replicas: every split the model allows (``sp`` divides the group and the
    attention heads) is planned, and the one with the best goodput kept (replicas / latency, 0
    past the template's SLO from ``slo_of``, by shape key); ties go to the lower latency. The
    others are listed in ``alternatives`` with their figures. ``traces``: templates' unmitigated
    traces already made (by ``RequestTemplate.key``, their steps named on ``scheduler_config``),
    else traced here. ``scheduler_config``: the scheduler the workers load (a checkpoint's own,
    ``xema_ray.models.base.checkpoint_scheduler_config``): its shift decides which steps each
    expert runs, so the stage split, the prefetch and the latency priced are the run's; None: the
    spec's."""
    from xema_ray.analyzer.run import trace_template

    out = []
    for t in templates:
        if len(t.spec.expert_stages(t, scheduler_config)) != 2:
            continue
        gpus = gpus_of.get(t.model, default_gpus)
        trace = (traces or {}).get(t.key) or trace_template(t, scheduler_config=scheduler_config)
        slo = (slo_of or {}).get(t.shape_key, math.inf)
        splits = [sp for sp in range(1, gpus + 1) if gpus % sp == 0 and t.spec.attention_heads % sp == 0
                  and (sp == 1 or t.spec.sequence_parallel_for(t))]
        priced: list[tuple[float, float, ExpertSwitchPlan]] = []
        for sp in splits:
            try:
                p = plan_expert_switch(t, trace, budget, hw, gpus=sp).model_copy(update={"replicas": gpus // sp})
            except ValueError:
                continue  # nothing fits at this split
            lat = p.cost(p.chosen).latency_s
            priced.append((p.replicas / lat if lat <= slo else 0.0, -lat, p))
        if not priced:
            raise ValueError(f"{t.key}: no way of holding the experts fits {budget / 1e9:.1f} GB per GPU at any split "
                             f"of {gpus} GPU(s)")
        priced.sort(key=lambda x: (x[0], x[1]), reverse=True)
        best = priced[0][2]
        alternatives = [f"SP{p.gpus} x {p.replicas}: {p.chosen}, latency {-neg:.1f} s, goodput {g * 3600:.3f} requests/h"
                        for g, neg, p in priced]
        out.append(best.model_copy(update={"alternatives": alternatives}))
    return out
