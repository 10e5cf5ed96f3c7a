"""A batch failure that nothing pins on a request is not every request's failure
(``xema_ray.serving.group.isolation``): the batch runs again in parts until each request is served
or fails alone; a request that fails alone is answered by its error's kind (422 for its input,
500 naming it for a bug) while its neighbours are served; the machine's failures (out of memory, a
dead worker, a cancelled batch) are never split. First with a stand-in ``run`` (every case, the
bound on re-runs as a property), then a real group whose denoising loop raises for one prompt."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.scenarios.group_harness import entry, request, running_group
from tests.serving.planted_fault import planted_denoise_fault
from xema_ray.runtime.out_of_memory import DeviceOutOfMemory
from xema_ray.runtime.progress import BatchCancelled
from xema_ray.runtime.request_errors import RequestFailed
from xema_ray.scheduling.batch import DispatchPlan, Pending
from xema_ray.scheduling.batch_key import BatchKey
from xema_ray.scheduling.dispatcher import Dispatcher
from xema_ray.serving.api.errors import exception_response
from xema_ray.serving.group.isolation import run_isolating, split_in
from xema_ray.serving.messages import InvalidRequest, RequestFailedAlone
from xema_ray.serving.group.worker_set import WorkerDied
from xema_ray.templates import RequestTemplate


def _reqs(n: int) -> list[Pending[None]]:
    return [Pending(float(i), i, "t", 0.0, f"r{i}", key=BatchKey(steps=1)) for i in range(n)]


class StandIn:
    """A ``run`` that fails a sub-batch holding any of ``bad`` (or while ``flaky`` lasts), and records every run."""

    def __init__(self, bad: Sequence[str] = (), error: Callable[[], Exception] = lambda: RuntimeError("boom"),
                 flaky: int = 0) -> None:
        self.bad, self.error, self.flaky = set(bad), error, flaky
        self.runs: list[tuple[list[str], bool]] = []
        self.served: list[str] = []

    async def __call__(self, reqs: list[Pending[None]], rerun: bool) -> None:
        ids = [r.request_id for r in reqs]
        self.runs.append((ids, rerun))
        if self.flaky > 0:
            self.flaky -= 1
            raise self.error()
        if self.bad & set(ids):
            raise self.error()
        self.served += ids


def _isolate(run: StandIn, n: int, cost: Callable[[int], float] = lambda k: 1.0) -> tuple[dict[str, Exception], list[tuple[str, int, float]]]:
    told: list[tuple[str, int, float]] = []
    out = asyncio.run(run_isolating(_reqs(n), run, cost, lambda why, k, s: told.append((why, k, s))))
    return out, told


def test_a_planted_request_fails_alone_with_its_inputs_422_and_its_neighbours_are_served() -> None:
    run = StandIn(bad=["r5"], error=lambda: ValueError("latents went NaN for this prompt"))
    out, told = _isolate(run, 8)
    assert sorted(run.served) == [f"r{i}" for i in range(8) if i != 5]
    assert set(out) == {"r5"} and isinstance(out["r5"], InvalidRequest)
    assert "latents went NaN for this prompt" in str(out["r5"]) and "neighbours were served" in str(out["r5"])
    # flat cost: halves (8 -> 4 + 4), then the failing half one request each: 1 + 2 + 4 runs
    assert [len(ids) for ids, _ in run.runs] == [8, 4, 4, 1, 1, 1, 1]
    assert [rerun for _, rerun in run.runs] == [False] + [True] * 6  # its jobs started once
    assert [(why, k) for why, k, _ in told] == [("split", 2), ("split", 4)]
    assert told[0][2] == 2.0 and told[1][2] == 4.0  # predicted seconds of the runs then pending (r0-r3 ran)


def test_a_request_failing_alone_with_a_bug_is_a_500_naming_it() -> None:
    run = StandIn(bad=["r1"], error=lambda: RuntimeError("index out of range in the decoder"))
    out, _ = _isolate(run, 3)
    assert sorted(run.served) == ["r0", "r2"]
    err = out["r1"]
    assert isinstance(err, RequestFailedAlone) and err.request_id == "r1"
    r = exception_response(err)
    assert r is not None and r.status_code == 500
    body = json.loads(r.body)["error"]
    assert body["code"] == "request_failed" and body["type"] == "server_error"
    assert "request r1 failed" in body["message"] and "index out of range" not in body["message"]  # no internals
    r = exception_response(InvalidRequest("the request failed ... (ValueError: x)", None))
    assert r is not None and r.status_code == 422


def test_a_failure_that_disappears_when_split_serves_every_request() -> None:
    run = StandIn(flaky=1)
    out, told = _isolate(run, 4)
    assert out == {} and sorted(run.served) == ["r0", "r1", "r2", "r3"]
    assert [(why, k) for why, k, _ in told] == [("split", 4)]  # flat cost at 4: one each (a tie with halves)


def test_a_failure_every_request_repeats_alone_fails_each_within_the_bound() -> None:
    run = StandIn(bad=[f"r{i}" for i in range(8)], error=lambda: TypeError("a server bug every input hits"))
    out, _ = _isolate(run, 8)
    assert run.served == [] and len(run.runs) == 11 <= 2 * 8 - 1
    # no neighbour was served: nothing tells an input from the server, so each gets the error as raised
    assert set(out) == {f"r{i}" for i in range(8)} and all(type(e) is TypeError for e in out.values())


def test_a_lone_request_failing_is_answered_with_its_error() -> None:
    run = StandIn(bad=["r0"], error=lambda: ValueError("x"))
    out, told = _isolate(run, 1)
    assert type(out["r0"]) is ValueError and told == [] and len(run.runs) == 1


def test_named_requests_are_dropped_and_the_rest_run_once_more() -> None:
    def named() -> Exception:
        return RequestFailed("the prompt could not be encoded", ("r2",), "prompt")
    run = StandIn(bad=["r2"], error=named)
    out, told = _isolate(run, 4)
    assert isinstance(out["r2"], InvalidRequest) and out["r2"].param == "prompt"
    assert run.runs == [(["r0", "r1", "r2", "r3"], False), (["r0", "r1", "r3"], True)]
    assert [(why, k) for why, k, _ in told] == [("named", 1)]


@pytest.mark.parametrize("fault", [
    lambda: DeviceOutOfMemory("out of device memory", "tiny-flux2/64x64x1/s2/b4", 10, 4, "cuda:0"),
    lambda: WorkerDied(0, "RayActorError"),
    lambda: BatchCancelled(2),
    lambda: RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda: __import__("ray.exceptions", fromlist=["x"]).ActorDiedError(),
], ids=["device-oom", "worker-died", "cancelled", "torch-oom-text", "ray-actor-died"])
def test_the_machines_failures_are_not_split(fault: Callable[[], Exception]) -> None:
    run = StandIn(bad=["r0"], error=fault)
    with pytest.raises(type(fault())):
        _isolate(run, 4)
    assert len(run.runs) == 1  # the batch fails as a whole, on its own path (503, retry, rebuild)


def test_errors_as_a_ray_actor_raises_them_are_told_apart_the_same_way() -> None:
    """Deployed, a worker's error reaches the group as Ray's ``RayTaskError`` made an instance of its
    cause (``worker_set_ray``), and the group's answer crosses to the Router by pickle."""
    import pickle

    from ray.exceptions import RayTaskError

    def wrapped(e: Exception) -> Callable[[], Exception]:
        return lambda: RayTaskError("execute", "traceback", e).as_instanceof_cause()

    out, _ = _isolate(StandIn(bad=["r1"], error=wrapped(ValueError("bad latents"))), 2)
    assert isinstance(out["r1"], InvalidRequest) and "bad latents" in str(out["r1"])
    out, _ = _isolate(StandIn(bad=["r1"], error=wrapped(RuntimeError("bug"))), 2)
    back = pickle.loads(pickle.dumps(out["r1"]))
    assert isinstance(back, RequestFailedAlone) and back.request_id == "r1" and str(back) == str(out["r1"])
    oom = DeviceOutOfMemory("out of device memory", "e", 10, 4, "cuda:0")
    run = StandIn(bad=["r1"], error=wrapped(oom))
    with pytest.raises(DeviceOutOfMemory):
        _isolate(run, 2)
    assert len(run.runs) == 1


