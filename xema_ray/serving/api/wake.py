"""Requests to a group scaled to zero: held while it wakes, refused past its wake timeout.

A group with ``autoscaling: {min_replicas: 0}`` gives its replicas back when idle (the
autoscaler's ``decide_replicas``). The next request wakes it: Ray Serve scales a deployment at
zero replicas up as soon as a request waits at its handle (the handle tells the controller at
once). The Router does not refuse such a request: ``WakeGate.hold`` sends it and holds it until
the group answers that it serves (``GroupHealth.wait_serving``: a replica runs and its workers have
loaded, warm from the node's host copy), then it is served as any other. A request held longer
than the group's ``wake_timeout_s`` is withdrawn and answered 503 ``waking`` with Retry-After
(the group keeps waking: a retry finds it up). While waking, each template holds at most the
group's ``max_queue`` requests; past that a request gets the 503 ``queue_full`` the group's own
admission gives (``limit: models[].max_queue``).

Counted: ``/v1/stats``'s ``waking`` (per group: held, woke, timed out, refused full, seconds held)
and the ``xema_wake_wait_s`` histogram (``model``: every held request's wait, however it ended; a
503 ``waking`` is also ``xema_requests_refused{reason="waking"}``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.serving.messages import QueueFull, RetryLater
from xema_ray.serving.stats import WakeStats, wake_stats  # noqa: F401 (the Router reads them from here)

if TYPE_CHECKING:
    from ray.util.metrics import Histogram

    from xema_ray.serving.api.health import GroupHealth
    from xema_ray.serving.group.handle import Reply

#: Retry-After of a 503 ``waking`` at the least: the group is still starting its replica
WAKING_RETRY_AFTER_S = 5.0
#: the wait histogram's bucket bounds (seconds)
_WAIT_BOUNDS = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0]


class WakePolicy(BaseModel):
    """How the Router holds requests for one group that scales to zero."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(gt=0, description="longest hold before a 503 `waking` (autoscaling.wake_timeout_s)")
    max_queue: int = Field(ge=1, description="requests held per template while waking (the group's max_queue)")


class GroupWaking(RetryLater):
    """A request held past its group's wake timeout (HTTP 503 ``waking`` with Retry-After)."""


class WakeGate:
    """Holds the requests of the groups that scale to zero while they wake (module docstring).

    Args:
        policies: model -> its ``WakePolicy`` (only the groups with ``min_replicas: 0``).
        health: the Router's ``GroupHealth`` (whether a group serves; waits for it to).
        count: adds ``n`` to a named counter of the Stats deployment (None: this replica's only).
    """

    def __init__(self, policies: dict[str, WakePolicy], health: GroupHealth,
                 count: Callable[[str, int], None] | None = None) -> None:
        self.policies = policies
        self.health = health
        self._count = count
        self._held: dict[tuple[str, str], int] = {}
        #: this replica's own counters (``wake|<model>|<what>``), also sent to ``count``
        self.local: dict[str, int] = {}
        self._histogram: Histogram | None = None

    def waking(self, model: str) -> bool:
        """Whether a request for ``model`` is held: its group scales to zero and does not serve now
        (asleep, or starting since a request woke it)."""
        return model in self.policies and not self.health.serves(model)

    def enter(self, model: str, template: str, retry_after_s: float) -> None:
        """Count a request held for ``template``, or raise ``QueueFull`` when ``max_queue`` are."""
        key = (model, template)
        limit = self.policies[model].max_queue
        if self._held.get(key, 0) >= limit:
            self._add(model, "queue_full")
            raise QueueFull(f"{template}: queue full ({limit} requests held while {model} wakes from zero "
                            "replicas); retry later", retry_after_s=retry_after_s)
        self._held[key] = self._held.get(key, 0) + 1
        self._add(model, "held")

    async def hold(self, model: str, template: str, call: asyncio.Future[Any], reply: Reply[Any]) -> None:
        """Wait until ``model``'s group serves (or ``call`` ends, or a death fact stands); past the
        wake timeout withdraw ``reply`` and raise ``GroupWaking``. ``enter`` counted it held."""
        policy = self.policies[model]
        start = time.monotonic()
        serving = asyncio.ensure_future(self.health.wait_serving(model))
        gone = asyncio.ensure_future(self.health.wait_gone(model))
        try:
            done, _ = await asyncio.wait({call, serving, gone}, timeout=policy.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            waited = time.monotonic() - start
            self._add(model, "wait_ms", round(waited * 1000))
            if done:
                if done != {gone}:  # served, or answered: not a death fact (the Router answers that one)
                    self._add(model, "woke")
                self._observe(model, waited)
                return
            reply.cancel()
            call.cancel()
            self._add(model, "timed_out")
            self._observe(model, waited)
            raise GroupWaking(f"{model}: its group is waking from zero replicas and did not serve within "
                              f"wake_timeout_s ({policy.timeout_s:g} s); retry later",
                              retry_after_s=max(WAKING_RETRY_AFTER_S, policy.timeout_s / 4))
        finally:
            serving.cancel()
            gone.cancel()
            key = (model, template)
            self._held[key] -= 1

    def _add(self, model: str, what: str, n: int = 1) -> None:
        name = f"wake|{model}|{what}"
        self.local[name] = self.local.get(name, 0) + n
        if self._count is not None:
            self._count(name, n)

    def _observe(self, model: str, seconds: float) -> None:
        """``xema_wake_wait_s{model}`` (made on first use, inside a Serve replica only)."""
        if self._histogram is None:
            try:
                from ray.serve import get_replica_context, metrics

                get_replica_context()
            except Exception:  # not inside a Serve replica (tests driving the Router directly)
                return
            self._histogram = metrics.Histogram("xema_wake_wait_s", "seconds a request was held while its group "
                                                "woke from zero replicas", boundaries=_WAIT_BOUNDS,
                                                tag_keys=("model",))
        self._histogram.observe(seconds, tags={"model": model})
