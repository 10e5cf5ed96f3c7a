"""Run a function on N spawned processes that form one gloo worker set (CPU SP tests)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, url: str, args: tuple[Any, ...], queue: Any) -> None:
    # one intra-op thread per process: two ranks share the CI box's two cores
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(rank, world, url, *args)))
    except BaseException:  # report, don't hang the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_worker_set(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """``fn(rank, world, init_method, *args)`` on ``world`` processes; results in rank order.
    ``fn`` must be importable by name (a module-level function)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_entry, args=(fn, r, world, url, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
