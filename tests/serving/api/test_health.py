"""GroupHealth without a Ray cluster: stand-in handles whose ``status`` answers late, raises
Ray's death error, or never answers, and a stand-in for Serve's controller. Only facts make a
group unavailable; a slow answer never does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from xema_ray.serving.api.health import GroupHealth
from xema_ray.serving.group.handle import GroupHandle
from xema_ray.serving.messages import GroupUnavailable


class _Group:
    """A stand-in Serve handle: ``status.remote()`` answers after ``delay_s``, raises ``error``, or
    never answers (``hang``)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s, self.error, self.hang = delay_s, None, False
        self.own: dict[str, Any] = {"status": "ok", "reason": None, "queued": 3}
        self.status = self
        self.calls = 0

    def remote(self) -> Any:
        self.calls += 1
        return self._answer()

    async def _answer(self) -> dict[str, Any]:
        if self.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return dict(self.own)


def _health(groups: dict[str, _Group], **kwargs: Any) -> GroupHealth:
    """GroupHealth over the stand-ins, each behind the typed handle the Router gives it."""
    return GroupHealth({m: GroupHandle(g) for m, g in groups.items()}, **kwargs)  # type: ignore[arg-type]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_group_that_answers_slowly_is_not_declared_dead() -> None:
    slow = _Group(delay_s=0.6)  # 12 times the pending check: a group busy under load
    counts = {"m": 1}

    async def replicas() -> dict[str, int]:
        return counts

    health = _health({"m": slow}, replica_counts=replicas, interval_s=0.01, pending_check_s=0.05)

    async def run() -> list[str]:
        health.ensure_started()
        seen = []
        for _ in range(30):  # 1.5 s: two slow answers and the waits between them
            await asyncio.sleep(0.05)
            r = health.report("m")
            seen.append(r.status)
            if r.status == "ok":
                health.admit("m")  # never refused while it is merely slow
        return seen

    seen = _run(run())
    assert seen[-1] == "ok" and "degraded" not in seen, seen
    assert seen.index("ok") > 0  # before its first answer it is starting (not ready), never degraded


def test_a_dead_replica_refuses_new_requests_until_a_new_one_answers() -> None:
    group = _Group()
    health = _health({"m": group}, interval_s=0.02, pending_check_s=0.05)

    async def run() -> None:
        health.ensure_started()
        await asyncio.sleep(0.1)
        assert health.report("m").status == "ok"
        group.error = ActorDiedError()  # Ray: the replica's actor died
        await asyncio.sleep(0.1)
        r = health.report("m")
        assert (r.status, r.accepting) == ("degraded", False)
        assert "ActorDiedError" in (r.reason or "")
        with pytest.raises(GroupUnavailable, match="replica died"):
            health.admit("m")
        group.error = None  # Serve's replacement answers
        await asyncio.sleep(0.1)
        assert health.report("m").status == "ok"
        health.admit("m")

    _run(run())


def test_no_running_replica_reported_by_serve_is_a_fact() -> None:
    group = _Group()
    counts = {"m": 1}

    async def replicas() -> dict[str, int]:
        return counts

    health = _health({"m": group}, replica_counts=replicas, interval_s=0.02, pending_check_s=0.05)

    async def run() -> None:
        health.ensure_started()
        await asyncio.sleep(0.1)
        group.hang = True  # the handle holds the probe: the replica is gone and not replaced yet
        await asyncio.sleep(0.3)
        assert health.report("m").status == "ok"  # pending, and Serve still counts a running replica
        counts["m"] = 0
        await asyncio.sleep(0.5)
        r = health.report("m")
        assert (r.status, r.accepting) == ("degraded", False), r
        assert "no running replica" in (r.reason or "")

    _run(run())


def test_a_controller_that_does_not_answer_decides_nothing() -> None:
    group = _Group()

    async def replicas() -> dict[str, int]:
        raise TimeoutError("controller busy")

    health = _health({"m": group}, replica_counts=replicas, interval_s=0.02, pending_check_s=0.02)

    async def run() -> str:
        health.ensure_started()
        await asyncio.sleep(0.1)
        group.hang = True
        await asyncio.sleep(0.2)
        return health.report("m").status

    assert _run(run()) == "ok"


def test_a_group_that_never_answered_is_starting_not_ready_but_requests_are_forwarded() -> None:
    group = _Group()
    group.hang = True  # Serve holds the probe until the replica has loaded its model
    health = _health({"m": group, "n": _Group()}, interval_s=0.02, pending_check_s=0.05)

    async def run() -> None:
        health.ensure_started()
        await asyncio.sleep(0.15)
        body = health.health("cpu")
        assert (body.status, body.ready, body.degraded) == ("starting", False, ["m"])
        assert body.groups["m"].status == "starting" and body.groups["n"].status == "ok"
        assert body.groups["n"].model_extra == {"queued": 3}  # the group's own fields travel along
        health.admit("m")  # no fact against it: forwarded, Serve holds it until a replica runs

    _run(run())


