"""The group passes (``GROUP_PASSES``: residency, text encoder, expert switch, decode stage) and who runs them: each model
group's plans made final once its templates are planned, its layouts started (``GroupFinisher``);
under an expected load (``finish_every_group``) or a host budget's second pass
(``GroupFinisher.fit_host``) all groups together."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field, replace

from xema_ray.deployment import DecodePoolConfig
from xema_ray.host_budget import NodeHost
from planner.expert_switch import ExpertSwitchPlan
from xema_ray.plan import DecodeChoice, GroupResidency, PlanEntry, TextEncoderChoice
from xema_ray.templates import RequestTemplate

from planner.latency import LatencyModel
from planner.layouts import LayoutWave
from planner.task_io import PlanOptions, TemplateResult
from planner.text_encoder import EncoderFacts


def merged_encoder_facts(results: list[TemplateResult]) -> dict[str, EncoderFacts]:
    """Per model, the text-encoder facts the planning tasks sent back, merged."""
    out: dict[str, EncoderFacts] = {}
    for r in results:
        if r.encoder_facts is not None:
            f = r.encoder_facts
            out[f.model] = out[f.model].merged(f) if f.model in out else f
    return out


@dataclass(frozen=True)
class GroupInputs:
    """What the group passes read beside the group's state: its templates' task results, the run's
    options, the latency model, the placements a template's encoder may take (``allowed``: the
    host budget's; None: any)."""

    results: tuple[TemplateResult, ...]
    planner: str
    text_encoder: str
    latency: LatencyModel
    budget: int
    allowed: dict[str, tuple[str, ...]] | None = None
    #: the GPUs of the group's DiT workers (each split into SP x replicas by the expert switch)
    gpus: int = 1
    #: where decodes run (``planner.decode_stage``: joint, split, auto)
    stages: str = "joint"
    #: shape key -> its expected requests/s (the decode choice caps goodput there)
    loads: dict[str, float] = field(default_factory=dict)
    #: the scheduler config of the checkpoint the group serves (None: the spec's), on which the
    #: expert switch is priced
    scheduler_config: dict[str, Any] | None = None
    #: the deployment's decode pool, on top of ``gpus`` (None: a pool, if any, is carved out of ``gpus``)
    pool: DecodePoolConfig | None = None

    @property
    def decode_gpus(self) -> int:
        """The GPUs the decode-stage pass plans on: the DiT workers' and a deployment's pool's."""
        return self.gpus + (self.pool.whole_gpus if self.pool is not None else 0)


@dataclass(frozen=True)
class GroupState:
    """What one group pass hands the next: the group's entries, its residency (None: not chosen:
    a baseline or no entry), the text-encoder placement chosen per entry (for the summary), the
    switch plans of its two-expert templates (``planner.expert_switch``)."""

    entries: dict[str, PlanEntry]
    residency: GroupResidency | None = None
    encoders: dict[str, TextEncoderChoice] = field(default_factory=dict)
    switches: tuple[ExpertSwitchPlan, ...] = ()
    decodes: dict[str, DecodeChoice] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupPass:
    """One named pass over a model group's plans (``GROUP_PASSES``)."""

    name: str
    run: Callable[[GroupInputs, GroupState], GroupState]


def residency_pass(group: GroupInputs, state: GroupState) -> GroupState:
    """The residency policy with more group goodput (Xema only; ``planner.residency_choice``)."""
    from planner.residency_choice import choose_group_residency

    if group.planner != "xema" or not state.entries:
        return state
    residency, entries = choose_group_residency(state.entries, group.latency.seconds, group.latency.hardware.h2d_gbps)
    return replace(state, entries=entries, residency=residency)


