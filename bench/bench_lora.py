"""Per-sample LoRA: throughput on the tiny models on this CPU, and the cost model's figure for the
real models at rank 16 and 64.

measured (same run, same process, interleaved rounds, median): the serving engine on tiny-flux2
(and tiny-cogvideox, whose CFG doubles the DiT rows), with the pool's hooks installed:

- ``mixed``: one batch of 4 requests, each with its own adapter (4 different ones);
- ``plain``: the same 4 requests in one batch without adapters;
- ``singles``: the same 4 requests with their adapters as 4 batches of one (what a server that
  keeps one LoRA state per batch falls back to).

cost model (meta-built real transformers, shapes only): per model, a 4-slot pool's device bytes
at rank 16 / 64, one adapter's bytes, and the deltas' seconds per denoising step on the H200 and
A6000 profiles at the reference template's rows and tokens (``xema_ray.profiling.lora_cost``:
roofline per layer), beside the cost model's own step time for that template.

Example:
    PYTHONPATH=. python bench/bench_lora.py --out bench/results/lora.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from xema_ray.lora import AdapterPool, AdapterSource, LoraUse, MultiLoraConfig, apply_multi_lora, read_adapter
from xema_ray.lora.memory import lora_cost
from xema_ray.lora.pool import adapted_components
from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import ExecutionConfig, LoraPoolConfig
from xema_ray.profiling.costmodel import cost_model_estimate
from xema_ray.profiling.hardware import get_hardware
from xema_ray.profiling.lora_cost import lora_step_cost
from xema_ray.runtime.engine import ExecutionEngine
from xema_ray.templates import RequestTemplate

TINY = {"tiny-flux2": RequestTemplate(model="tiny-flux2", width=64, height=64, steps=4),
        "tiny-cogvideox": RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=4)}
REAL = {"flux2": RequestTemplate(model="flux2", width=1024, height=1024, steps=50),
        "cogvideox-5b": RequestTemplate(model="cogvideox-5b", width=720, height=480, frames=49, steps=50),
        "ltx2": RequestTemplate(model="ltx2", width=1280, height=704, frames=121, steps=40),
        "wan2.2-t2v-a14b": RequestTemplate(model="wan2.2-t2v-a14b", width=1280, height=720, frames=81, steps=40)}


def throughput(model: str, rounds: int, rank: int) -> dict[str, Any]:
    spec = get_model_spec(model)
    t = TINY[model]
    pipe = spec.build_pipeline(BuildOptions())
    comps = adapted_components(pipe)
    pool = AdapterPool(LoraPoolConfig(slots=4, max_rank=rank), comps, torch.device("cpu"), torch.float32)
    with tempfile.TemporaryDirectory() as d:
        for i in range(4):
            f = write_adapter(Path(d) / f"a{i}.safetensors", pipe.transformer, rank=rank, seed=i)
            pool.add(read_adapter(AdapterSource(name=f"a{i}", model=model, path=f), type(pipe), comps, rank))
    handle = apply_multi_lora(pool, MultiLoraConfig())
    engine = ExecutionEngine(pipe, spec, torch.device("cpu"), torch.float32)
    engine.adapters = pool
    prompts, seeds = [f"prompt {i}" for i in range(4)], [1, 2, 3, 4]
    uses = [(LoraUse(name=f"a{i}"),) for i in range(4)]

    def run(ps: list[str], ss: list[int], ad: list[tuple[LoraUse, ...]] | None) -> float:
        t0 = time.perf_counter()
        engine.run_pipeline(ExecutionConfig(template=t, batch=len(ps)), ps, ss, steps=t.steps, adapters=ad)
        return time.perf_counter() - t0

    cases = {
        "mixed": lambda: run(prompts, seeds, uses),
        "plain": lambda: run(prompts, seeds, None),
        "singles": lambda: sum(run([p], [s], [u]) for p, s, u in zip(prompts, seeds, uses, strict=True)),
    }
    for fn in cases.values():  # warm-up: first calls build kernels and caches
        fn()
    secs: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            secs[k].append(fn())
    handle.remove()
    med = {k: statistics.median(v) for k, v in secs.items()}
    return {"model": model, "template": t.key, "rank": rank, "rounds": rounds,
            "seconds_median": med, "requests_per_s": {k: 4 / v for k, v in med.items()},
            "mixed_vs_plain": med["plain"] / med["mixed"], "mixed_vs_singles": med["singles"] / med["mixed"]}


def cost_model(model: str) -> list[dict[str, Any]]:
    spec = get_model_spec(model)
    t = REAL[model]
    pipe = spec.build_pipeline(BuildOptions(device="meta", dtype=torch.bfloat16))
    dit = pipe.transformer
    rows = spec.dit_batch_multiplier()
    tokens = sum(spec.token_counts(t).values())
    out = []
    for rank in (16, 64):
        c = lora_cost(model, dit, rank, slots=4, rows=rows, transformer_2=getattr(pipe, "transformer_2", None))
        row: dict[str, Any] = {"model": model, "template": t.key, "rank": rank, "targets": c.targets,
                               "pool4_bytes": c.pool_bytes, "adapter_bytes": c.adapter_bytes,
                               "linear_flop_ratio": c.flop_ratio, "rows": rows, "tokens": tokens}
        for hw_name in ("h200", "a6000x8"):
            hw = get_hardware(hw_name)
            s = lora_step_cost(dit, hw, rows, tokens, rank)
            est = cost_model_estimate(ExecutionConfig(template=t), hw)
            step = est.per_step_s if est.per_step_s is not None else est.total_s / t.steps
            row[hw_name] = {"lora_step_s": s.seconds, "step_s": step, "ratio": s.seconds / step,
                            "bandwidth_bound_layers": s.bandwidth_bound}
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora.json"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    res = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
           "throughput": [throughput(m, args.rounds, args.rank) for m in TINY],
           "cost_model": [r for m in REAL for r in cost_model(m)]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    for r in res["throughput"]:
        print(f"{r['model']}: req/s mixed {r['requests_per_s']['mixed']:.2f}, plain {r['requests_per_s']['plain']:.2f}, "
              f"singles {r['requests_per_s']['singles']:.2f}; mixed/plain time {1 / r['mixed_vs_plain']:.2f}x, "
              f"singles/mixed time {r['mixed_vs_singles']:.2f}x")
    for r in res["cost_model"]:
        print(f"{r['model']} rank {r['rank']}: pool(4) {r['pool4_bytes'] / 1e9:.2f} GB, adapter {r['adapter_bytes'] / 1e9:.3f} GB, "
              f"H200 +{r['h200']['lora_step_s'] * 1e3:.1f} ms/step ({r['h200']['ratio']:.1%}), "
              f"A6000 +{r['a6000x8']['lora_step_s'] * 1e3:.1f} ms/step ({r['a6000x8']['ratio']:.1%})")


if __name__ == "__main__":
    main()