def test_a_group_that_says_it_is_starting_refuses_and_a_degraded_one_still_serves() -> None:
    starting, degraded = _Group(), _Group()
    starting.own = {"status": "starting", "reason": "loading weights"}
    degraded.own = {"status": "degraded", "reason": "rebuilding the worker set"}
    health = _health({"s": starting, "d": degraded}, interval_s=0.02)

    async def run() -> None:
        health.ensure_started()
        await asyncio.sleep(0.1)
        with pytest.raises(GroupUnavailable, match="loading weights"):
            health.admit("s")
        health.admit("d")
        body = health.health("cpu")
        assert body.status == "degraded" and not body.ready and body.degraded == ["d", "s"]

    _run(run())


def test_probes_are_one_at_a_time_and_never_cancelled() -> None:
    group = _Group()
    group.hang = True  # saturated: the answer does not come
    health = _health({"m": group}, interval_s=0.0, pending_check_s=0.01)

    async def run() -> None:
        health.ensure_started()
        await asyncio.sleep(0.3)  # 30 pending checks
        assert health.report("m").probe_pending_s is not None  # still waiting on the same call

    _run(run())
    assert group.calls == 1  # no pile-up, no retry, no cancellation while it waits


def test_healthz_probes_now_and_sees_a_death_at_once() -> None:
    group = _Group()
    health = _health({"m": group}, interval_s=60.0)  # the next turn is a minute away

    async def run() -> tuple[str, float]:
        health.ensure_started()
        await asyncio.sleep(0.05)
        assert health.report("m").status == "ok"
        group.error = ActorDiedError()
        t0 = asyncio.get_running_loop().time()
        await health.fresh(2.0)  # what /healthz does: probe now, wait briefly for news
        return health.report("m").status, asyncio.get_running_loop().time() - t0

    status, seconds = _run(run())
    assert status == "degraded" and seconds < 0.5


def test_healthz_does_not_wait_long_for_a_busy_group() -> None:
    group = _Group()
    health = _health({"m": group}, interval_s=60.0)

    async def run() -> tuple[str, float]:
        health.ensure_started()
        await asyncio.sleep(0.05)
        group.delay_s = 5.0  # saturated: the next answer comes late
        t0 = asyncio.get_running_loop().time()
        await health.fresh(0.2)
        return health.report("m").status, asyncio.get_running_loop().time() - t0

    status, seconds = _run(run())
    assert status == "ok" and seconds < 0.5  # the known state, answered quickly


def test_healthz_asks_serve_at_once_when_the_handle_holds_the_probe() -> None:
    group = _Group()
    counts = {"m": 1}

    async def replicas() -> dict[str, int]:
        return counts

    # the probe's own controller check is far away: only /healthz's own question can tell
    health = _health({"m": group}, replica_counts=replicas, interval_s=60.0, pending_check_s=60.0)

    async def run() -> tuple[str, float]:
        health.ensure_started()
        await asyncio.sleep(0.05)
        assert health.report("m").status == "ok"
        group.hang, counts["m"] = True, 0  # the replica is gone; the handle holds calls for the next one
        t0 = asyncio.get_running_loop().time()
        await health.fresh(1.0)
        return health.report("m").status, asyncio.get_running_loop().time() - t0

    status, seconds = _run(run())
    assert status == "degraded" and seconds < 0.5


class _KilledAfterAnswering(_Group):
    """A replica that answers each probe as it was when the probe reached it: a probe sent before
    the kill answers ``ok`` (late: the Router's loop is busy), every probe sent after raises."""

    def remote(self) -> Any:
        self.calls += 1
        dead = self.error

        async def answer() -> dict[str, Any]:
            await asyncio.sleep(self.delay_s)
            if dead is not None:
                raise dead
            return dict(self.own)

        return answer()


def test_healthz_does_not_take_an_answer_sent_before_it_asked_for_news() -> None:
    group = _KilledAfterAnswering(delay_s=0.3)
    health = _health({"m": group}, interval_s=0.01, pending_check_s=5.0)

    async def run() -> str:
        health.ensure_started()
        deadline = asyncio.get_running_loop().time() + 30.0
        while health.report("m").status != "ok":  # the first answer is in (a loaded machine: later)
            assert asyncio.get_running_loop().time() < deadline, health.report("m")
            await asyncio.sleep(0.01)
        calls = group.calls
        while group.calls == calls:  # the next probe is on its way, sent while the replica lived
            await asyncio.sleep(0.01)
        group.error = ActorDiedError()  # the replica dies; the probe in flight still answers ok
        await health.fresh(wait_s=1.5)
        return health.report("m").status

    # the late "ok" was asked for before fresh(): only the next probe's answer is news
    assert _run(run()) == "degraded"
