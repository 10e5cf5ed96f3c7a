"""GroupHealth without Ray: stand-in handles whose ``status`` answers, or never does."""

from __future__ import annotations

import asyncio
import time

import pytest

from xema_ray.serving.health import GroupHealth
from xema_ray.serving.model_group import GroupUnavailable


class _Response:
    def __init__(self, value: object = None, never: bool = False) -> None:
        self.value, self.never, self.cancelled = value, never, False

    def __await__(self):  # type: ignore[no-untyped-def]
        if self.never:
            yield from asyncio.sleep(3600).__await__()
        return self.value

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, group: _Group) -> None:
        self.group = group

    def remote(self, *args: object) -> _Response:
        return _Response({"status": "ok"}, never=not self.group.alive)


class _Group:
    def __init__(self) -> None:
        self.alive = True
        self.status = _Method(self)


def test_probe_answers_within_its_timeout_and_names_the_silent_group() -> None:
    up, down = _Group(), _Group()
    down.alive = False
    health = GroupHealth({"a": up, "b": down}, timeout_s=0.2)

    async def run() -> tuple[float, dict]:
        start = time.monotonic()
        got = await health.probe()
        return time.monotonic() - start, got

    seconds, got = asyncio.run(run())
    assert seconds < 0.5
    assert got["a"]["status"] == "ok" and got["b"]["status"] == "unavailable"


def test_a_silent_group_refuses_new_requests_and_gives_up_waiting_ones() -> None:
    group = _Group()
    health = GroupHealth({"m": group}, timeout_s=0.05, interval_s=0.05, unavailable_after_s=0.3, give_up_after_s=0.6)

    async def run() -> tuple[float | None, float | None, _Response]:
        health.ensure_started()
        await asyncio.sleep(0.2)
        before = health.unavailable("m")
        group.alive = False  # its replica dies
        waiting = _Response(never=True)
        with pytest.raises(GroupUnavailable, match="stopped answering"):
            await health.call("m", waiting)
        after = health.unavailable("m")
        group.alive = True
        await asyncio.sleep(0.2)
        assert health.unavailable("m") is None  # answering again: admitted again
        return before, after, waiting

    before, after, waiting = asyncio.run(run())
    assert before is None and after is not None and after > 0.3
    assert waiting.cancelled


def test_a_healthy_groups_response_is_returned() -> None:
    health = GroupHealth({"m": _Group()}, timeout_s=0.05, interval_s=0.05)

    async def run() -> object:
        health.ensure_started()
        return await health.call("m", _Response("done"))

    assert asyncio.run(run()) == "done"


def test_a_group_that_never_answered_is_reported_as_starting() -> None:
    group = _Group()
    group.alive = False  # still loading its model
    health = GroupHealth({"m": group}, timeout_s=0.05, interval_s=0.05, unavailable_after_s=0.1, give_up_after_s=0.2)

    async def run() -> str:
        health.ensure_started()
        await asyncio.sleep(0.3)
        silent = health.unavailable("m")
        assert silent is not None
        return health.why_silent("m", silent)

    assert "still starting" in asyncio.run(run())
