"""One GPU process of the armed-worker check (tests/gpu/test_allocator_gpu.py): the serving
``Worker`` runs one plan entry under one allocator and writes a JSON report. Each allocator needs
its own process: the pluggable allocator is process-wide and chosen before CUDA initialises.

* ``--mode default``: PyTorch's caching allocator. A warm-up batch, a measured batch, then a batch
  under ``torch.cuda.memory._record_memory_history``: its allocation stream is written to
  ``--events`` (what ``xema_ray.allocator.device_allocs.compare`` aligns with the meta trace).
* ``--mode static``: ``Worker(static_allocator=True)`` installs libxema_alloc in its constructor,
  reserves and warms up at load, arms the entry's layout (``--layouts``) per batch; a warm-up
  batch, then the measured one.

Usage:
    python tests/gpu/allocator_gpu_run.py --mode default --config cfg.json --out r.json --events ev.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

CAP_BYTES = 48 * 10**9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["default", "static"], required=True)
    ap.add_argument("--config", type=Path, required=True, help="ExecutionConfig JSON")
    ap.add_argument("--layouts", type=Path, default=None, help="the layouts folder (static mode)")
    ap.add_argument("--events", type=Path, default=None, help="where to write the recorded stream (default mode)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from xema_ray.parallel.groups import ParallelConfig
    from xema_ray.plan import ExecutionConfig
    from xema_ray.runtime.engine import Batch, GenerationRequest
    from xema_ray.runtime.worker import ModelLoadConfig, Worker

    config = ExecutionConfig.model_validate_json(args.config.read_text())
    # the constructor installs the allocator before anything here touches CUDA
    worker = Worker(platform="cuda", static_allocator=args.mode == "static")
    import torch

    report: dict[str, Any] = {"mode": args.mode, "template": config.template.shape_key, "plan": config.describe(),
                              "torch": torch.__version__}
    total = torch.cuda.get_device_properties(0).total_memory
    try:  # the caching allocator's cap; a pluggable allocator may not implement it
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total))
        report["cap"] = ("torch.cuda.set_per_process_memory_fraction" if args.mode == "default" else
                         "set_per_process_memory_fraction accepted (a pluggable allocator may ignore it); "
                         "checked from the allocator's peak_reserved_bytes")
    except RuntimeError as e:
        report["cap"] = f"not enforced by torch ({e}); checked from the allocator's peak"
    report["device"] = torch.cuda.get_device_name(0)
    worker.init_device(ParallelConfig(rank=0, world_size=1))
    t0 = time.perf_counter()
    loaded = worker.load_model(ModelLoadConfig(model=config.template.model, plans=(config,), text_encoder="none",
                                               layouts_dir=args.layouts))
    report["load_s"] = time.perf_counter() - t0
    report["loaded_device_bytes"] = loaded.device_bytes
    report["layout_status"] = loaded.layout_status
    batch = Batch(config=config, requests=tuple(GenerationRequest(request_id=f"g{i}", prompt="a red fox", seed=i)
                                                for i in range(config.batch)), steps=config.template.steps)

    def run() -> tuple[Any, float]:
        torch.cuda.synchronize()
        result = worker.execute(batch)
        torch.cuda.synchronize()
        return result, result.timings.denoise_s / config.template.steps

    run()  # warm-up: lazy inits, kernels, cuBLAS workspaces on other handles
    alloc = worker.allocator
    before = alloc.stats() if alloc is not None else None
    if alloc is not None:
        alloc.reset_peaks()
    else:
        torch.cuda.reset_peak_memory_stats()
    before_active = before.active_bytes if before is not None else torch.cuda.memory_allocated()
    result, step_s = run()
    report["step_s"] = step_s
    report["output_sha256"] = [hashlib.sha256(o.data).hexdigest() for o in result.outputs]
    report["layout_armed"] = result.layout_armed
    report["layout_hits"] = result.layout_hits
    report["layout_misses"] = result.layout_misses
    report["active_before_bytes"] = before_active
    if alloc is not None:
        stats = alloc.stats()
        report.update(peak_active_bytes=stats.peak_active_bytes, peak_reserved_bytes=stats.peak_reserved_bytes,
                      static_region_bytes=stats.static_region_bytes, dynamic_region_bytes=stats.dynamic_region_bytes,
                      stats=stats.model_dump())
    else:
        report.update(peak_active_bytes=torch.cuda.max_memory_allocated(), peak_reserved_bytes=torch.cuda.max_memory_reserved())
        if args.events is not None:
            from xema_ray.allocator.device_allocs import events_from_snapshot

            # context=None: no tracebacks (fast); the sizes, streams and order are all compare() needs
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10**7)
            run()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            events = events_from_snapshot(snapshot, device=0)
            args.events.write_text(json.dumps([e.model_dump() for e in events]))
            report["recorded_events"] = len(events)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "stats"}))


if __name__ == "__main__":
    main()