def test_halves_or_one_each_by_the_plans_cost() -> None:
    plan = DispatchPlan(batch=8, sp=1, slo_s=60, latency_s=8.0, min_latency_s=7.0)  # batching nearly free
    assert split_in(8, plan.latency_for) == 2
    linear = DispatchPlan(batch=8, sp=1, slo_s=60, latency_s=8.0, min_latency_s=1.0)  # no gain from batching
    assert split_in(8, linear.latency_for) == 8
    run = StandIn(bad=["r3"])
    _isolate(run, 8, linear.latency_for)
    assert [len(ids) for ids, _ in run.runs] == [8, 1, 1, 1, 1, 1, 1, 1, 1]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 12), bad=st.sets(st.integers(0, 11)), batching_gain=st.floats(0.0, 1.0))
def test_every_good_request_is_served_every_bad_one_answered_within_2n_minus_1_runs(
        n: int, bad: set[int], batching_gain: float) -> None:
    plan = DispatchPlan(batch=max(n, 2), sp=1, slo_s=60, latency_s=1.0, min_latency_s=batching_gain)
    run = StandIn(bad=[f"r{i}" for i in bad if i < n], error=lambda: ValueError("bad input"))
    out, _ = _isolate(run, n, plan.latency_for)
    good = {f"r{i}" for i in range(n) if i not in bad}
    assert set(run.served) == good and len(run.served) == len(good)  # each served once
    assert set(out) == {f"r{i}" for i in range(n)} - good
    assert all(isinstance(e, InvalidRequest) for e in out.values()) or not good
    assert len(run.runs) <= 2 * n - 1


