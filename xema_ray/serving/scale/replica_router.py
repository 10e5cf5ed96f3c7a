"""Serve request router for a replicated model group: each request goes to the replica whose
dispatcher predicts the earliest completion within the SLO (``scaling.choose_replica``).

Each ModelGroup replica publishes its ``ReplicaSummary`` through Serve's routing stats
(``record_routing_stats``, polled by the controller every ``request_routing_stats_period_s``
and pushed to every handle): choosing costs no call to a replica. What the summary cannot show
yet — the requests this handle sent since it was taken — the router counts itself and adds.

Configured per deployment (``deployments/app.py``)::

    request_router_config=RequestRouterConfig(request_router_class=SloRequestRouter,
                                              request_routing_stats_period_s=0.5)
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from xema_ray.serving.scale.replica_summary import ReplicaSummary
from xema_ray.serving.scale.scaling import choose_replica

#: the routing-stats key a replica publishes its summary under
SUMMARY_KEY = "xema_summary"
#: a request sent this long before a summary was taken is assumed to be in it
IN_FLIGHT_SLACK_S = 0.05


def request_template(pending: PendingRequest | None) -> str | None:
    """The template of a ModelGroup call: ``generate(request)`` or ``submit_job(request)``, each
    with one ``GroupRequest`` (``xema_ray.serving.messages``)."""
    if pending is None or pending.metadata.call_method not in ("generate", "submit_job"):
        return None
    request = pending.args[0] if pending.args else pending.kwargs.get("req")
    return getattr(request, "template", None)


def published_summary(replica: RunningReplica) -> ReplicaSummary | None:
    """The summary a replica last published (None before its first)."""
    raw = (replica.routing_stats or {}).get(SUMMARY_KEY)
    if raw is None:
        return None
    if isinstance(raw, ReplicaSummary):
        return raw
    try:
        return ReplicaSummary.model_validate(raw)
    except ValueError:
        return None


class SloRequestRouter(RequestRouter):
    """Ranks the replicas for each request by predicted completion (see the module docstring);
    calls other than ``generate`` / ``submit_job`` (status, stats, cancel) go anywhere, rotated."""

    def initialize_state(self, max_summary_age_s: float = 10.0, **kwargs: Any) -> None:
        self.max_summary_age_s = max_summary_age_s
        self._sent: dict[ReplicaID, collections.deque[tuple[float, str]]] = collections.defaultdict(collections.deque)
        self._rotate = itertools.count()
        self._parsed: dict[ReplicaID, tuple[int, ReplicaSummary | None]] = {}
        #: (template, chosen replica, predicted completion or None) of the latest choices, for tests and logs
        self.last_choices: collections.deque[tuple[str, str, float | None]] = collections.deque(maxlen=256)

    def _summary(self, r: RunningReplica) -> ReplicaSummary | None:
        stats = r.routing_stats or {}
        raw = stats.get(SUMMARY_KEY)
        key = id(raw)
        cached = self._parsed.get(r.replica_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        s = published_summary(r)
        self._parsed[r.replica_id] = (key, s)
        return s

    def _sent_since(self, rid: ReplicaID, s: ReplicaSummary | None) -> dict[str, int]:
        q = self._sent[rid]
        if s is not None:
            while q and q[0][0] < s.t - IN_FLIGHT_SLACK_S:
                q.popleft()
        counts: dict[str, int] = {}
        for _, t in q:
            counts[t] = counts.get(t, 0) + 1
        return counts

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        n = next(self._rotate)
        rotated = candidate_replicas[n % len(candidate_replicas):] + candidate_replicas[:n % len(candidate_replicas)]
        template = request_template(pending_request)
        if template is None:
            return [rotated]
        by_id = {r.replica_id.unique_id: r for r in rotated}
        summaries = {r.replica_id.unique_id: self._summary(r) for r in rotated}
        sent = {r.replica_id.unique_id: self._sent_since(r.replica_id, summaries[r.replica_id.unique_id])
                for r in rotated}
        choice = choose_replica(summaries, template, time.time(), sent, self.max_summary_age_s)
        best = choice.order[0]
        self.last_choices.append((template, best, choice.completion_s.get(best)))
        return [[by_id[rid]] for rid in choice.order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        template = request_template(pending_request)
        if template is not None:
            self._sent[replica_id].append((time.time(), template))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)
        self._parsed.pop(replica_id, None)
