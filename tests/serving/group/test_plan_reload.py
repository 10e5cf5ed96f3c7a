"""A running group takes a new plan table in place (plan_reload, what Serve's ``reconfigure`` calls):
under load, nothing accepted is lost, requests that arrive during the swap queue, the workers are
replaced once, and an unchanged table changes nothing. In-process workers, no Ray."""

from __future__ import annotations

import time

import pytest

from bench.scenarios.group_harness import entry, request, running_group
from xema_ray.plan import PlanTable
from xema_ray.runtime.worker import LoadedModel, ModelLoadConfig, Worker
from xema_ray.serving.group.worker_set import WORKER_KINDS, WorkerKind, worker_set_for
from xema_ray.serving.group.plan_reload import GroupPlans, group_plans, plans_hash
from xema_ray.templates import RequestTemplate

FLUX_S = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
FLUX_L = RequestTemplate(model="tiny-flux2", width=128, height=128, steps=2)


def _plans(batch: int) -> dict:
    return {FLUX_S.shape_key: entry(FLUX_S, batch=batch), FLUX_L.shape_key: entry(FLUX_L)}


def test_a_new_table_is_swapped_in_under_load_and_nothing_accepted_is_lost() -> None:
    with running_group("tiny-flux2", _plans(batch=1), wait_window_s=0.05, max_queue=64) as h:
        before = h.call(lambda g: g.status())
        futs = [h.submit(lambda g, i=i: g.generate(request(FLUX_S.shape_key, f"a{i}", "a fox", i, steps=FLUX_S.steps))) for i in range(6)]
        while not h.call(lambda g: g.status())["running"]:  # a batch is running when the table arrives
            time.sleep(0.01)
        new = GroupPlans(plans=_plans(batch=2), source="test")
        h.call(lambda g: g.reconfigure(new.model_dump(mode="json")))  # returns at once: Serve sees it RUNNING
        during = [h.submit(lambda g, i=i: g.generate(request(FLUX_S.shape_key, f"b{i}", "a fox", 100 + i, steps=FLUX_S.steps)))
                  for i in range(4)]
        results = [f.result(120) for f in futs + during]
        assert [r.request_id for r in results] == [f"a{i}" for i in range(6)] + [f"b{i}" for i in range(4)]
        assert all(r.media_type == "image/png" for r in results)
        deadline = time.time() + 60
        while (s := h.call(lambda g: g.status()))["plans_swapping"] and time.time() < deadline:
            time.sleep(0.05)
        assert s["plans_hash"] == new.hash != before["plans_hash"] and s["plans_swapped"] == 1
        assert s["generation"] == before["generation"] + 1 and s["status"] == "ok"  # the workers, replaced once
        # the new plan serves: two concurrent requests share a batch of 2 (the old plan ran batches of 1)
        a, b = (f.result(120) for f in [h.submit(lambda g, i=i: g.generate(request(FLUX_S.shape_key, f"c{i}", "x", i, steps=FLUX_S.steps)))
                                        for i in range(2)])
        assert a.batch_id == b.batch_id and a.batch_size == 2
        # the same table again is nothing to do: no swap, no new workers
        h.call(lambda g: g.reconfigure(new.model_dump(mode="json")))
        again = h.call(lambda g: g.status())
        assert again["plans_swapped"] == 1 and again["generation"] == s["generation"] and not again["plans_swapping"]


def test_error_raised_if_a_new_table_does_not_plan_the_served_templates() -> None:
    with running_group("tiny-flux2", _plans(batch=1)) as h:
        only_one = GroupPlans(plans={FLUX_S.shape_key: entry(FLUX_S, batch=2)})
        with pytest.raises(ValueError, match="exactly the served templates"):
            h.call(lambda g: g.reconfigure(only_one.model_dump(mode="json")))
        assert h.call(lambda g: g.status())["plans_hash"] == plans_hash(_plans(batch=1))


def test_group_plans_come_from_a_table_and_name_what_it_lacks() -> None:
    table = PlanTable(hardware="cpu", gpus=1, budget_bytes=10**9, entries=_plans(batch=2))
    got = group_plans(table, "tiny-flux2", [FLUX_S.shape_key, FLUX_L.shape_key], "plans/t.json")
    assert got.budget_bytes == 10**9 and got.layouts_dir is not None and got.layouts_dir.endswith("plans/t.layouts")
    with pytest.raises(ValueError, match="no plan for tiny-flux2/96x96"):
        group_plans(table, "tiny-flux2", [FLUX_S.shape_key, "tiny-flux2/96x96x1"], None)


class _PickyWorker(Worker):
    """Cannot load plans of batch 2 (as a worker cannot load a plan whose layout file is missing)."""

    def load_model(self, load: ModelLoadConfig) -> LoadedModel:
        if any(c.batch == 2 for c in load.plans):
            raise RuntimeError("layout 7ac23b0e57b84838: .../t.layouts/7ac23b0e57b84838.json is missing")
        return super().load_model(load)


def test_a_table_the_workers_cannot_load_leaves_the_group_on_its_previous_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(WORKER_KINDS, "picky", WorkerKind(_PickyWorker, platform="cpu", backend="inprocess"))
    with running_group("tiny-flux2", _plans(batch=1), device="picky", wait_window_s=0.05, worker_set=worker_set_for) as h:
        before = h.call(lambda g: g.status())
        queued = [h.submit(lambda g, i=i: g.generate(request(FLUX_S.shape_key, f"q{i}", "x", i, steps=FLUX_S.steps))) for i in range(3)]
        new = GroupPlans(plans=_plans(batch=2))
        h.call(lambda g: g.reconfigure(new.model_dump(mode="json")))
        assert all(f.result(120).media_type == "image/png" for f in queued)  # nothing accepted is lost
        deadline = time.time() + 60
        while (s := h.call(lambda g: g.status()))["plans_swapping"] and time.time() < deadline:
            time.sleep(0.05)
        assert s["plans_hash"] == before["plans_hash"] and s["status"] == "ok", s  # the previous plans, loaded again
        assert new.hash in s["plans_reload_error"] and "is missing" in s["plans_reload_error"]
        a = h.submit(lambda g: g.generate(request(FLUX_S.shape_key, "after", "x", 9, steps=FLUX_S.steps))).result(120)
        assert a.batch_size == 1