def test_the_dispatcher_holds_a_re_running_batch_its_predicted_time() -> None:
    d: Dispatcher[None] = Dispatcher({"t": DispatchPlan(batch=4, sp=1, slo_s=60, latency_s=4.0, min_latency_s=1.0)}, 1,
                                     wait_window_s=0.0)
    for i in range(4):
        d.submit("t", f"r{i}", 0.0, key=BatchKey(steps=d.plans["t"].steps))
    (a,) = d.dispatch(0.0)
    assert d.remaining_s(a.batch_id, 10.0) == 0.0  # it overran its prediction
    d.extend(a.batch_id, 2.5, 10.0)
    assert d.remaining_s(a.batch_id, 10.0) == pytest.approx(2.5)
    assert d.remaining_s(a.batch_id, 11.0) == pytest.approx(1.5)


def test_a_re_run_jobs_progress_never_goes_back_and_its_eta_is_the_re_runs(tmp_path: Any) -> None:
    import time

    from xema_ray.serving.jobs.progress import JobProgress, PhaseEstimate
    from xema_ray.serving.jobs.store import JobRecord, JobStoreConfig, new_job_id, open_store

    store = open_store(JobStoreConfig(path=tmp_path))
    rec = store.create(JobRecord(id=new_job_id(), model="m", template="t", prompt="p", seed=1, size="64x64",
                                 seconds="1", frames=9, predicted_s=10.0, created_at=time.time(), steps=4))
    assert store.accept(rec.id, "me") is not None and store.start(rec.id, "me", 10.0)
    store.set_progress(rec.id, 0.6, 3)  # then a neighbour failed the batch
    assert store.rerun(rec.id, "me", 8.0) == pytest.approx(0.6)
    got = store.get(rec.id)
    assert got is not None and got.progress == pytest.approx(0.6) and got.remaining_s() == pytest.approx(8.0)
    assert store.rerun(rec.id, "someone else", 8.0) is None

    published: list[tuple[list[str], float]] = []

    class Publisher:
        def publish(self, jobs: list[str], fraction: float, step: int) -> int:
            published.append((jobs, fraction))
            return len(published)

    estimate = PhaseEstimate(steps=4, text_s=0.0, denoise_step_s=1.0, decode_s=0.0, encode_s=0.0)
    obs = JobProgress(JobStoreConfig(path=tmp_path), ["a", "b"], 0, estimate, bases={"a": 0.6})
    obs._publish(Publisher(), estimate.after_step(2), 2)  # type: ignore[arg-type]
    assert published == [(["a"], pytest.approx(0.8)), (["b"], pytest.approx(0.5))]


# ---------------------------------------------------------------------- a real group, a fault planted in denoising
FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
POISON = "POISON: this prompt breaks the denoiser"


