"""A replica's start, cold (checkpoint read from disk) vs warm (the node's host copy mapped), measured.

A seeded model of about 2 GB is written here (tiny-flux2's pipeline with its transformer widened
to 538 M parameters, fp32, as ``save_pretrained`` writes a diffusers directory; never downloaded,
deleted at the end). Each start is a fresh worker process, as a new replica's worker is, that
imports the project, loads the model with the worker's own load path
(``Worker.load_model``, ``xema_ray.models.loading.materialize``) and serves one request. Phases:

- *process start*: spawn -> the interpreter runs the script's first line;
- *imports*: torch, diffusers and the project imported;
- *weight phase*: checkpoint -> host -> device (``LoadedModel.source_s``: values read into their
  slot of the host copy, or mapped from it; ``device_copy_s``: host copy -> device, a memory copy
  on this CPU machine, where the GPU's pinned DMA would run; then one element of every page of
  every weight read: a CPU worker without a host copy keeps the checkpoint's memory-mapped
  tensors, whose pages are read from disk at that first touch, not during the load);
- *rest of the load*: building the modules on meta, the scheduler, the engine;
- *first request*: one 64x64, 2-step request served;
- *time to first served request*: spawn -> that request's result.

Starts, in one run and alternating: ``direct`` (today's default on a CPU: checkpoint straight to
the device, no host copy), ``cold`` (host copy on, none on the node yet: the worker fills it) and
``warm`` (host copy on and present: kept by this process as the node-level holder). Before every
start the checkpoint's files are dropped from the page cache (``os.posix_fadvise(POSIX_FADV_DONTNEED)``
after an ``fsync``; the share still cached is recorded); before ``direct`` and ``cold`` the host
copy is removed too.

    .venv/bin/python bench/bench_warm_start.py --out bench/results/warm_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: tiny-flux2's transformer widened to 538,060,288 parameters (2.15 GB in fp32); the text encoder's
#: width (joint_attention_dim) and the VAE's latent channels (in_channels) stay the tiny ones
WIDE = {"num_attention_heads": 8, "attention_head_dim": 128, "axes_dims_rope": [32, 32, 32, 32],
        "num_layers": 4, "num_single_layers": 30}
MODEL = "tiny-flux2"


def write_model(root: Path, seed: int) -> Path:
    """The seeded checkpoint: the tiny pipeline, its transformer replaced by the wide one."""
    import torch

    from xema_ray.checkpoints import write_checkpoint
    from xema_ray.models import get_model_spec
    from xema_ray.models.loading import SeededWeights, build_on_meta, materialize

    target = write_checkpoint(MODEL, root, seed=seed, dtype=torch.float32)
    spec = get_model_spec(MODEL)
    folder = target / "transformer"
    config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if not k.startswith("_")}
    config.update(WIDE)
    model = build_on_meta(spec.transformer_class(), config, torch.float32)
    materialize(model, torch.device("cpu"), torch.float32, SeededWeights(seed, "transformer"))
    shutil.rmtree(folder)
    model.save_pretrained(str(folder), safe_serialization=True, max_shard_size="1GB")
    del model
    return target


def checkpoint_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def drop_page_cache(files: list[Path]) -> int:
    """Drop ``files`` from the page cache (written pages first reach the disk: a dirty page is not
    dropped); returns their bytes."""
    total = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def cached_fraction(files: list[Path]) -> float:
    """The share of ``files``' pages in the page cache now (``mincore`` over a read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = pages = 0
    for f in files:
        size = f.stat().st_size
        if not size:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            libc.mincore(addr, size, vec)
            libc.munmap(addr, size)
        finally:
            os.close(fd)
        resident += sum(v & 1 for v in vec)
        pages += n
    return resident / pages if pages else 0.0


def child(args: dict) -> None:  # type: ignore[type-arg]
    """One replica's worker: imports, load, one request; its timestamps on stdout as JSON."""
    started = time.time()
    import torch  # noqa: F401

    from xema_ray.parallel.groups import ParallelConfig
    from xema_ray.plan import ExecutionConfig
    from xema_ray.platforms.host_memory import SegmentHolder
    from xema_ray.runtime.engine import Batch, GenerationRequest
    from xema_ray.runtime.worker import ModelLoadConfig, Worker
    from xema_ray.templates import RequestTemplate

    imported = time.time()
    t = RequestTemplate(model=MODEL, width=64, height=64, steps=2)
    config = ExecutionConfig(template=t)
    holder = SegmentHolder.model_validate(args["holder"]) if args["host_copy"] else None
    w = Worker(platform="cpu")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    load_start = time.time()
    loaded = w.load_model(ModelLoadConfig(model=MODEL, weights_dir=Path(args["weights"]), plans=(config,),
                                          host_copy=args["host_copy"], host_copy_holder=holder))
    load_end = time.time()
    touch_s = touch(w)
    out = w.execute(Batch(config=config, steps=t.steps, requests=(GenerationRequest(request_id="r", prompt="a fox",
                                                                                   seed=1),)))
    served = time.time()
    assert out.outputs, "the request was not served"
    print(json.dumps({"started": started, "imported": imported, "load_start": load_start, "load_end": load_end,
                      "served": served, "touch_s": touch_s, "source_s": loaded.source_s, "device_copy_s": loaded.device_copy_s,
                      "device_bytes": loaded.device_bytes, "host_copy_bytes": loaded.host_copy_bytes,
                      "host_attached_bytes": loaded.host_attached_bytes, "parameters": loaded.parameters}))
    w.shutdown()


