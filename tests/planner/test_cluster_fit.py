"""Planning tasks ask for what the cluster can spare (planner.cluster_fit), and a run that finds no
room stops with what it asked, what is free and who holds it. No Ray cluster needed: the Ray calls
are replaced by the numbers a serving cluster reports."""

from __future__ import annotations

import pytest

from planner import cluster_fit
from planner.cluster_fit import MIN_TASK_CPU, NoRoom, task_shape


def test_tasks_take_a_fraction_of_a_cpu_beside_a_serving_app() -> None:
    # make serve: five groups x 2 workers x 0.15 CPU hold 1.5 of the machine's 2 CPUs
    shape = task_shape({"CPU": 2.0}, {"CPU": 0.5}, hardware="cpu", measure="auto")
    assert shape is not None and (shape.num_cpus, shape.num_gpus) == (0.5, 0.0)
    assert shape.request() == {"CPU": 0.5}
    # an idle machine: one CPU per task, as before
    idle = task_shape({"CPU": 8.0}, {"CPU": 8.0}, hardware="cpu", measure="auto")
    assert idle is not None and idle.num_cpus == 1.0


def test_a_gpu_only_when_one_is_free_or_asked_for() -> None:
    total = {"CPU": 16.0, "GPU": 8.0}
    free_gpu = task_shape(total, {"CPU": 4.0, "GPU": 2.0}, hardware="h200", measure="auto")
    assert free_gpu is not None and free_gpu.num_gpus == 1.0
    # serving holds every GPU: plan on the cost model instead of waiting, and say so
    held = task_shape(total, {"CPU": 4.0, "GPU": 0.0}, hardware="h200", measure="auto")
    assert held is not None and held.num_gpus == 0.0 and "cost model" in held.note
    # --measure always asked for a GPU: no shape until one is free
    assert task_shape(total, {"CPU": 4.0, "GPU": 0.0}, hardware="h200", measure="always") is None
    # --hardware cpu measures on this CPU: a GPU would be held for nothing
    cpu = task_shape(total, {"CPU": 4.0, "GPU": 8.0}, hardware="cpu", measure="auto")
    assert cpu is not None and cpu.num_gpus == 0.0


def test_error_raised_if_the_cluster_has_no_room_within_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    clock = iter(range(0, 1000))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": MIN_TASK_CPU / 2})
    monkeypatch.setattr(cluster_fit, "holders", lambda: [
        "placement group SERVE_REPLICA::xema#ModelGroup:tiny-flux2#a1 (1 CPU)",
        "placement group SERVE_REPLICA::xema#ModelGroup:tiny-ltx2#b2 (0.95 CPU)"])
    monkeypatch.setattr(cluster_fit.time, "sleep", lambda s: None)
    with pytest.raises(NoRoom) as e:
        cluster_fit.fit_tasks("cpu", "auto", wait_s=10, now=lambda: float(next(clock)))
    msg = str(e.value)
    # what it asked for, what is free, who holds it
    assert f"at least {MIN_TASK_CPU:g} CPU" in msg and "0.05 of 2 CPUs" in msg
    assert "ModelGroup:tiny-flux2" in msg and "ModelGroup:tiny-ltx2" in msg and "after 10 s" in msg


def test_a_run_waits_for_room_that_frees_within_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    free = iter([{"CPU": 0.0}, {"CPU": 0.0}, {"CPU": 0.25}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "available_resources", lambda: next(free))
    monkeypatch.setattr(cluster_fit.time, "sleep", lambda s: None)
    shape = cluster_fit.fit_tasks("cpu", "auto", wait_s=10, now=lambda: 0.0)
    assert shape.num_cpus == 0.25
