"""Selective HSDP over a real gloo group of two processes: bitwise-equal outputs on every
tiny model at several block selections, and the shards really are 1/W of the blocks."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from xema_ray.net import free_port

WORLD = 2
MODELS = ("tiny-flux2", "tiny-cogvideox", "tiny-ltx2")



def _worker(rank: int, port: int, out_dir: str) -> None:
    from tests.mitigation.conftest import run_pipeline
    from planner.estimates import evenly_spread
    from xema_ray.mitigation import HSDPConfig, ProcessGroupCollective, apply_hsdp
    from xema_ray.models import BuildOptions, get_model_spec

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # a failed collective makes the next one hang: bound every wait
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        for model in MODELS:
            spec = get_model_spec(model)
            pipe = spec.build_pipeline(BuildOptions(seed=0))  # identical weights on every rank
            ref = run_pipeline(pipe, model)
            blocks = spec.dit_blocks(pipe.transformer)
            n = len(blocks)
            for name, chosen in (("first", (0,)), ("spread", evenly_spread(2, n)), ("all", tuple(range(n)))):
                full = sum(p.numel() for i in chosen for p in blocks[i][1].parameters())
                handle = apply_hsdp(pipe.transformer, blocks, HSDPConfig(blocks=chosen), ProcessGroupCollective())
                kept = sum(t.numel() for t in handle.resident.values())
                out = run_pipeline(pipe, model)
                handle.remove()
                again = run_pipeline(pipe, model)
                results[f"{model}/{name}"] = {
                    "equal": bool(torch.equal(out, ref)),
                    "restored": bool(torch.equal(again, ref)),
                    "kept": kept,
                    "full": full,
                }
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def test_hsdp_is_bitwise_over_gloo(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("an HSDP worker did not finish within 240 s")
        assert p.exitcode == 0, f"HSDP worker exited with {p.exitcode}"
    for r in range(WORLD):
        results = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert len(results) == 3 * len(MODELS)
        for key, res in results.items():
            assert res["equal"], f"rank {r} {key}: output differs from the unsharded run"
            assert res["restored"], f"rank {r} {key}: remove() did not restore the model"
            # each rank keeps its 1/W slice (padded to a multiple of W per dtype group)
            assert res["kept"] * WORLD >= res["full"] and res["kept"] * WORLD < res["full"] + WORLD * 8, key
