"""Weight residency: per-batch bytes moved outside the denoising stream, before (weights loaded
whole, block offload moving its K blocks to the host when a batch starts and back when it ends)
and after (blocks homed on the host at load, hooks only armed per batch), for the Flux.2 1024²
plan on one 48 GB GPU; and the residency-switch cost between two templates of one group.

Counted by running the real code on the meta device (no weights): the bytes each path hands to
``HostCopy`` (device->host) and brings back in ``restore`` (host->device) around a batch.

Example:
    python bench/bench_residency.py --out bench/results/residency.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from xema_ray.mitigation import block_offload as bo
from xema_ray.mitigation import hooks
from xema_ray.mitigation.registry import apply_mitigations
from xema_ray.models import BuildOptions
from xema_ray.parallel.groups import ParallelConfig
from xema_ray.plan import PlanTable
from xema_ray.runtime.residency import Residency, block_sizes, switch_bytes
from xema_ray.runtime.worker import ModelLoadConfig, Worker

ROOT = Path(__file__).resolve().parents[1]


class Counter:
    """Bytes through the two places a batch's set-up and tear-down can move weights."""

    def __init__(self) -> None:
        self.d2h = 0
        self.h2d = 0
        self._init = hooks.HostCopy.__init__
        self._restore = bo._OffloadedBlock.restore

    def __enter__(self) -> Counter:
        counter = self

        def init(self_, t, *a, **k):  # type: ignore[no-untyped-def]
            counter._init(self_, t, *a, **k)
            homed = k.get("device") is not None and t.device.type != k["device"].type
            if not homed and not _is_placeholder(t):
                counter.d2h += t.numel() * t.element_size()

        def restore(self_):  # type: ignore[no-untyped-def]
            if not self_.homed_on_host:
                counter.h2d += self_.bytes
            counter._restore(self_)

        hooks.HostCopy.__init__ = init  # type: ignore[method-assign]
        bo._OffloadedBlock.restore = restore  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        hooks.HostCopy.__init__ = self._init  # type: ignore[method-assign]
        bo._OffloadedBlock.restore = self._restore  # type: ignore[method-assign]


def _is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and all(s == 0 for s in t.stride())


def per_batch_bytes(table: PlanTable, key: str) -> dict[str, object]:
    entry = table.entries[key]
    cfg = entry.config
    spec = cfg.template.spec
    weight_actions = tuple(m for m in cfg.mitigations if m.kind in ("block_offload", "hsdp"))
    # before: the model whole on the device, mitigations applied and removed around the batch
    pipe = spec.build_pipeline(BuildOptions(device="meta", dtype=torch.bfloat16))
    with Counter() as before:
        with apply_mitigations(pipe, spec, weight_actions):
            pass
    # after: the worker's load places the blocks; a batch arms and disarms hooks only
    w = Worker(platform="meta")
    w.init_device(ParallelConfig(rank=0, world_size=1))
    loaded = w.load_model(ModelLoadConfig(model=spec.name, plans=(cfg,)))
    assert w.engine is not None
    with Counter() as after:
        with apply_mitigations(w.engine.pipe, spec, weight_actions):
            pass
    sizes = block_sizes(spec)
    streamed = sum(sizes[i] for i in Residency.of_config(cfg).host_blocks)
    return {"template": key, "plan": cfg.describe(), "offloaded_blocks": len(Residency.of_config(cfg).host_blocks),
            "before": {"device_to_host_bytes": before.d2h, "host_to_device_bytes": before.h2d},
            "after": {"device_to_host_bytes": after.d2h, "host_to_device_bytes": after.h2d},
            "streamed_per_step_bytes": streamed, "host_bytes": loaded.host_bytes}


def switch_cost(table: PlanTable, a: str, b: str, h2d_gbps: float) -> dict[str, object]:
    ca, cb = table.entries[a].config, table.entries[b].config
    spec = ca.template.spec
    sizes = block_sizes(spec)
    ra, rb = Residency.of_config(ca), Residency.of_config(cb)
    moved = switch_bytes(sizes, ra, rb)
    full = sum(sizes[i] for i in (*ra.host_blocks, *rb.host_blocks))
    return {"from": a, "to": b, "from_blocks": len(ra.host_blocks), "to_blocks": len(rb.host_blocks),
            "bytes_moved": moved, "bytes_if_reloaded": full, "seconds_at_h2d": moved / (h2d_gbps * 1e9),
            "h2d_gbps": h2d_gbps}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "residency.json")
    p.add_argument("--table", type=Path, default=ROOT / "plans" / "flux2-1024-1gpu.json")
    p.add_argument("--group-table", type=Path, default=ROOT / "plans" / "a6000x8.json")
    args = p.parse_args()
    from planner.latency import LatencyModel

    h2d = LatencyModel("a6000").hardware.h2d_gbps
    t0 = time.perf_counter()
    result: dict[str, object] = {"machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs"}
    result["per_batch"] = per_batch_bytes(PlanTable.load(str(args.table)), "flux2/1024x1024x1")
    if args.group_table.exists():
        g = PlanTable.load(str(args.group_table))
        pairs = [("flux2/512x512x1", "flux2/1024x1024x1"), ("flux2/1024x1024x1", "flux2/2048x2048x1"),
                 ("ltx2/864x480x49", "ltx2/1280x704x49")]
        result["switches"] = [switch_cost(g, a, b, h2d) for a, b in pairs if a in g.entries and b in g.entries]
    result["seconds"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
