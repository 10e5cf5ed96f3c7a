"""A batch is priced as it runs (``xema_ray.scheduling.batch_key``): a batch of four requests with four
guidance values runs as four sub-batches, one after the other, and the dispatcher, the replica's
summary and the predicted queue wait of a request behind it count all four. Measured on a model
group of emulated workers in-process (``device: emulated``: each sub-batch sleeps through its
plan's phases, ``xema_ray.runtime.emulated``), the group's own execution path running them."""

from __future__ import annotations

import time
from typing import Any

import pytest

from bench.scenarios.factories import plan_entry, plan_table
from bench.scenarios.group_harness import Harness, request, running_group
from xema_ray.runtime.emulated import emulation_for
from xema_ray.serving.group.model_group import ModelGroup
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="flux2", width=256, height=256, steps=8)
#: one call of n requests (emulated seconds): a full batch of 4 takes 2.0 s, a batch of one 0.8 s
BY_BATCH = {1: 0.8, 2: 1.2, 3: 1.6}
FULL_S = 2.0
GUIDANCE = (2.5, 3.5, 4.0, 5.0)


def _group(batching: str) -> Any:
    e = plan_entry(FLUX, batch=4, latency_s=FULL_S, slo_s=60.0, latency_by_batch=BY_BATCH)
    emulation = emulation_for(plan_table([e]), time_scale=1.0)
    return running_group("flux2", {FLUX.shape_key: e}, device="emulated", emulation=emulation,
                         wait_window_s=0.3, batching=batching)


def _send(h: Harness, rid: str, guidance: float | None) -> Any:
    return h.submit(lambda g: g.generate(request(FLUX.shape_key, rid, "a fox", 1, guidance, steps=FLUX.steps)))


def _running(h: Harness, deadline_s: float = 30.0) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        running = h.group.dispatcher.running
        if running:
            return running[0]
        time.sleep(0.005)
    raise AssertionError("no batch started")


def test_a_batch_of_four_guidance_values_is_predicted_at_the_time_it_takes_and_the_wait_behind_it_says_so() -> None:
    with _group("mixed") as h:
        futs = [_send(h, f"g{i}", g) for i, g in enumerate(GUIDANCE)]
        a = _running(h)
        started = time.monotonic()
        assert len(a.requests) == 4 and len({r.key for r in a.requests}) == 4  # one batch, four keys
        predicted = a.run_s
        assert predicted == pytest.approx(4 * BY_BATCH[1])  # four calls of one, not one call of four (FULL_S)

        async def wait_behind(g: ModelGroup) -> float | None:  # the gauge as the refresh loop sets it
            g.metrics.load.refresh(g.summary())
            return (await g.load_stats()).templates[FLUX.shape_key].predicted_queue_wait_s

        told = h.call(wait_behind)
        since = time.monotonic() - started
        behind = _send(h, "behind", None)  # arrives now: waits for the four sub-batches
        results = [f.result(60) for f in futs]
        waited = behind.result(60).queued_s
    # the batch ran as four sub-batches, one after the other
    assert sorted(r.batch_size for r in results) == [1, 1, 1, 1] and len({r.batch_id for r in results}) == 1
    measured = sum(r.batch_seconds for r in results)  # its four sub-batches on the worker
    assert measured == pytest.approx(predicted, rel=0.10), (measured, predicted)
    # the request behind it was told the batch's remaining time (four calls, less what it had run)
    assert told is not None and told == pytest.approx(predicted - since, rel=0.10, abs=0.05), (told, predicted, since)
    assert waited == pytest.approx(told, rel=0.10, abs=0.1), (waited, told)


def test_by_key_a_batch_never_mixes_guidance() -> None:
    with _group("by_key") as h:
        futs = [_send(h, f"k{i}", g) for i, g in enumerate((None, 3.5, None, 3.5))]
        results = [f.result(60) for f in futs]
    by_batch: dict[int, set[str]] = {}
    for r in results:
        by_batch.setdefault(r.batch_id, set()).add(r.request_id)
    assert sorted(map(sorted, by_batch.values())) == [["k0", "k2"], ["k1", "k3"]]
    assert all(r.batch_size == 2 for r in results)
