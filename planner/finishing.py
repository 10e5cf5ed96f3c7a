"""Finishing the planned model groups: each group's residency and text-encoder placements once its
templates are planned, their layouts started (``GroupFinisher``), under an expected load
(``finish_under_load``) or a host budget's second pass (``GroupFinisher.fit_host``) all groups together."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from xema_ray.host_budget import NodeHost
from xema_ray.plan import GroupResidency, PlanEntry, PlanTable, TextEncoderChoice
from xema_ray.templates import RequestTemplate

from planner.latency import LatencyModel
from planner.layouts import LayoutWave
from planner.text_encoder import EncoderFacts

if TYPE_CHECKING:
    from planner.driver import PlanOptions, TemplateResult
    from planner.load_aware import GroupLoad


def merged_encoder_facts(results: list[TemplateResult]) -> dict[str, EncoderFacts]:
    """Per model, the text-encoder facts the planning tasks sent back, merged."""
    out: dict[str, EncoderFacts] = {}
    for r in results:
        if r.encoder_facts is not None:
            f = r.encoder_facts
            out[f.model] = out[f.model].merged(f) if f.model in out else f
    return out


def finish_group(results: list[TemplateResult], entries: dict[str, PlanEntry], planner: str, text_encoder: str,
                 latency: LatencyModel, budget: int, allowed: dict[str, tuple[str, ...]] | None = None,
                 ) -> tuple[dict[str, PlanEntry], GroupResidency | None, dict[str, TextEncoderChoice]]:
    """One model group's planned entries made final: the residency policy with more goodput
    (Xema) and each template's text-encoder placement (after it: the residency changes the
    plans; ``allowed``: the placements a template may take, for the host budget). Returns the
    entries to serve with, the residency (None: a baseline or no entry) and the placement chosen
    per entry, for the summary."""
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
                entries[k], costs = place_text_encoder(e, latency.hardware, budget, facts.get(e.config.template.spec.name),
                                                       allowed=(allowed or {}).get(k))
                chosen = next(c for c in costs if c.placement == entries[k].config.text_encoder)
                encoders[k] = TextEncoderChoice(placement=chosen.placement, seconds_per_batch=chosen.seconds)
    return entries, residency, encoders


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
        self._keep(model, *self._finish(model, entries))

    def _finish(self, model: str, entries: dict[str, PlanEntry], allowed: dict[str, tuple[str, ...]] | None = None
                ) -> tuple[dict[str, PlanEntry], GroupResidency | None, dict[str, TextEncoderChoice]]:
        return finish_group(self.results[model], entries, self.opts.planner, self.opts.text_encoder, self.latency,
                            self.opts.budget, allowed)

    def _keep(self, model: str, served: dict[str, PlanEntry], chosen: GroupResidency | None,
              placed: dict[str, TextEncoderChoice]) -> None:
        self.entries.update(served)
        self.encoders.update(placed)
        if chosen is not None:
            self.residency[model] = chosen
        if self.wave is not None:
            self.wave.submit(served)

    def fit_host(self, results: list[TemplateResult]) -> NodeHost:
        """Finish every deferred group with plans whose node fits the host budget
        (``planner.host_choice``); raises ``HostBudgetError`` naming the bytes when none does."""
        from planner.host_choice import fit_host_budget

        assert self.opts.host_budget is not None
        candidates = {r.template: list(r.candidates) for r in results}
        finished, node = fit_host_budget(self.planned, candidates, self._finish, self.opts.group_gpus,
                                         self.opts.gpus, self.opts.host_budget, share=self.opts.hardware != "cpu")
        for model, (served, chosen, placed) in finished.items():
            self._keep(model, served, chosen, placed)
        return node


def finish_under_load(results: list[TemplateResult], templates: list[RequestTemplate], opts: PlanOptions,
                      loads: dict[str, GroupLoad], groups: GroupFinisher) -> PlanTable:
    """Every group finished from the configurations chosen for its expected load (the goodput
    choices compete with the other assembled configurations there). Returns the draft table with
    the groups' admission policies and planned loads; raises ValueError where the load names what
    is not planned."""
    from planner.load_aware import plan_groups_for_load

    planned = {r.template: r.entry for r in results if r.entry is not None}
    draft = PlanTable(hardware="planning", gpus=opts.gpus, budget_bytes=opts.budget, group_gpus=opts.group_gpus,
                      entries=planned)
    alts = {r.template: [r.entry, *r.candidates] for r in results if r.entry is not None}
    loaded = plan_groups_for_load(draft, alts, {r.template: r.slo_s for r in results if r.entry is not None}, loads)
    model_of = {t.shape_key: t.model for t in templates}
    for model in sorted(set(model_of.values())):
        group = [r for r in results if model_of[r.template] == model]
        groups.finish(model, group, {r.template: loaded.entries[r.template] for r in group if r.template in loaded.entries})
    return loaded
