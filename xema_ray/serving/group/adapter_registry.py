"""The run-time adapter changes of the app, that every replica of a replicated model group follows.

``POST`` / ``DELETE /v1/adapters`` reach *one* replica of a model group (Serve routes each call to
one); a group with several replicas (``replicas:`` or ``autoscaling:``) would otherwise serve a
hot-added adapter on that replica only, and a replica started later would not have it at all. So
such groups share an ``AdapterRegistry`` (one small Serve deployment, ``deployments/app.py``):

- the replica that takes a change records it here first (a name taken on any replica is a 409),
  applies it on its own workers, and then waits until every live replica says it has it;
- every replica, on each routing-stats tick (``PublishesSummary``, every 0.5 s) and whenever a
  request names an adapter it does not have, makes its adapters what the registry says
  (``GroupAdapters.sync_adapters``) and acknowledges the version it reached;
- a replica started later does the same before its first request is checked.

State is ``RegistryState``: adapters added at run time (by name, per model), and the YAML folder's
adapters deleted at run time. It lives in this deployment's memory: a restarted app starts from the
YAML again, as a single-replica group does. A replica counts as live while it acknowledged within
``LIVE_S``; one that stops (scaled down, died) drops out of the wait after that.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel, Field

from xema_ray.lora import AdapterSource

#: a replica that acknowledged within this many seconds is waited for
LIVE_S = 5.0


class RegistryState(BaseModel):
    """What a model's replicas must serve besides the YAML folder, at ``version``."""

    version: int = 0
    added: dict[str, AdapterSource] = Field(default_factory=dict, description="name -> source, added at run time")
    removed: list[str] = Field(default_factory=list, description="folder adapters deleted at run time")


class AdapterRegistry:
    """The record (a Serve deployment with one replica; in-process in tests). Calls are cheap and
    never wait on a worker: the replicas do the loading."""

    def __init__(self) -> None:
        self._states: dict[str, RegistryState] = {}
        self._version = 0
        #: (model, replica) -> (version acknowledged, when)
        self._acks: dict[tuple[str, str], tuple[int, float]] = {}
        self._changed = asyncio.Condition()

    def _bump(self, model: str, **update: object) -> int:
        self._version += 1
        old = self._states.get(model, RegistryState())
        self._states[model] = old.model_copy(update={"version": self._version, **update})
        return self._version

    async def state(self, model: str) -> RegistryState:
        return self._states.get(model, RegistryState())

    async def add(self, source: AdapterSource) -> int | None:
        """Record ``source`` as added; its version, or None when the name is taken (another
        replica added it first: the group's 409)."""
        s = self._states.get(source.model, RegistryState())
        if source.name in s.added:
            return None
        return self._bump(source.model, added={**s.added, source.name: source},
                          removed=[n for n in s.removed if n != source.name])

    async def remove(self, model: str, name: str, from_folder: bool) -> int:
        """Record ``name`` as gone (``from_folder``: one of the YAML folder's); its version."""
        s = self._states.get(model, RegistryState())
        removed = sorted({*s.removed, name}) if from_folder else s.removed
        return self._bump(model, added={k: v for k, v in s.added.items() if k != name}, removed=removed)

    async def ack(self, model: str, replica: str, version: int) -> None:
        """``replica`` serves ``model``'s adapters as of ``version``."""
        self._acks[(model, replica)] = (version, time.monotonic())
        async with self._changed:
            self._changed.notify_all()

    async def poll(self, model: str, replica: str, version: int) -> RegistryState | None:
        """A replica's tick: acknowledge ``version`` (it is live) and get the state when it is newer."""
        await self.ack(model, replica, version)
        s = self._states.get(model)
        return s if s is not None and s.version > version else None

    def behind(self, model: str, version: int) -> list[str]:
        """Live replicas of ``model`` that have not acknowledged ``version``."""
        now = time.monotonic()
        return sorted(r for (m, r), (v, at) in self._acks.items() if m == model and now - at <= LIVE_S and v < version)

    async def wait_synced(self, model: str, version: int, timeout_s: float) -> list[str]:
        """Wait until every live replica of ``model`` acknowledged ``version``; the ones still
        behind after ``timeout_s`` (empty: all have it)."""
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while (late := self.behind(model, version)) and (left := deadline - time.monotonic()) > 0:
                try:  # woken by every ack; a replica that stops acknowledging drops out after LIVE_S
                    await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
                except TimeoutError:
                    pass
        return late
