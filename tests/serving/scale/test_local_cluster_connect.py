"""``LocalCluster.connect``: a driver's ``ray.init`` that the head's GCS misses under load is tried
again, and a cluster that never answers fails with every attempt's error (no Ray started here)."""

from __future__ import annotations

import pytest
import ray

from bench.scenarios.local_cluster import LocalCluster, Node


def _cluster(monkeypatch: pytest.MonkeyPatch, outcomes: list[Exception | None]) -> tuple[LocalCluster, list[dict]]:
    calls: list[dict] = []

    def init(**kwargs: object) -> None:
        calls.append(kwargs)
        error = outcomes.pop(0)
        if error is not None:
            raise error

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr("bench.scenarios.local_cluster.time.sleep", lambda _s: None)
    c = LocalCluster()
    c.temp_dir.rmdir()  # its nodes' folder: none is started here
    c.head = Node(proc=None, args=[], log=c.temp_dir / "head.log", ports={"gcs": 6123})  # type: ignore[arg-type]
    return c, calls


def test_a_missed_first_request_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    missed = ray.exceptions.RpcError("Timed out while waiting for GCS to become available.")
    c, calls = _cluster(monkeypatch, [missed, None])
    c.connect(log_to_driver=False)
    assert calls == [{"address": "127.0.0.1:6123", "log_to_driver": False}] * 2


def test_a_cluster_that_never_answers_fails_with_every_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    c, calls = _cluster(monkeypatch, [ConnectionError("no GCS"), RuntimeError("node info timed out")])
    with pytest.raises(RuntimeError, match=r"in 2 attempts:\nattempt 1: ConnectionError\('no GCS'\)\nattempt 2: "
                                           r"RuntimeError\('node info timed out'\)"):
        c.connect(attempts=2)
    assert len(calls) == 2
