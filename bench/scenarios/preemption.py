"""The live preemption scenario on CPU: one tiny-cogvideox worker, long videos submitted first, a
short one arriving while the first long one runs. The first long request is a video job, the
others are synchronous; while they run, a sampler records the job's status next to the group's
paused-batch count. Two ways to run it: ``run_live`` through the Serve app (``POST /v1/videos``
polled until completed, ``/v1/videos/sync``; ``make bench-preemption``) and ``run_group`` on a
ModelGroup with in-process workers, no Ray (tests/serving/group/test_preemption_live.py).

The plan table's latencies are measured here first (one run of each template in-process), so the
dispatcher's predictions match this machine; pause bytes come from the planner's traces. The
long template has 200 denoising steps so that its denoising loop (where a batch can pause) is
about half of its time: the tiny CogVideoX's transformer is far cheaper than its VAE.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from pathlib import Path
from typing import Any

import requests
import torch
from pydantic import BaseModel

from bench.scenarios.factories import plan_entry
from bench.scenarios.serve_app import running_app
from xema_ray.plan import ExecutionConfig, PlanTable
from xema_ray.sim.simulate import Arrival, SimulationConfig, simulate
from xema_ray.templates import RequestTemplate

LONG = RequestTemplate(model="tiny-cogvideox", width=128, height=96, frames=17, steps=200)
SHORT = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2)


#: the request of ``arrivals`` sent as a video job
JOB_REQUEST = "1"


class LiveRun(BaseModel):
    latencies_s: dict[str, float]  # request (seed as a string) -> seconds, arrival to response
    templates: dict[str, str]  # request -> template shape key
    decisions: list[tuple[str, str, int]]  # (kind, paused template, requests of the preempting batch)
    stats: dict[str, Any]  # the group's preemption report
    all_stats: dict[str, Any]  # the whole /v1/stats answer at the end
    job_samples: list[tuple[int, str]]  # (batches paused in the group, the job's status) over the run


def measure_latencies() -> dict[str, float]:
    """Seconds of one batch of each template on this machine (after a warm-up)."""
    from xema_ray.models import BuildOptions, get_model_spec
    from xema_ray.runtime import Batch, ExecutionEngine, GenerationRequest

    spec = get_model_spec("tiny-cogvideox")
    torch.set_num_threads(1)  # as a 0.5-CPU worker runs
    engine = ExecutionEngine(spec.build_pipeline(BuildOptions()), spec, torch.device("cpu"), torch.float32)
    out = {}
    for i, t in enumerate((SHORT, SHORT, LONG)):  # the first run warms up
        batch = Batch(config=ExecutionConfig(template=t), requests=(GenerationRequest(request_id="m", prompt="sea", seed=0),),
                      steps=t.steps)
        t0 = time.perf_counter()
        engine.execute(batch)
        if i:
            out[t.shape_key] = time.perf_counter() - t0
    return out


def plan_table(latency: dict[str, float], hardware: str) -> PlanTable:
    """Short: SLO 2× its latency + 0.5 s (it cannot wait for a long one); long: 10× its latency.
    The short template also carries a static layout (``run_live`` writes it next to the table):
    the CPU workers load and validate it and report why they cannot arm it."""
    from planner.pause_state import with_pause_bytes
    from planner.traces import TraceCache
    from xema_ray.measure.layout_solve import solve_entry_layout

    cache = TraceCache()
    entries = {}
    for t, slo in ((SHORT, 2 * latency[SHORT.shape_key] + 0.5), (LONG, 10 * latency[LONG.shape_key])):
        lat = latency[t.shape_key]
        ref = solve_entry_layout(ExecutionConfig(template=t), gpu="any").layout_id if t is SHORT else None
        e = plan_entry(t, layout_ref=ref, peak_bytes=50 * 2**20, latency_s=lat, goodput_rps=1 / lat, slo_s=slo)
        entries[t.shape_key] = with_pause_bytes(e, cache)
    return PlanTable(hardware=hardware, gpus=1, budget_bytes=2**30, entries=entries)


def arrivals(latency: dict[str, float]) -> list[Arrival]:
    """The two long requests 0.2 s apart (the job first: it is the one that pauses), the short one
    at 0.5 s: early in the first one's denoising
    loop (on these tiny models the VAE decode is about half of a long request, and a batch can
    only pause between denoising steps; the dispatcher spreads a batch's latency evenly over its
    steps, so a short request arriving during the decode would be a decision live cannot take)."""
    del latency  # the times are fixed: 200 steps keep the denoising loop past 0.5 s on these machines
    at = 0.5
    return [Arrival(t=0.0, template=LONG.shape_key, request_id="1"), Arrival(t=0.2, template=LONG.shape_key, request_id="2"),
            Arrival(t=at, template=SHORT.shape_key, request_id="3")]


def serve_args(max_preemptions: int, jobs_dir: Path | None = None) -> dict[str, Any]:
    return {"device": "cpu", "worker_cpus": 0.5, "force_plan_table": True,
            **({"jobs": {"backend": "sqlite", "path": str(jobs_dir)}} if jobs_dir is not None else {}),
            "models": [{"model": "tiny-cogvideox", "workers": 1, "wait_window_s": 0.0, "max_preemptions": max_preemptions,
                        "templates": [{"width": t.width, "height": t.height, "frames": t.frames, "steps": t.steps}
                                      for t in (SHORT, LONG)]}]}


def run_live(table: PlanTable, trace: list[Arrival], plans_dir: Path, max_preemptions: int) -> LiveRun:
    """Send ``trace`` to the app (each request at its time) and collect latencies and decisions."""
    from xema_ray.allocator.artifact import layouts_dir

    by_key = {t.shape_key: t for t in (SHORT, LONG)}
    _save_layouts(table, layouts_dir(plans_dir / "table.json"))  # running_app saves the table as plans_dir/table.json
    with running_app(serve_args(max_preemptions, plans_dir / "jobs"), table, plans_dir) as url:
        body = {"model": "tiny-cogvideox", "prompt": "warm-up", "seed": 0}
        for t in (SHORT, LONG):  # warm-up: each template once (worker threads, pipelines)
            r = requests.post(f"{url}/v1/videos/sync", json={**body, "size": f"{t.width}x{t.height}", "num_frames": t.frames,
                                                               "num_inference_steps": t.steps}, timeout=300)
            r.raise_for_status()
        job: dict[str, str] = {}
        finished = threading.Event()

        def fire(a: Arrival, start: float) -> tuple[str, float]:
            time.sleep(max(0.0, start + a.t - time.perf_counter()))
            t = by_key[a.template]
            params = {"model": "tiny-cogvideox", "prompt": f"request {a.request_id}", "seed": int(a.request_id),
                      "size": f"{t.width}x{t.height}", "num_frames": t.frames, "num_inference_steps": t.steps}
            t0 = time.perf_counter()
            if a.request_id != JOB_REQUEST:
                requests.post(f"{url}/v1/videos/sync", json=params, timeout=600).raise_for_status()
                return a.request_id, time.perf_counter() - t0
            r = requests.post(f"{url}/v1/videos", json=params, timeout=60)
            r.raise_for_status()
            job["id"] = r.json()["id"]
            while requests.get(f"{url}/v1/videos/{job['id']}", timeout=30).json()["status"] not in ("completed", "failed"):
                time.sleep(0.05)
            return a.request_id, time.perf_counter() - t0

        samples: list[tuple[int, str]] = []

        def sample() -> None:
            while not finished.is_set():
                if "id" in job:
                    paused = requests.get(f"{url}/healthz", timeout=30).json()["groups"]["tiny-cogvideox"]["paused"]
                    status = requests.get(f"{url}/v1/videos/{job['id']}", timeout=30).json()["status"]
                    samples.append((int(paused), status))
                time.sleep(0.02)

        start = time.perf_counter()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with cf.ThreadPoolExecutor(len(trace)) as pool:
            done = list(pool.map(lambda a: fire(a, start), trace))
        finished.set()
        sampler.join(timeout=30)
        final = requests.get(f"{url}/v1/videos/{job['id']}", timeout=30).json()["status"]
        samples.append((0, final))
        stats = requests.get(f"{url}/v1/stats", timeout=30).json()
    group = stats["preemption"]["tiny-cogvideox"]
    return LiveRun(latencies_s=dict(done), templates={a.request_id: a.template for a in trace},
                   decisions=[(d["kind"], d["template"], len(d["by"])) for d in group["recent"]], stats=group,
                   all_stats=stats, job_samples=samples)


def _save_layouts(table: PlanTable, folder: Path) -> None:
    from xema_ray.allocator.artifact import save_artifact
    from xema_ray.measure.layout_solve import solve_entry_layout

    for e in table.entries.values():
        if e.config.layout_ref is not None:
            save_artifact(solve_entry_layout(e.config.model_copy(update={"layout_ref": None}), gpu="any"), folder)


def run_group(table: PlanTable, trace: list[Arrival], plans_dir: Path, max_preemptions: int) -> LiveRun:
    """``trace`` on a ModelGroup with one in-process worker (no Ray): the job through
    ``submit_job`` and the job store, the others through ``generate``, each at its time."""
    from bench.scenarios.group_harness import request, running_group
    from xema_ray.allocator.artifact import layouts_dir
    from xema_ray.scheduling.preemption_policy import PreemptionPolicy
    from xema_ray.serving.jobs.store import JobRecord, JobStoreConfig, new_job_id, open_store

    folder = layouts_dir(plans_dir / "table.json")
    _save_layouts(table, folder)
    jobs = JobStoreConfig(path=plans_dir / "jobs")
    store = open_store(jobs)
    policy = PreemptionPolicy(budget_bytes=table.budget_bytes, max_preemptions=max_preemptions) if max_preemptions else None
    by_key = {t.shape_key: t for t in (SHORT, LONG)}
    with running_group("tiny-cogvideox", dict(table.entries), wait_window_s=0.0, jobs=jobs, preemption=policy,
                       layouts_dir=folder) as h:
        for key in (SHORT.shape_key, LONG.shape_key):  # warm-up: each template once (worker threads, pipelines)
            h.call(lambda g: g.generate(request(key, f"warm-{key}", "warm-up", 0, steps=by_key[key].steps)), timeout=300)  # runs before the loop moves on
        job: dict[str, str] = {}
        finished = threading.Event()

        def fire(a: Arrival, start: float) -> tuple[str, float]:
            time.sleep(max(0.0, start + a.t - time.perf_counter()))
            t = by_key[a.template]
            prompt, seed = f"request {a.request_id}", int(a.request_id)
            t0 = time.perf_counter()
            if a.request_id != JOB_REQUEST:
                h.call(lambda g: g.generate(request(t.shape_key, a.request_id, prompt, seed, steps=t.steps)), timeout=600)
                return a.request_id, time.perf_counter() - t0
            rec = store.create(JobRecord(id=new_job_id(), model=t.model, template=t.shape_key, prompt=prompt, seed=seed,
                                         size=f"{t.width}x{t.height}", seconds="2", frames=t.frames, predicted_s=10.0,
                                         created_at=time.time(), steps=t.steps))
            job["id"] = rec.id
            assert h.call(lambda g: g.submit_job(request(t.shape_key, rec.id, prompt, seed, steps=rec.steps)))
            while (got := store.get(rec.id)) is None or got.status not in ("completed", "failed"):
                time.sleep(0.02)
            return a.request_id, time.perf_counter() - t0

        samples: list[tuple[int, str]] = []

        def sample() -> None:
            while not finished.is_set():
                if "id" in job:
                    paused = h.call(lambda g: g.status())["paused"]
                    rec = store.get(job["id"])
                    samples.append((int(paused), rec.status if rec is not None else "gone"))
                time.sleep(0.02)

        start = time.perf_counter()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with cf.ThreadPoolExecutor(len(trace)) as pool:
            done = list(pool.map(lambda a: fire(a, start), trace))
        finished.set()
        sampler.join(timeout=30)
        final = store.get(job["id"])
        samples.append((0, final.status if final is not None else "gone"))
        report = h.call(lambda g: g.preemption_stats())
        layouts = h.call(lambda g: g.layout_stats())
    group = report.model_dump()
    return LiveRun(latencies_s=dict(done), templates={a.request_id: a.template for a in trace},
                   decisions=[(d.kind, d.template, len(d.by)) for d in report.recent], stats=group,
                   all_stats={"preemption": {"tiny-cogvideox": group},
                              "static_layouts": {"tiny-cogvideox": layouts.model_dump()}},
                   job_samples=samples)


def simulated_decisions(table: PlanTable, trace: list[Arrival]) -> list[tuple[str, str, int]]:
    """The simulator's decisions on the same trace, in the live run's terms (request ids differ
    between the two: the router names live requests)."""
    res = simulate(table, trace, SimulationConfig(preemption=True))
    return [(d.kind, d.template, len(d.by)) for d in res.decisions]