def test_a_group_serves_the_neighbours_of_a_request_whose_denoising_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests in one batch of tiny-flux2, the planted fault raising inside the denoising loop
    whenever a batch holds the poisoned prompt: the three others are served, the poisoned one is
    answered alone; the re-runs are counted and the failed one is a miss of its SLO."""
    with running_group("tiny-flux2", {FLUX.shape_key: entry(FLUX, batch=4, latency_s=0.5)}, wait_window_s=1.0) as h:
        reruns: list[dict[str, Any]] = []
        missed: list[tuple[str, int]] = []
        monkeypatch.setattr(h.group.metrics.reruns, "inc", lambda n, tags: reruns.append({"n": n, **tags}))
        monkeypatch.setattr(h.group.metrics.load, "observe_missed", lambda t, n=1: missed.append((t, n)))
        with planted_denoise_fault(monkeypatch, lambda prompts: POISON in prompts,
                                   lambda: RuntimeError("planted denoise fault")) as fault:
            futs = [h.submit(lambda g, i=i: g.generate(request(FLUX.shape_key, f"q{i}", POISON if i == 2 else f"a fox {i}", i, steps=FLUX.steps)))
                    for i in range(4)]
            results: list[Any] = []
            for f in futs:
                try:
                    results.append(f.result(120))
                except Exception as e:  # noqa: BLE001 - the poisoned request's answer
                    results.append(e)
        assert [type(r).__name__ for r in results] == ["GenerateResult", "GenerateResult", "RequestFailedAlone",
                                                       "GenerateResult"]
        assert "request q2 failed" in str(results[2])
        assert len({r.batch_id for i, r in enumerate(results) if i != 2}) == 1 and all(
            r.batch_size == 1 for i, r in enumerate(results) if i != 2)  # flat plan at 4: one request each
        assert fault.batches[0] == ["a fox 0", "a fox 1", POISON, "a fox 3"] and len(fault.batches) == 5
        assert reruns == [{"n": 4, "template": FLUX.shape_key, "reason": "split"}]
        assert missed == [(FLUX.shape_key, 1)]
        ok = h.call(lambda g: g.generate(request(FLUX.shape_key, "after", "a fox", 9, steps=FLUX.steps)))  # and the group serves on
        assert ok.media_type == "image/png"


def test_a_part_that_served_nobody_does_not_make_the_failing_request_a_neighbours_fault() -> None:
    """A part whose members were all deleted meanwhile runs nothing (``run`` returns False): the
    request failing alone beside it gets its error as raised, not a 422/500 saying neighbours were
    served."""
    async def run(reqs: list[Pending[None]], rerun: bool) -> bool:
        ids = {r.request_id for r in reqs}
        if "r1" in ids:
            raise ValueError("bad")
        return False  # r0's job was deleted: nothing ran

    out = asyncio.run(run_isolating(_reqs(2), run, lambda k: float(k)))
    assert type(out["r1"]) is ValueError and "r0" not in out


def test_a_re_run_holds_the_workers_for_the_sub_batches_still_to_come_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of two guidance values runs as two sub-batches; when the first fails and runs again
    in parts, the dispatcher is told the parts' time plus the second sub-batch's (before: the
    parts' only, so the workers looked free while the second still had to run)."""
    with running_group("tiny-flux2", {FLUX.shape_key: entry(FLUX, batch=4, latency_s=0.5)}, wait_window_s=1.0,
                       batching="mixed") as h:  # a batch takes both guidance values, as two sub-batches
        told: list[float] = []
        real = h.group.dispatcher.extend
        monkeypatch.setattr(h.group.dispatcher, "extend", lambda b, more_s, now: (told.append(more_s), real(b, more_s, now)))
        with planted_denoise_fault(monkeypatch, lambda prompts: POISON in prompts, lambda: RuntimeError("planted")):
            asks = [(POISON, 3.0), ("a fox 1", 3.0), ("a fox 2", 5.0), ("a fox 3", 5.0)]
            futs = [h.submit(lambda g, i=i, p=p, gs=gs: g.generate(request(FLUX.shape_key, f"q{i}", p, i, guidance_scale=gs, steps=FLUX.steps)))
                    for i, (p, gs) in enumerate(asks)]
            outcomes = []
            for f in futs:
                try:
                    outcomes.append(type(f.result(120)).__name__)
                except Exception as e:  # noqa: BLE001 - the poisoned request's answer
                    outcomes.append(type(e).__name__)
        assert outcomes == ["RequestFailedAlone", "GenerateResult", "GenerateResult", "GenerateResult"]
        plan = h.group.dispatcher.plans[FLUX.shape_key]
        # the first sub-batch (guidance 3.0) failed and runs again one each: two runs, then the other sub-batch
        assert told == [pytest.approx(2 * plan.latency_for(1) + plan.latency_for(2))]
