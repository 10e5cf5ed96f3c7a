"""Shared fixtures. CPU by default; tests marked ``gpu`` need CUDA and are skipped without it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading

# A Serve handle's router keeps a metrics thread that outlives ``ray.shutdown()``; its next
# ``ray.wait`` would start a fresh local Ray in the pytest process (Ray's auto-init), and the next
# module's ``ray.init`` then fails with "called ray.init twice". Every fixture and the code under
# test call ``ray.init`` explicitly, so auto-init is off for the whole run (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


#: the slowest modules of a serial run (seconds: setup, calls and teardown, ``pytest --durations``),
#: started first where the suite runs on several processes (``make test``, two by default: pytest-xdist,
#: ``--dist loadfile``, each process taking the next module in order), so the run does not end on one
#: process with a long module (a module missing here keeps its place after these; an outdated figure
#: only orders worse). A run on one process keeps the files' order.
SLOWEST_MODULES: dict[str, float] = {
    "tests/serving/test_hardening.py": 137.5, "tests/test_gpu_check.py": 132.0,
    "tests/serving/jobs/test_video_jobs.py": 124.4, "tests/planner/test_ray_job.py": 119.2,
    "tests/serving/jobs/test_video_jobs_redis.py": 96.7, "tests/serving/scale/test_two_nodes.py": 80.4,
    "tests/serving/test_app.py": 78.6, "tests/serving/api/test_tenancy.py": 74.7,
    "tests/serving/test_console_browser.py": 64.7, "tests/serving/test_checkpoints_app.py": 64.5,
    "tests/serving/test_published_app.py": 63.6, "tests/serving/test_emulated_app.py": 59.6,
    "tests/measure/test_layout_hash_seed.py": 58.9, "tests/serving/test_decode_stage_app.py": 57.8,
    "tests/serving/test_adapters_replicated_app.py": 52.5, "tests/serving/scale/test_scale_out.py": 45.3,
    "tests/serving/test_adapter_pairs_app.py": 44.2, "tests/models/test_ltx2.py": 38.9,
    "tests/serving/test_new_models_app.py": 37.1, "tests/planner/test_decode_stage.py": 33.4,
    "tests/serving/api/test_request_options.py": 32.7, "tests/planner/test_expert_switch.py": 32.5,
    "tests/serving/api/test_openapi_contract.py": 30.6, "tests/analyzer/test_block_replay.py": 28.2,
    "tests/serving/test_fast_start.py": 27.9, "tests/serving/scale/test_scale_to_zero_live.py": 23.6,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the slowest modules first, each in its own order
        items.sort(key=lambda item: -SLOWEST_MODULES.get(item.nodeid.split("::", 1)[0], 0.0))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by `make gpu-check` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: a folder named gpu matches that
            item.add_marker(skip)


def _stop_serve_router_thread(timeout_s: float = 5.0) -> None:
    """Stop the asyncio loop Ray Serve runs its handles' routers on in this process (a daemon thread,
    ``SingletonThreadRouter``): its tasks (long polls, metrics pushes) outlive ``ray.shutdown()``, and
    a task still running in Ray's core worker while the interpreter tears it down kills the process
    with SIGSEGV after every test has passed. Cancel them, stop the loop and wait for its thread."""
    router = sys.modules.get("ray.serve._private.router")
    loop = getattr(getattr(router, "SingletonThreadRouter", None), "_asyncio_loop", None)
    if loop is None or loop.is_closed() or not loop.is_running():
        return

    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout_s)
    except (concurrent.futures.TimeoutError, RuntimeError):
        pass  # stopped below all the same
    loop.call_soon_threadsafe(loop.stop)
    for thread in threading.enumerate():
        if thread.name.endswith("(_run_router_event_loop)"):
            thread.join(timeout_s)


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over and reported: stop Serve's router thread, then leave with pytest's status
    without the interpreter's teardown. A process that ran Ray and many Serve handles has died
    with SIGSEGV in that teardown (Ray's core worker torn down under its own threads) after every
    test had passed; what the run found is pytest's status, not how native threads die. Only for
    a whole run: ``XEMA_TEST_TEARDOWN=1`` keeps the interpreter's teardown (to debug it)."""
    _stop_serve_router_thread()
    if _EXIT_STATUS and os.environ.get("XEMA_TEST_TEARDOWN") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every tiny model's checkpoint as its repository publishes it (``xema_ray.checkpoints.write_published``:
    model_index.json classes, bf16 shards with their index), one folder per model, written once per module."""
    from xema_ray.checkpoints import TINY_MODELS, write_published

    out = tmp_path_factory.mktemp("published")
    for m in TINY_MODELS:
        write_published(m, out)
    return out
