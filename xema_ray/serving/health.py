"""The Router's view of its model groups: each group's status, asked all at once with a short
timeout, and kept fresh in the background so that a group with no live replica (being replaced,
or its node is gone) is answered at once with a 503 instead of a request waiting in Serve's
queue for a replica that may not come back.

A group that does not answer within ``timeout_s`` is ``unavailable``; one that has not answered
for ``unavailable_after_s`` refuses new requests (HTTP 503 with Retry-After), and a request
already waiting on it is given up (cancelled, HTTP 503) once the group has been silent for
``give_up_after_s`` — every request gets an answer, none waits for a node that may never return.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from xema_ray.serving.model_group import GroupUnavailable

#: how often the background probe asks every group, and how long it waits for each
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 0.5
#: silence after which a group refuses new requests (a few missed probes, not one slow answer)
UNAVAILABLE_AFTER_S = 3.0
#: silence after which a request waiting on the group is answered 503 (Serve replaces a dead
#: replica in ~10-15 s on 2 CPUs; a node that is gone may never come back)
GIVE_UP_AFTER_S = 10.0


class GroupHealth:
    """Status of every model group, probed concurrently (``/healthz`` and request admission).

    Args:
        groups: model name -> Serve deployment handle of its ModelGroup (with a ``status`` method).
        timeout_s: longest wait for one group's answer.
        interval_s: period of the background probe.
        unavailable_after_s: silence after which ``unavailable`` reports the group.
        give_up_after_s: silence after which ``call`` gives up a request waiting on the group.
    """

    def __init__(self, groups: dict[str, Any], timeout_s: float = PROBE_TIMEOUT_S,
                 interval_s: float = PROBE_INTERVAL_S, unavailable_after_s: float = UNAVAILABLE_AFTER_S,
                 give_up_after_s: float = GIVE_UP_AFTER_S) -> None:
        self.groups = groups
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.unavailable_after_s = unavailable_after_s
        self.give_up_after_s = give_up_after_s
        self._last_answer: dict[str, float] = {}  # silence counts from when probing started
        self._answered: set[str] = set()  # groups that answered at least once (the others are starting)
        self._task: asyncio.Task | None = None

    async def _ask(self, model: str) -> dict[str, Any]:
        async def call() -> dict[str, Any]:
            return await self.groups[model].status.remote()

        try:
            status = await asyncio.wait_for(call(), timeout=self.timeout_s)
        except TimeoutError:
            return {"model": model, "status": "unavailable", "reason": f"no answer within {self.timeout_s} s"}
        except Exception as e:
            return {"model": model, "status": "unavailable", "reason": type(e).__name__}
        self._last_answer[model] = time.monotonic()
        self._answered.add(model)
        return status

    async def probe(self) -> dict[str, dict[str, Any]]:
        """Every group's status now (answers within ``timeout_s`` whatever the groups do)."""
        models = sorted(self.groups)
        answers = await asyncio.gather(*(self._ask(m) for m in models))
        return dict(zip(models, answers, strict=True))

    def ensure_started(self) -> None:
        """Start the background probe (needs the running event loop, hence not in ``__init__``)."""
        if self._task is None or self._task.done():
            now = time.monotonic()
            for m in self.groups:
                self._last_answer.setdefault(m, now)
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(self.interval_s)

    def silent_for(self, model: str) -> float:
        """Seconds since the group last answered a probe (0 before probing started)."""
        if model not in self._last_answer:
            return 0.0
        return time.monotonic() - self._last_answer[model]

    def unavailable(self, model: str) -> float | None:
        """Seconds the group has been silent, if longer than ``unavailable_after_s``; else None."""
        silent = self.silent_for(model)
        return silent if silent > self.unavailable_after_s else None

    def why_silent(self, model: str, silent: float) -> str:
        """Why ``model``'s group does not answer, as a 503 says it: still starting (it never
        answered: loading its model), or gone quiet (being replaced, or its node is gone)."""
        if model not in self._answered:
            return (f"{model}: its model group is still starting (no answer in the {silent:.0f} s since this router "
                    "started: it is loading its model); retry later")
        return (f"{model}: its model group stopped answering {silent:.0f} s ago (being replaced, or its node is "
                "gone); retry later")

    async def call(self, model: str, response: Any) -> Any:
        """Await a Serve response from ``model``'s group; if the group falls silent for
        ``give_up_after_s`` meanwhile, cancel it and raise ``GroupUnavailable`` (HTTP 503)."""

        async def result() -> Any:
            return await response

        task = asyncio.ensure_future(result())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.interval_s)
                if done:
                    return task.result()
                silent = self.silent_for(model)
                if silent > self.give_up_after_s:
                    response.cancel()
                    raise GroupUnavailable(self.why_silent(model, silent).replace(
                        "; retry later", "; the request was not completed, retry later"))
        finally:
            if not task.done():
                task.cancel()
