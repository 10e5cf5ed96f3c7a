"""The ``host_memory`` pass (``planner.pipeline.PASSES``): the node's host memory as a budget
(``--host-budget``, per node).

Once every group is finished (residency, text-encoder placement), the node's host memory is added
up the way the workers will hold it (``xema_ray.runtime.host_bytes.config_host_bytes``: the loader's
own exact buffers for every pass that pins, the expert switch included; one shared segment per
group where workers share them, on GPUs): one replica of each
group on one node, every worker loading at once. Within the budget the table is kept as it is.
Over it, the planner gives up the least goodput per byte saved, one change at a time:

- a template's text encoder on the device instead of streamed or on the CPU, where the device
  budget still holds it (its weights leave the host; where it does not, the placement stays);
- a template's next-best configuration (the template pass's other candidates), which offloads fewer DiT blocks.

If no combination fits, planning stops with ``HostBudgetError`` naming the bytes the smallest plan
found needs, per group, against the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from xema_ray.host_budget import NodeHost, fmt_bytes
from xema_ray.plan import GroupResidency, PlanEntry, PlanTable
from xema_ray.runtime.host_bytes import config_host_bytes, group_host


class HostBudgetError(ValueError):
    """No plan found keeps the node's host memory within ``--host-budget``."""


def node_host(entries: dict[str, PlanEntry], residency: dict[str, GroupResidency], group_gpus: dict[str, int],
              gpus: int, budget_bytes: int | None, share: bool = True) -> NodeHost:
    """One replica of each model's group on one node: each worker holds the largest of its
    templates' plans (every offloaded block under a shared residency)."""
    by_model: dict[str, list[PlanEntry]] = {}
    for e in entries.values():
        by_model.setdefault(e.config.template.model, []).append(e)
    groups = []
    for model, es in sorted(by_model.items()):
        shared = model in residency and residency[model].policy == "shared"
        groups.append(group_host(model, [e.config for e in es], group_gpus.get(model, gpus), shared, share))
    return NodeHost.of(groups, budget_bytes)


def with_host(entries: dict[str, PlanEntry], share: bool = True) -> dict[str, PlanEntry]:
    """The entries with their workers' host figures recorded in their predictions."""
    out = {}
    for k, e in entries.items():
        h = config_host_bytes(e.config, share)
        out[k] = e.model_copy(update={"prediction": e.prediction.model_copy(update={"host": h})})
    return out


def with_node_host(table: PlanTable, share: bool, budget_bytes: int | None) -> PlanTable:
    """The table with each entry's worker host memory and the node's (``xema_ray.host_budget``)."""
    entries = with_host(table.entries, share)
    dit = {m: table.dit_workers(m) for m in {e.config.template.model for e in entries.values()}}
    node = node_host(entries, table.residency, dit, table.gpus, budget_bytes, share)
    return table.model_copy(update={"entries": entries, "host": node})


class Finished(Protocol):
    """A model group's planned entries finished (``planner.finishing.GroupState``: by its
    ``GROUP_PASSES``, residency, text encoders, expert switch)."""

    @property
    def entries(self) -> dict[str, PlanEntry]: ...

    @property
    def residency(self) -> GroupResidency | None: ...


F = TypeVar("F", bound=Finished)


def fit_host_budget(planned: dict[str, PlanEntry], candidates: dict[str, list[PlanEntry]],
                    refinish: Callable[[str, dict[str, PlanEntry], dict[str, tuple[str, ...]]], F],
                    group_gpus: dict[str, int], gpus: int, budget_bytes: int, share: bool = True,
                    max_changes: int = 64) -> tuple[dict[str, F], NodeHost]:
    """The finished entries and residencies of the plans whose node fits ``budget_bytes``, from
    the tasks' choices (``planned``) and their other candidates, giving up the least goodput per
    byte saved (per model: what ``refinish`` made of the kept plans, each template's encoder
    limited to the placements given for it); raises ``HostBudgetError``
    when no change brings the node within."""
    raw = dict(planned)
    allowed: dict[str, tuple[str, ...]] = {}
    models = sorted({e.config.template.model for e in raw.values()})
    finished: dict[str, F] = {}

    def finish(model: str, raw_: dict[str, PlanEntry], allowed_: dict[str, tuple[str, ...]]) -> F:
        group = {k: e for k, e in raw_.items() if e.config.template.model == model}
        return refinish(model, group, {k: v for k, v in allowed_.items() if k in group})

    def node_of(fin: dict[str, F]) -> NodeHost:
        entries = {k: e for f in fin.values() for k, e in f.entries.items()}
        res = {m: f.residency for m, f in fin.items() if f.residency is not None}
        return node_host(entries, res, group_gpus, gpus, budget_bytes, share)

    for m in models:
        finished[m] = finish(m, raw, allowed)
    node = node_of(finished)
    used: set[tuple[str, str]] = set()
    for _ in range(max_changes):
        if node.fits:
            break
        best = None
        for k, e in raw.items():
            model = e.config.template.model
            moves: list[tuple[str, dict[str, PlanEntry], dict[str, tuple[str, ...]]]] = []
            if finished[model].entries[k].config.text_encoder in ("streamed", "cpu"):
                moves.append(("encoder", raw, {**allowed, k: ("device",)}))
            for i, c in enumerate(candidates.get(k, [])):
                if c.config != e.config:
                    moves.append((f"candidate{i}", {**raw, k: c}, allowed))
            for name, raw_, allowed_ in moves:
                if (k, name) in used:
                    continue
                trial = {**finished, model: finish(model, raw_, allowed_)}
                n = node_of(trial)
                saved = node.load_peak_bytes - n.load_peak_bytes
                if saved <= 0:
                    continue
                lost = (sum(x.prediction.goodput_rps for x in finished[model].entries.values())
                        - sum(x.prediction.goodput_rps for x in trial[model].entries.values()))
                score = max(lost, 0.0) / saved
                if best is None or score < best[0]:
                    best = (score, (k, name), raw_, allowed_, trial, n)
        if best is None:
            break
        _, tag, raw, allowed, finished, node = best
        used.add(tag)
    if not node.fits:
        raise HostBudgetError(refusal(node, budget_bytes))
    return finished, node


def refusal(node: NodeHost, budget_bytes: int) -> str:
    """Why no plan fits, with the bytes: the smallest node found, per group, against the budget."""
    return (f"no plan keeps the node's host memory within --host-budget {fmt_bytes(budget_bytes)}: the smallest "
            f"found needs {fmt_bytes(node.load_peak_bytes)} while loading ({fmt_bytes(node.resident_bytes)} resident, "
            f"{fmt_bytes(node.pinned_bytes)} pinned; {node.describe()})")
