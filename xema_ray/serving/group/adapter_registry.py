"""The run-time adapter changes of the app, that every replica of a replicated model group follows.

``POST`` / ``DELETE /v1/adapters`` reach *one* replica of a model group (Serve routes each call to
one); a group with several replicas (``replicas:`` or ``autoscaling:``) would otherwise serve a
hot-added adapter on that replica only, and a replica started later would not have it at all. So
such groups share an ``AdapterRegistry`` (one small Serve deployment, ``deployments/app.py``):

- the replica that takes an add reserves the name here (a name added, reserved or in the YAML
  folder is a 409 on every replica), loads it on its own workers, and only then commits it (a
  refused file changes nothing anywhere); a delete is recorded first; either then waits until
  every live replica says it has the change;
- every replica, on each routing-stats tick (``ModelGroup.record_routing_stats``, every 0.5 s)
  and before it checks a request naming adapters, makes its adapters what the registry says
  (``GroupAdapters.sync``, through a ``RegistryClient``) and acknowledges the version it reached.

State is ``RegistryState`` per model: adapters added at run time, and the YAML folder's adapters
deleted at run time. It lives in this deployment's memory. A replica counts as live while it
acknowledged within ``LIVE_S``; one that stops (scaled down, died) drops out of the wait after
that. Should Serve replace the registry's own replica, the new one starts empty under a new
``epoch``: the first group replica that sees it hands back the state it applied (``restore``),
so nothing served is forgotten.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from xema_ray.lora_pool import AdapterSource

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

#: a replica that acknowledged within this many seconds is waited for
LIVE_S = 5.0
#: a reservation whose replica never committed nor released it (it died loading) lapses after this
RESERVATION_S = 600.0


def _now() -> float:
    """The registry's clock (a test sets its own)."""
    return time.monotonic()


class RegistryState(BaseModel):
    """What a model's replicas must serve besides the YAML folder, at ``version`` of ``epoch``."""

    epoch: int = 0
    version: int = 0
    added: dict[str, AdapterSource] = Field(default_factory=dict, description="name -> source, added at run time")
    removed: list[str] = Field(default_factory=list, description="folder adapters deleted at run time")


