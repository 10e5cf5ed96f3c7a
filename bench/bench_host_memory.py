"""What the first and each further worker of a node cost in host memory, measured on this machine.

K worker processes each build a Flux.2 transformer cut to real-size blocks (one double-stream
block, 1.96 GB in bf16, homed on the host as an offload plan homes it; one single-stream block on
the "device", which on this CPU machine is host memory too), seeded weights, the loader the serving
worker runs (``ModelSpec.build_transformer``). With ``share`` the host-homed block lands in the
node's shared segment (``/dev/shm``), else in each worker's own exact buffer. Measured: each
process's ``RssAnon`` / ``RssShmem`` (``/proc/self/status``) after its load and the node's
``Shmem`` and ``MemAvailable`` (``/proc/meminfo``) with all K loaded, against the plan's figure
(``worker_host_bytes``). Page-locking needs a GPU (the GPU check measures it); pinning tensor by
tensor is torch's power-of-two rule applied to the same tensors.

    .venv/bin/python bench/bench_host_memory.py --out bench/results/host_memory.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import tempfile
import time
from pathlib import Path

CFG = {"num_layers": 1, "num_single_layers": 1}


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssShmem", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("Shmem", "MemAvailable"):
            out[k] = int(v.split()[0]) * 1024
    return out


def worker(share: bool, shm: str, ready, go, model: str = "flux2") -> None:  # type: ignore[no-untyped-def]
    os.environ["XEMA_SHM_DIR"] = shm
    import torch

    from xema_ray.models.host_pack import close_host_buffers
    from xema_ray.models.loading import SeededWeights, build_on_meta, materialize
    from xema_ray.models import get_model_spec
    from xema_ray.placement import WeightHome

    spec = get_model_spec(model)
    before = _status()
    dit = build_on_meta(spec.transformer_class(), {**spec.transformer_config, **CFG}, torch.bfloat16)
    home = lambda p: WeightHome.HOST if p.startswith("transformer_blocks.0") else WeightHome.DEVICE  # noqa: E731
    t0 = time.perf_counter()
    report = materialize(dit, torch.device("cpu"), torch.bfloat16, SeededWeights(0, "transformer"), home,
                         share="flux2-cut|transformer" if share else None, pinned=True)
    after = _status()
    ready.put({"pid": os.getpid(), "load_s": round(time.perf_counter() - t0, 2),
               "host_buffer_bytes": report.host_buffer_bytes, "host_attached_bytes": report.host_attached_bytes,
               "host_pow2_bytes": report.host_pow2_bytes, "device_bytes": report.device_bytes,
               "rss_anon_delta": after["RssAnon"] - before["RssAnon"],
               "rss_shmem_delta": after["RssShmem"] - before["RssShmem"]})
    go.wait()
    close_host_buffers([dit])


def run(k: int, share: bool, model: str = "flux2") -> dict[str, object]:
    ctx = mp.get_context("spawn")
    shm = tempfile.mkdtemp(prefix="xema-bench-", dir="/dev/shm")
    ready, go = ctx.Queue(), ctx.Event()
    node0 = _meminfo()
    procs, rows = [], []
    for _ in range(k):  # one at a time: the first fills, the others map (or each fills its own)
        p = ctx.Process(target=worker, args=(share, shm, ready, go, model))
        p.start()
        procs.append(p)
        rows.append(ready.get(timeout=600))
    node = _meminfo()
    go.set()
    for p in procs:
        p.join(timeout=120)
    left = sorted(os.listdir(shm))
    if not [f for f in left if not f.endswith(".lock")]:  # the last worker out removed its segment
        for f in left:
            os.unlink(os.path.join(shm, f))  # the zero-byte creation locks
        os.rmdir(shm)
    return {"workers": k, "share": share, "per_worker": rows,
            "node_shmem_delta": node["Shmem"] - node0["Shmem"],
            "node_available_drop": node0["MemAvailable"] - node["MemAvailable"],
            "segments_left_after_exit": [f for f in left if not f.endswith(".lock")]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/host_memory.json"))
    ap.add_argument("--model", default="flux2", help="flux2 (the measurement) or tiny-flux2 (a quick rehearsal)")
    args = ap.parse_args()
    from xema_ray.models import get_model_spec
    from xema_ray.runtime.host_bytes import worker_host_bytes
    from xema_ray.runtime.residency import Residency

    planned = worker_host_bytes(get_model_spec(args.model), Residency(host_blocks=(0,)), None, share=True)
    result = {"machine": f"{platform.node()} ({os.cpu_count()} CPUs, shared with other jobs)",
              "what": "Flux.2 cut to 1 double block (host-homed) + 1 single block, bf16, seeded; K worker processes",
              "planned_worker": planned.model_dump(),
              "shared": run(args.workers, True, args.model), "private": run(args.workers, False, args.model)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for mode in ("shared", "private"):
        r = result[mode]
        per = r["per_worker"]  # type: ignore[index]
        print(f"{mode}: node Shmem +{r['node_shmem_delta'] / 1e9:.2f} GB, MemAvailable -"  # type: ignore[index]
              f"{r['node_available_drop'] / 1e9:.2f} GB; per worker RssAnon +"  # type: ignore[index]
              + ", ".join(f"{w['rss_anon_delta'] / 1e9:.2f}" for w in per) + " GB, RssShmem +"
              + ", ".join(f"{w['rss_shmem_delta'] / 1e9:.2f}" for w in per) + " GB, attached "
              + ", ".join(f"{w['host_attached_bytes'] / 1e9:.2f}" for w in per) + " GB")
    print(f"planned per worker: {planned.resident_bytes / 1e9:.3f} GB; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
