"""CPU seconds of single meta-device traces at real size, as the planner makes them (issue #16
item 3): plain batch traces and mitigated "confirmation" traces, each pipeline built once
beforehand (not timed), every trace's hash and columns saved so two checkouts can be compared.

    python bench/bench_trace_speed.py --out /tmp/new            # this checkout
    <other checkout>/.venv/bin/python bench/bench_trace_speed.py --out /tmp/ref   # another one
    python bench/bench_trace_speed.py --compare /tmp/ref /tmp/new --json bench/results/trace-speed.json

Run it from outside the repository (or with the other checkout's interpreter) to time that
checkout's code: it imports ``xema_ray`` and ``planner`` from the interpreter's environment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from planner.traces import PLANNER_TRACE
from xema_ray.analyzer.run import default_dtype_for, trace_template
from xema_ray.memory.trace import MemoryTrace
from xema_ray.analyzer.mitigated import trace_with_mitigations
from xema_ray.models import BuildOptions
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate

LTX2 = RequestTemplate(model="ltx2", width=1920, height=1088, frames=81, steps=50)
COG = RequestTemplate(model="cogvideox-5b", width=1920, height=1088, frames=81, steps=50)
FLUX = RequestTemplate(model="flux2", width=1024, height=1024, steps=50)


def _spread(k: int, n: int) -> tuple[int, ...]:
    return tuple(int(round(i * (n - 1) / (k - 1))) for i in range(k))


# name -> (template, mitigations or None for a plain trace)
CASES: dict[str, tuple[RequestTemplate, list[Mitigation] | None]] = {
    "ltx2-1080p81": (LTX2, None),
    "cogvideox-1080p81": (COG, None),
    "flux2-1024": (FLUX, None),
    "ltx2-1080p81-confirm": (LTX2, [
        Mitigation(kind="temporary_serialization", modules=("transformer",), intensity=2),
        Mitigation(kind="block_offload", blocks=_spread(17, 48), intensity=17),
    ]),
    "cogvideox-1080p81-confirm": (COG, [
        Mitigation(kind="dit_chunking", blocks=_spread(10, 42), intensity=4),
        Mitigation(kind="hsdp", blocks=_spread(8, 42), intensity=8),
        Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=8),
    ]),
    "ltx2-1080p81-after": (LTX2, None),  # the same pipeline again, after the mitigations were removed
}


def _save(trace: MemoryTrace, path: Path) -> None:
    cols = {k: v for k, v in vars(trace).items() if isinstance(v, np.ndarray)}
    tables = {k: v for k, v in vars(trace).items() if isinstance(v, list)}
    np.savez(path.with_suffix(".npz"), n_events=np.int64(trace.n_events), **cols)
    path.with_suffix(".json").write_text(json.dumps({"tables": tables, "meta": trace.meta}))


def run(out: Path, names: list[str], repeat: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pipes = {}
    for name in names:
        t = CASES[name][0]
        if t.model not in pipes:
            pipes[t.model] = t.spec.build_pipeline(BuildOptions(device="meta", dtype=default_dtype_for(t.spec)))
    results = {}
    for name in names:
        t, mits = CASES[name]
        times = []
        for _ in range(repeat):
            t0 = time.process_time()
            if mits is None:
                trace = trace_template(t, PLANNER_TRACE, pipeline=pipes[t.model])
            else:
                trace = trace_with_mitigations(t, mits, options=PLANNER_TRACE, world_size=2, pipeline=pipes[t.model])
            times.append(time.process_time() - t0)
        cpu = min(times)  # the least disturbed run on a shared machine
        _save(trace, out / name)
        results[name] = {"cpu_s": round(cpu, 2), "trace_hash": trace.meta["trace_hash"],
                         "block_replay": trace.meta.get("block_replay"), "events": trace.n_events}
        print(f"{name:28s} {cpu:7.2f} CPU s  hash {trace.meta['trace_hash']}  replay {trace.meta.get('block_replay')}",
              flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


def compare(a: Path, b: Path, out: Path | None) -> int:
    bad = 0
    table = {}
    ra, rb = json.loads((a / "results.json").read_text()), json.loads((b / "results.json").read_text())
    for name in ra:
        if name not in rb:
            continue
        za, zb = np.load(a / f"{name}.npz"), np.load(b / f"{name}.npz")
        ta = json.loads((a / f"{name}.json").read_text())["tables"]
        tb = json.loads((b / f"{name}.json").read_text())["tables"]
        same = set(za.files) == set(zb.files) and all(np.array_equal(za[k], zb[k]) for k in za.files) and ta == tb
        same = same and ra[name]["trace_hash"] == rb[name]["trace_hash"]
        bad += not same
        table[name] = {"ref_cpu_s": ra[name]["cpu_s"], "new_cpu_s": rb[name]["cpu_s"], "equal": same,
                       "trace_hash": rb[name]["trace_hash"], "ref_block_replay": ra[name]["block_replay"],
                       "new_block_replay": rb[name]["block_replay"]}
        print(f"{name:28s} {'equal' if same else 'DIFFERENT'}  {ra[name]['cpu_s']:7.2f} -> {rb[name]['cpu_s']:7.2f} CPU s")
    if out is not None:
        out.write_text(json.dumps(table, indent=1) + "\n")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--repeat", type=int, default=2, help="trace each case this many times, report the least CPU")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("REF", "NEW"),
                    help="compare two --out folders: columns, string tables and hashes equal; CPU s side by side")
    ap.add_argument("--json", type=Path, default=None, help="with --compare: write the comparison here")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare, args.json)
    if args.out is None:
        ap.error("give --out or --compare")
    run(args.out, args.cases, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