def text_encoder_pass(group: GroupInputs, state: GroupState) -> GroupState:
    """Each template's text-encoder placement (``planner.text_encoder``); after the residency,
    which changes the plans."""
    from planner.text_encoder import place_text_encoder

    entries, encoders = dict(state.entries), dict(state.encoders)
    if group.text_encoder == "plan":
        facts = merged_encoder_facts(list(group.results))
        for k, e in list(entries.items()):
            if e.config.template.spec.text_encoder is not None:
                entries[k], costs = place_text_encoder(e, group.latency.hardware, group.budget,
                                                       facts.get(e.config.template.spec.name),
                                                       allowed=(group.allowed or {}).get(k))
                chosen = next(c for c in costs if c.placement == entries[k].config.text_encoder)
                encoders[k] = TextEncoderChoice(placement=chosen.placement, seconds_per_batch=chosen.seconds)
    return replace(state, entries=entries, encoders=encoders)


def expert_switch_pass(group: GroupInputs, state: GroupState) -> GroupState:
    """Two-expert models (Wan2.2-A14B): each template's plan at the expert switch made its entry
    (``planner.expert_switch.switch_group``; after the text encoder, whose placement it keeps off
    the device), and the group's residency chosen again on those entries. Its layouts, its
    residency and the node's host memory (``planner.host_choice``) are then the switch's."""
    from planner.expert_switch import switch_group

    entries, plans = switch_group(state.entries, group.budget, group.latency.hardware, group.gpus,
                                  scheduler_config=group.scheduler_config)
    if not plans:
        return state
    return residency_pass(group, replace(state, entries=entries, switches=tuple(plans)))


def decode_stage_pass(group: GroupInputs, state: GroupState) -> GroupState:
    """Each video template's decode in place or on a pool of its own (``planner.decode_stage``;
    ``--stages split|auto``; last: the entries' latencies and peaks are final). Xema only."""
    from planner.decode_stage import choose_decode

    if group.stages == "joint" or group.planner != "xema":
        return state
    from planner.decode_stage import one_pool

    facts = {r.template: r.decode_facts for r in group.results if r.decode_facts is not None}
    entries, decodes = dict(state.entries), dict(state.decodes)
    for k, e in state.entries.items():
        entries[k], choice = choose_decode(e, facts.get(k), group.latency, group.decode_gpus, group.budget,
                                           group.stages, group.loads.get(k),  # type: ignore[arg-type]
                                           pool=None if group.pool is None else (group.pool.workers,
                                                                                 group.pool.gpus_per_worker))
        if choice is not None:
            decodes[k] = choice
    entries, decodes = one_pool(state.entries, entries, decodes, group.decode_gpus)
    return replace(state, entries=entries, decodes=decodes)


#: the passes over one model group's plans, in order; a new per-group choice is one more pass here
GROUP_PASSES: tuple[GroupPass, ...] = (
    GroupPass("residency", residency_pass),
    GroupPass("text_encoder", text_encoder_pass),
    GroupPass("expert_switch", expert_switch_pass),
    GroupPass("decode_stage", decode_stage_pass),
)


def finish_group(results: list[TemplateResult], entries: dict[str, PlanEntry], planner: str, text_encoder: str,
                 latency: LatencyModel, budget: int, allowed: dict[str, tuple[str, ...]] | None = None,
                 gpus: int = 1, stages: str = "joint", loads: dict[str, float] | None = None,
                 scheduler_config: dict[str, Any] | None = None, pool: DecodePoolConfig | None = None) -> GroupState:
    """One model group's planned entries made final by ``GROUP_PASSES``: the entries to serve
    with, the residency (None: a baseline or no entry), the placement chosen per entry (for the
    summary) and the expert-switch plans. ``gpus``: the group's DiT workers' GPUs; ``scheduler_config``:
    its checkpoint's scheduler (None: the spec's); ``pool``: its deployment's decode pool, on top of
    ``gpus`` (None: the decode-stage pass carves a pool out of ``gpus``)."""
    group = GroupInputs(tuple(results), planner, text_encoder, latency, budget, allowed, gpus, stages, dict(loads or {}),
                        scheduler_config, pool)
    state = GroupState(entries)
    for p in GROUP_PASSES:
        state = p.run(group, state)
    return state