class AdapterRegistry:
    """The record (a Serve deployment with one replica; in-process in tests). Calls are cheap and
    never wait on a worker: the replicas do the loading."""

    def __init__(self) -> None:
        self.epoch = time.time_ns()  # a replaced registry is told apart by it
        self._version = 0
        self._states: dict[str, RegistryState] = {}
        self._reserved: dict[tuple[str, str], float] = {}  # (model, name) -> when
        #: (model, replica) -> (version acknowledged, when)
        self._acks: dict[tuple[str, str], tuple[int, float]] = {}
        self._changed = asyncio.Condition()

    def _state(self, model: str) -> RegistryState:
        return self._states.get(model, RegistryState(epoch=self.epoch))

    def _bump(self, model: str, **update: object) -> int:
        self._version += 1
        self._states[model] = self._state(model).model_copy(update={"version": self._version, **update})
        return self._version

    async def state(self, model: str) -> RegistryState:
        return self._state(model)

    async def reserve(self, model: str, name: str, in_folder: bool) -> bool:
        """Hold ``name`` for an add in progress; False when it is taken: added, reserved by another
        add, or one of the YAML folder's adapters not deleted (``in_folder``)."""
        now = _now()
        self._reserved = {k: at for k, at in self._reserved.items() if now - at < RESERVATION_S}
        s = self._state(model)
        if name in s.added or (model, name) in self._reserved or (in_folder and name not in s.removed):
            return False
        self._reserved[(model, name)] = now
        return True

    async def release(self, model: str, name: str) -> None:
        """The add of ``name`` failed: nothing changes."""
        self._reserved.pop((model, name), None)

    async def commit(self, source: AdapterSource) -> int:
        """The reserved add of ``source`` loaded on its replica: every replica's now; its version."""
        self._reserved.pop((source.model, source.name), None)
        s = self._state(source.model)
        return self._bump(source.model, added={**s.added, source.name: source},
                          removed=[n for n in s.removed if n != source.name])

    async def remove(self, model: str, name: str, from_folder: bool) -> int:
        """Record ``name`` as gone (``from_folder``: one of the YAML folder's); its version."""
        s = self._state(model)
        removed = sorted({*s.removed, name}) if from_folder else s.removed
        return self._bump(model, added={k: v for k, v in s.added.items() if k != name}, removed=removed)

    async def restore(self, model: str, applied: RegistryState) -> RegistryState:
        """A replica's state from before this registry started (it was replaced): taken as the
        model's when nothing changed here since; the model's state either way."""
        if model not in self._states:
            self._bump(model, added=dict(applied.added), removed=list(applied.removed))
        return self._state(model)

    async def ack(self, model: str, replica: str, version: int) -> None:
        """``replica`` serves ``model``'s adapters as of ``version``."""
        now = _now()
        self._acks[(model, replica)] = (version, now)
        self._acks = {k: v for k, v in self._acks.items() if now - v[1] <= 10 * LIVE_S}  # gone replicas
        async with self._changed:
            self._changed.notify_all()

    async def poll(self, model: str, replica: str, version: int, epoch: int) -> RegistryState | None:
        """A replica's tick: acknowledge ``version`` (it is live) and get the state when it is newer
        or of another ``epoch`` (this registry was replaced since the replica last synced)."""
        if epoch == self.epoch:
            await self.ack(model, replica, version)
        s = self._state(model)
        return s if epoch != self.epoch or s.version > version else None

    def behind(self, model: str, version: int) -> list[str]:
        """Live replicas of ``model`` that have not acknowledged ``version``."""
        now = _now()
        return sorted(r for (m, r), (v, at) in self._acks.items() if m == model and now - at <= LIVE_S and v < version)

    async def wait_synced(self, model: str, version: int, timeout_s: float) -> list[str]:
        """Wait until every live replica of ``model`` acknowledged ``version``; the ones still
        behind after ``timeout_s`` (empty: all have it)."""
        deadline = _now() + timeout_s
        async with self._changed:
            while (late := self.behind(model, version)) and (left := deadline - _now()) > 0:
                try:  # woken by every ack; a replica that stops acknowledging drops out after LIVE_S
                    await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
                except TimeoutError:
                    pass
        return late


class RegistryClient:
    """The registry as a group replica calls it: the deployment's handle (Serve's, or an
    in-process stand-in answering ``handle.method.remote(...)`` alike) behind typed calls, one
    per ``AdapterRegistry`` method a replica uses."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    async def state(self, model: str) -> RegistryState:
        out: RegistryState = await self.handle.state.remote(model)
        return out

    async def reserve(self, model: str, name: str, in_folder: bool) -> bool:
        return bool(await self.handle.reserve.remote(model, name, in_folder))

    async def release(self, model: str, name: str) -> None:
        await self.handle.release.remote(model, name)

    async def commit(self, source: AdapterSource) -> int:
        return int(await self.handle.commit.remote(source))

    async def remove(self, model: str, name: str, from_folder: bool) -> int:
        return int(await self.handle.remove.remote(model, name, from_folder))

    async def restore(self, model: str, applied: RegistryState) -> RegistryState:
        out: RegistryState = await self.handle.restore.remote(model, applied)
        return out

    async def ack(self, model: str, replica: str, version: int) -> None:
        await self.handle.ack.remote(model, replica, version)

    async def poll(self, model: str, replica: str, version: int, epoch: int) -> RegistryState | None:
        out: RegistryState | None = await self.handle.poll.remote(model, replica, version, epoch)
        return out

    async def wait_synced(self, model: str, version: int, timeout_s: float) -> list[str]:
        return list(await self.handle.wait_synced.remote(model, version, timeout_s))