def touch(worker) -> float:  # type: ignore[no-untyped-def]
    """Seconds to read one element of every page of every weight: on a CPU, a memory-mapped
    checkpoint's tensors (``direct``) are the file's pages, read from disk at their first touch,
    which would otherwise land in the first request; a device copy's are resident already."""
    import mmap

    import torch

    start = time.perf_counter()
    with torch.no_grad():
        for comp in worker.engine.pipe.components.values():
            if not isinstance(comp, torch.nn.Module):
                continue
            for t in [*comp.parameters(), *comp.buffers()]:
                flat = t.detach().reshape(-1)
                if flat.numel():
                    flat[:: max(1, mmap.PAGESIZE // t.element_size())].float().sum()
    return time.perf_counter() - start


def start(mode: str, weights: Path, files: list[Path], shm: Path, holder: dict) -> dict:  # type: ignore[type-arg]
    """One replica start in a fresh process; ``direct`` and ``cold`` from a dropped page cache."""
    if mode in ("direct", "cold"):
        for p in shm.glob("xema-*"):
            p.unlink()
    drop_page_cache(files)  # warm too: it must not need the checkpoint's pages
    cached = cached_fraction(files)
    env = {**os.environ, "XEMA_SHM_DIR": str(shm), "PYTHONHASHSEED": "0"}
    arg = json.dumps({"weights": str(weights), "host_copy": mode != "direct", "holder": holder})
    spawned = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", arg], capture_output=True, text=True, env=env,
                          check=False, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} start failed:\n{proc.stderr[-4000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    weight_s = r["source_s"] + r["device_copy_s"] + r["touch_s"]
    return {"mode": mode, "checkpoint_cached_before": round(cached, 3),
            "process_start_s": r["started"] - spawned, "imports_s": r["imported"] - r["started"],
            "weight_phase_s": weight_s, "checkpoint_to_host_s": r["source_s"], "host_to_device_s": r["device_copy_s"],
            "first_touch_s": r["touch_s"],
            "load_other_s": (r["load_end"] - r["load_start"]) - r["source_s"] - r["device_copy_s"],
            "first_request_s": r["served"] - r["load_end"] - r["touch_s"], "to_first_served_s": r["served"] - spawned,
            "device_bytes": r["device_bytes"], "host_copy_bytes": r["host_copy_bytes"],
            "host_attached_bytes": r["host_attached_bytes"], "parameters": r["parameters"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=2, help="rounds of direct, cold, warm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoint is written (a disk, not tmpfs)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    from xema_ray.platforms.host_memory import SegmentHolder

    root = Path(tempfile.mkdtemp(prefix="xema-warm-", dir=a.dir))
    shm = Path(tempfile.mkdtemp(prefix="xema-warm-shm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    holder = SegmentHolder.this_process().model_dump()  # this process keeps the host copy between starts
    try:
        t0 = time.time()
        weights = write_model(root, a.seed)
        files = checkpoint_files(weights)
        size = sum(f.stat().st_size for f in files)
        print(f"checkpoint: {size / 1e9:.2f} GB in {len(files)} files, written in {time.time() - t0:.0f} s", flush=True)
        runs = []
        for i in range(a.repeats):
            for mode in ("direct", "cold", "warm"):
                r = start(mode, weights, files, shm, holder)
                runs.append(r)
                print(f"[{i}] {mode:6s} process {r['process_start_s']:.2f} s  imports {r['imports_s']:.2f} s  "
                      f"weights {r['weight_phase_s']:.2f} s (ckpt->host {r['checkpoint_to_host_s']:.2f}, "
                      f"host->device {r['host_to_device_s']:.2f}, first touch {r['first_touch_s']:.2f})  rest of load {r['load_other_s']:.2f} s  "
                      f"1st request {r['first_request_s']:.2f} s  => first served {r['to_first_served_s']:.2f} s  "
                      f"(page cache before: {r['checkpoint_cached_before']:.0%})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    keys = ("process_start_s", "imports_s", "weight_phase_s", "checkpoint_to_host_s", "host_to_device_s",
            "first_touch_s", "load_other_s", "first_request_s", "to_first_served_s")
    summary = {m: {k: round(med(m, k), 3) for k in keys} for m in ("direct", "cold", "warm")}
    ratios = {"weight_phase_cold_over_warm": med("cold", "weight_phase_s") / med("warm", "weight_phase_s"),
              "weight_phase_direct_over_warm": med("direct", "weight_phase_s") / med("warm", "weight_phase_s"),
              "first_served_cold_over_warm": med("cold", "to_first_served_s") / med("warm", "to_first_served_s"),
              "first_served_direct_over_warm": med("direct", "to_first_served_s") / med("warm", "to_first_served_s")}
    result = {"machine": f"{os.cpu_count()}-core CPU VM ({platform.machine()})", "checkpoint_bytes": size,
              "parameters": runs[0]["parameters"], "repeats": a.repeats, "median": summary,
              "ratios": {k: round(v, 2) for k, v in ratios.items()}, "runs": runs,
              "date": time.strftime("%Y-%m-%d", time.gmtime())}
    print(json.dumps({"median": summary, "ratios": result["ratios"]}, indent=1))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