class GroupFinisher:
    """The model groups finished so far (``finish``, called once per group): their final entries,
    residencies and text-encoder placements; each group's layouts start in ``wave`` at once. With
    a host budget (``defer``) groups are finished together, once every template is planned
    (``fit_host``: the node's host memory is shared by all of them)."""

    def __init__(self, opts: PlanOptions, latency: LatencyModel, wave: LayoutWave | None,
                 block_sizes: threading.Thread, defer: bool = False) -> None:
        self.opts, self.latency, self.wave, self.block_sizes = opts, latency, wave, block_sizes
        self.defer = defer
        self.entries: dict[str, PlanEntry] = {}
        self.residency: dict[str, GroupResidency] = {}
        self.encoders: dict[str, TextEncoderChoice] = {}
        self.switches: dict[str, tuple[ExpertSwitchPlan, ...]] = {}  # model -> its templates' switch plans
        self.decodes: dict[str, DecodeChoice] = {}  # shape key -> where its decode runs (--stages split|auto)
        self.planned: dict[str, PlanEntry] = {}  # the tasks' (or the load's) choices, before finishing
        self.results: dict[str, list[TemplateResult]] = {}

    def finish(self, model: str, group: list[TemplateResult], entries: dict[str, PlanEntry] | None = None) -> None:
        """A model group is planned (``entries``: its plans, default the tasks' choices): its
        residency and text encoders, then its layouts start (deferred: kept for ``fit_host``)."""
        if self.block_sizes.is_alive():
            self.block_sizes.join()
        if entries is None:
            entries = {r.template: r.entry for r in group if r.entry is not None}
        self.planned.update(entries)
        self.results[model] = group
        if self.defer:
            return
        self._keep(model, self._finish(model, entries))

    def _finish(self, model: str, entries: dict[str, PlanEntry], allowed: dict[str, tuple[str, ...]] | None = None
                ) -> GroupState:
        return finish_group(self.results[model], entries, self.opts.planner, self.opts.text_encoder, self.latency,
                            self.opts.budget, allowed, gpus=self.opts.dit_gpus(model),
                            stages=self.opts.stages, loads=self.opts.template_loads,
                            scheduler_config=self.opts.scheduler_configs.get(model),
                            pool=self.opts.decode_pools.get(model))

    def _keep(self, model: str, finished: GroupState) -> None:
        self.entries.update(finished.entries)
        self.encoders.update(finished.encoders)
        self.decodes.update(finished.decodes)
        if finished.residency is not None:
            self.residency[model] = finished.residency
        if finished.switches:
            self.switches[model] = finished.switches
        if self.wave is not None:
            self.wave.submit(finished.entries)

    def fit_host(self, results: list[TemplateResult]) -> NodeHost:
        """Finish every deferred group with plans whose node fits the host budget
        (``planner.host_choice``); raises ``HostBudgetError`` naming the bytes when none does."""
        from planner.host_choice import fit_host_budget

        assert self.opts.host_budget is not None
        candidates = {r.template: list(r.candidates) for r in results}
        finished, node = fit_host_budget(self.planned, candidates, self._finish, self.opts.dit_workers(),
                                         self.opts.gpus, self.opts.host_budget, share=self.opts.hardware != "cpu")
        for model, state in finished.items():
            self._keep(model, state)
        return node


def finish_every_group(results: list[TemplateResult], templates: list[RequestTemplate], groups: GroupFinisher,
                       chosen: dict[str, PlanEntry] | None = None) -> None:
    """Every model group finished at once, in the models' order, from ``chosen`` (the plans chosen
    for them: under an expected load) or, by default, the tasks' choices."""
    model_of = {t.shape_key: t.model for t in templates}
    for model in sorted(set(model_of.values())):
        group = [r for r in results if model_of[r.template] == model]
        groups.finish(model, group, None if chosen is None else
                      {r.template: chosen[r.template] for r in group if r.template in chosen})
