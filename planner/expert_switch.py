"""The expert switch of a two-expert model (Wan2.2-A14B) as a planned event.

The analyzer's trace says how big each expert is, which steps each runs, and how much the steps
and the decode allocate (``xema_ray.memory.analysis.expert_uses``). Under a per-GPU budget this
module prices the ways to hold the experts and keeps the one with the lowest predicted latency
(the highest goodput of one group), the way ``planner.residency_choice`` prices residencies:

- ``hold_both``: both experts stay on the device; nothing moves (only when they fit).
- ``swap_prefetched``: one expert on the device at a time, the other on pinned host memory. During
  the last high-noise steps the side stream copies as many of the low-noise expert's blocks as the
  free memory holds (the prefetch); at the switch the high-noise expert is released (its pinned
  host copy stays, so nothing is copied back) and the rest of the low-noise expert is streamed in
  block by block, ahead of the first low-noise forward. The high-noise expert returns the same way
  during the last low-noise steps and the VAE decode, ready for the next request.
- ``split_blocks``: K blocks of each expert live on the host and stream through the device in
  every forward (block offload); the smallest K that fits, so no switch event at all.

The baseline it is compared with is what a pipeline without a plan does when both experts do not
fit (diffusers' model CPU offload of the two transformers): at the switch the high-noise expert is
copied to the host and the low-noise one to the device, blocking, and the reverse at the next
request's start.

Compute times are the roofline cost model's (``xema_ray.profiling.costmodel``), memory is the
trace's with the runtime allocator's margins (``xema_ray.allocator.margins``); every figure here
is a prediction.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.allocator.margins import DYNAMIC_FRACTION, LAYOUT_OVERHEAD
from xema_ray.memory.analysis import ExpertUse, expert_uses
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.profiling.costmodel import cost_model_estimate
from xema_ray.profiling.hardware import HardwareProfile
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
    note: str = ""


class ExpertSwitchPlan(BaseModel):
    """What a plan does at the expert switch of one template on one GPU group."""

    model_config = ConfigDict(frozen=True)

    template: str
    gpus: int = Field(ge=1, description="the SP group (Ulysses) one request runs on")
    replicas: int = Field(default=1, ge=1, description="data-parallel replicas, each planned alike")
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


def plan_expert_switch(template: RequestTemplate, trace: MemoryTrace, budget: int, hw: HardwareProfile,
                       gpus: int = 1) -> ExpertSwitchPlan:
    """Price every way of holding a two-expert model's experts and choose one.

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
    experts = expert_uses(trace)
    if len(experts) != 2:
        raise ValueError(f"{template.key}: the trace shows {len(experts)} experts; the switch plan is for two")
    hi, lo = experts
    spec = template.spec
    curve = trace.active_curve()
    weights = int(trace.size[trace.category == Category.WEIGHT].sum())
    others = weights - hi.weight_bytes - lo.weight_bytes
    act_hi = _stage_activation_peak(trace, hi.first_event, hi.last_event, curve) / gpus
    act_lo = _stage_activation_peak(trace, lo.first_event, lo.last_event, curve) / gpus
    act_decode = _stage_activation_peak(trace, lo.last_event + 1, trace.n_events - 1, curve)  # one rank decodes
    bw = hw.h2d_gbps * 1e9
    n_blocks = spec.num_dit_blocks
    block_bytes = [e.weight_bytes / n_blocks for e in experts]  # the blocks hold ~all of an expert

    base = ExecutionConfig(template=template, ulysses=gpus)
    est = cost_model_estimate(base, hw)
    step_s = est.per_step_s or est.per_phase.get("denoise", 0.0) / template.steps
    passes = len(spec.transformer_passes_per_step())
    block_compute_s = step_s / passes / n_blocks
    decode_s = float(est.per_phase.get("decode", 0.0))
    high_steps = hi.last_step - hi.first_step + 1
    out: list[StrategyCost] = []

    # hold both: nothing moves
    both = max(_reserved(weights, max(act_hi, act_lo)), _reserved(weights, act_decode))
    out.append(StrategyCost(strategy="hold_both", fits=both <= budget, peak_bytes=both, switch_peak_bytes=both,
                            latency_s=est.total_s, stall_s=0.0, h2d_bytes=0))

    # swap with prefetch: one expert resident, the other's blocks prefetched into the free memory
    stage_hi = _reserved(others + hi.weight_bytes, act_hi)
    stage_lo = _reserved(others + lo.weight_bytes, act_lo)
    free_hi = max(0, budget - stage_hi)
    pre_blocks = min(n_blocks, int(free_hi // block_bytes[1]))
    pre_bytes = int(pre_blocks * block_bytes[1])
    pre_steps = min(high_steps, max(1, math.ceil(pre_bytes / bw / step_s))) if pre_bytes else 0
    stall_switch = _streamed_stall(pre_blocks, n_blocks, block_bytes[1] / bw, block_compute_s)
    free_lo = max(0, budget - stage_lo)
    back_blocks = min(n_blocks, int(free_lo // block_bytes[0]))
    rest_back = hi.weight_bytes - back_blocks * block_bytes[0]
    stall_back = max(0.0, rest_back / bw - decode_s)  # the rest returns under the VAE decode
    decode_room = _reserved(others + back_blocks * block_bytes[0], act_decode)
    swap_peak = max(_reserved(others + hi.weight_bytes + pre_bytes, act_hi), stage_lo,
                    _reserved(others + lo.weight_bytes + back_blocks * block_bytes[0], act_lo), decode_room)
    out.append(StrategyCost(
        strategy="swap_prefetched", fits=swap_peak <= budget and stage_hi <= budget, peak_bytes=swap_peak,
        switch_peak_bytes=_reserved(others + hi.weight_bytes + pre_bytes, act_hi),
        latency_s=est.total_s + stall_switch + stall_back, stall_s=stall_switch + stall_back,
        h2d_bytes=hi.weight_bytes + lo.weight_bytes, prefetch_bytes=pre_bytes, prefetch_steps=pre_steps,
        note=f"{pre_blocks} of {n_blocks} low-noise blocks prefetched during the last {pre_steps} high-noise step(s); "
             f"the other {n_blocks - pre_blocks} stream in under the first low-noise forward; "
             f"{back_blocks} high-noise blocks return during the last low-noise steps, the rest under the decode"))

    # split: K blocks of each expert on the host, streamed every forward
    def split_peak_of(k: int) -> int:  # two blocks in flight while K of each expert stream
        left = weights - k * (block_bytes[0] + block_bytes[1])
        return max(_reserved(left + 2 * max(block_bytes), max(act_hi, act_lo)), _reserved(left, act_decode))

    k = next((k for k in range(n_blocks + 1) if split_peak_of(k) <= budget), n_blocks + 1)
    if k <= n_blocks:
        cfg = base if k == 0 else base.model_copy(update={"mitigations": (
            Mitigation(kind="block_offload", blocks=tuple(range(k)), intensity=k),)})
        split_est = cost_model_estimate(cfg, hw)
        split_peak = split_peak_of(k)
        out.append(StrategyCost(
            strategy="split_blocks", fits=split_peak <= budget, peak_bytes=split_peak, switch_peak_bytes=split_peak,
            latency_s=split_est.total_s, stall_s=max(0.0, split_est.total_s - est.total_s),
            h2d_bytes=int(k * (block_bytes[0] * high_steps + block_bytes[1] * (template.steps - high_steps)) * passes),
            host_blocks_per_expert=k, note=f"{k} blocks of each expert stream through the device in every forward"))

    # baseline: the whole inactive expert offloaded and the active one loaded, blocking, at both switches
    whole = (hi.weight_bytes + lo.weight_bytes) * 2 / bw
    base_peak = max(stage_hi, stage_lo, _reserved(others, act_decode))
    out.append(StrategyCost(
        strategy="offload_whole_expert", fits=base_peak <= budget, peak_bytes=base_peak, switch_peak_bytes=base_peak,
        latency_s=est.total_s + whole, stall_s=whole, h2d_bytes=hi.weight_bytes + lo.weight_bytes,
        note="baseline: at the switch and at the next request's start the departing expert is copied to the host "
             "and the arriving one to the device, blocking (diffusers' model CPU offload of the two transformers)"))

    planned = [s for s in out if s.fits and s.strategy != "offload_whole_expert"]
    if not planned:
        raise ValueError(f"{template.key}: no way of holding the experts fits {budget / 1e9:.1f} GB per GPU on {gpus} GPU(s) "
                         f"(one expert alone needs {stage_hi / 1e9:.1f} GB)")
    chosen = min(planned, key=lambda s: (s.latency_s, s.h2d_bytes)).strategy
    return ExpertSwitchPlan(template=template.key, gpus=gpus, budget_bytes=budget, hardware=hw.name, experts=experts,
                            chosen=chosen, strategies=out)


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
    lines.append(f"  chosen {plan.chosen}: {b.latency_s - c.latency_s:.2f} s faster than offloading the whole inactive "
                 f"expert every request ({b.latency_s / c.latency_s:.4f}x)")
    return "\n".join(lines)


class ExpertSwitchFile(BaseModel):
    """``<table>.experts.json``: the expert-switch plans ``xema plan`` made beside its table."""

    plans: list[ExpertSwitchPlan]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1))


def expert_switch_plans(templates: list[RequestTemplate], budget: int, hw: HardwareProfile,
                        gpus_of: dict[str, int], default_gpus: int) -> list[ExpertSwitchPlan]:
    """The switch plan of every template whose model has two expert stages (others: none)."""
    from xema_ray.analyzer.run import trace_template

    out = []
    for t in templates:
        if len(t.spec.expert_stages(t)) != 2:
            continue
        gpus = gpus_of.get(t.model, default_gpus)
        sp = gpus if t.spec.sequence_parallel_for(t) else 1  # without an SP split, more GPUs are replicas
        p = plan_expert_switch(t, trace_template(t), budget, hw, gpus=sp)
        out.append(p.model_copy(update={"replicas": gpus // sp}))
    return out
