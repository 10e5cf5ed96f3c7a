"""The ``residency`` group pass (``planner.finishing.GROUP_PASSES``): one residency per model group,
or one per template (after every template of the group is planned).

Templates of one model share a group's workers, and a worker holds weights where its current
template's plan keeps them (``xema_ray.runtime.residency``). Two policies:

- ``per_template``: each batch runs its own plan; a worker whose previous batch was another
  template first moves the blocks whose home differs (``switch_s``, both directions at the
  host link's bandwidth). Under a uniform mix a batch of template i follows a batch of j with
  probability w_j, so its expected latency grows by sum_j w_j switch_s[j][i].
- ``shared``: every plan's offloaded blocks stay on the host for all templates (no switch);
  each template's plan must then stream the extra blocks, re-costed with the same latency model.

The policy with the higher group goodput (requests/s within the SLO, summed over templates) is
kept; the table records both figures and the switch costs (the simulator charges them).
"""

from __future__ import annotations

from collections.abc import Callable

from xema_ray.plan import ExecutionConfig, GroupResidency, PlanEntry
from xema_ray.runtime.residency import Residency, block_sizes, residency_host_bytes, switch_seconds, with_residency


def _goodput(config: ExecutionConfig, latency_s: float, slo_s: float) -> float:
    return config.dp * config.batch / latency_s if latency_s <= slo_s else 0.0


def choose_group_residency(
    entries: dict[str, PlanEntry], latency: Callable[[ExecutionConfig], float], h2d_gbps: float,
) -> tuple[GroupResidency, dict[str, PlanEntry]]:
    """The better residency policy for one model's entries, and the entries to serve with it.

    Args:
        entries: shape key -> planned entry, all of one model.
        latency: the planner's latency model (``LatencyModel.seconds``).
        h2d_gbps: host<->device bandwidth of the hardware (GB/s).
    """
    if not entries:
        raise ValueError("a model group needs at least one planned template")
    spec = next(iter(entries.values())).config.template.spec
    sizes = block_sizes(spec)
    res = {k: Residency.of_config(e.config) for k, e in entries.items()}
    union = Residency.union(res.values())
    host_per_worker = residency_host_bytes(spec, union)
    switch = {a: {b: switch_seconds(sizes, res[a], res[b], h2d_gbps) for b in entries if b != a} for a in entries}
    weight = 1.0 / len(entries)
    per_template = 0.0
    for k, e in entries.items():
        expected = sum(weight * switch[j][k] for j in entries if j != k)
        per_template += _goodput(e.config, e.prediction.latency_s + expected, e.prediction.slo_s)
    shared_entries = {}
    shared = 0.0
    for k, e in entries.items():
        cfg = with_residency(e.config, union)
        if cfg is e.config:
            shared_entries[k] = e
        else:
            lat = latency(cfg)
            pred = e.prediction.model_copy(update={
                "latency_s": lat, "goodput_rps": _goodput(cfg, lat, e.prediction.slo_s),
                "latency_by_batch": {n: latency(cfg.for_batch(n)) for n in e.prediction.latency_by_batch}})
            shared_entries[k] = e.model_copy(update={"config": cfg, "prediction": pred})
        shared += shared_entries[k].prediction.goodput_rps
    goodputs = {"per_template": per_template, "shared": shared}
    if not union.host_blocks or all(r == union for r in res.values()):
        return GroupResidency(policy="per_template", goodput_rps=goodputs, host_bytes_per_worker=host_per_worker), entries
    if shared > per_template:
        return GroupResidency(policy="shared", host_blocks=union.host_blocks, goodput_rps=goodputs,
                              host_bytes_per_worker=host_per_worker), shared_entries
    per_worker = max(sum(sizes[i] for i in r.host_blocks) for r in res.values())
    return GroupResidency(policy="per_template", switch_s=switch, goodput_rps=goodputs,
                          host_bytes_per_worker=per_worker), entries
