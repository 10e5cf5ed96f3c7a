"""The node-level holder of the host copies of a node's models (``HostCopyKeeper``).

A group with a host copy (``ModelGroupConfig.host_copy``: every weight of its model in one
``/dev/shm`` segment per node, ``xema_ray.models.loading.materialize``) must keep it after its last
worker on the node is gone: a group scaled to zero wakes by mapping it, not by reading the
checkpoint. A segment outlives its last worker only while its owner, a live process other than
the workers, keeps it (``xema_ray.platforms.host_memory``, ``SegmentHolder``); the ``/dev/shm``
sweep removes a segment only once its owner is gone.

That owner is one small Ray actor per app and node (no CPU, named, detached: it outlives the
replicas that asked for it, which come and go with the autoscaler). A replica asks for its node's
keeper before its workers load; the keeper lives as long as the Ray cluster, or until it is killed
(``ray.kill`` of the actor named ``xema-host-keeper-<app>-<node>``); its segments are then swept
at the next worker's open.
"""

from __future__ import annotations

import re

from xema_ray.platforms.host_memory import SegmentHolder

#: the Ray namespace of the keepers (one per app and node; found by name)
NAMESPACE = "xema"


class HostCopyKeeper:
    """The keeper's body: it only has to live (its process owns the node's kept segments)."""

    def holder(self) -> dict[str, object]:
        return SegmentHolder.this_process().model_dump()


def keeper_name(app: str, node_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", app)
    return f"xema-host-keeper-{safe}-{node_id[:16]}"


def node_holder(app: str) -> SegmentHolder:
    """This node's keeper for ``app`` (started if it is not running): the ``SegmentHolder`` a
    replica's workers give the segments they create. Called inside a Ray worker process."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    actor = ray.remote(num_cpus=0)(HostCopyKeeper).options(
        name=keeper_name(app, node), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    return SegmentHolder.model_validate(ray.get(actor.holder.remote(), timeout=120))
