"""Mitigation benchmark (issue #4): the least mitigation that fits a memory budget, found by the
analyzer tracing real-size pipelines (meta device, bf16, no weights) with mitigations applied.

1. Flux.2-dev 1024^2 (paper §5.1, Figure 4): the minimal K of evenly spread offloaded DiT
   blocks that fits, for 48 GiB (the A6000's 48 "GB", as the paper counts: its "60.2 GB" of
   Flux.2 weights are GiB) and for 48 * 10^9 bytes; predicted peak before and after, and K = 56
   (layerwise offload) for reference.
2. CogVideoX-5B (paper Figure 11): 49 frames at 720p, 1080p, 2K, 4K and 1080p at 49, 129, 209,
   289 frames, each with the least mitigation that fits the budget: on the VAE side (cheapest
   first) conv-cache offload, then per-unit VAE bands 2..64, then a VAE chain from the last
   upsampler through conv_out in 2..64 bands, then a chain from up_blocks.2; on the DiT side
   DiT chunking 2..16, then CFG serialization + chunking. The two sides act on different
   phases, so each side's least option is searched separately (per mode: its strongest
   option says whether it can fit, a bisection finds its least intensity).

Steps: every template is traced with 3 denoising steps (``--steps``): the peak lies in one
step or in the VAE decode, and every step allocates the same pattern, so more steps change
neither the peak nor the choice, only the analysis time.

Writes ``--out`` (JSON) and a PNG next to it, prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from xema_ray.memory.analysis import event_phases, phase_peaks
from xema_ray.analyzer.run import default_dtype_for, trace_template
from xema_ray.memory.trace import MemoryTrace
from planner.estimates import estimate_saving, evenly_spread
from xema_ray.analyzer.mitigated import trace_with_mitigations
from xema_ray.mitigation.hooks import resolve_module
from xema_ray.models import BuildOptions
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import Phase, phase_of_trace

GIB = 2**30


def group_peaks(trace: MemoryTrace) -> dict[Phase, int]:
    out: dict[Phase, int] = {}
    for p in phase_peaks(trace):
        g = phase_of_trace(p.phase)
        out[g] = max(out.get(g, 0), p.peak_bytes)
    return out


# ---------------------------------------------------------------------------- Flux.2
def flux_minimal_k(steps: int, budgets: dict[str, int]) -> list[dict]:
    t = RequestTemplate(model="flux2", height=1024, width=1024, steps=steps)
    base = trace_template(t)
    before = group_peaks(base)
    n = t.spec.num_dit_blocks
    cache: dict[int, int] = {}

    def traced(k: int) -> int:
        if k not in cache:
            m = [Mitigation(kind="block_offload", blocks=evenly_spread(k, n), intensity=k)] if k else []
            cache[k] = trace_with_mitigations(t, m).peak() if k else base.peak()
        return cache[k]

    def predicted(k: int) -> int:
        if k == 0:
            return base.peak()
        s = estimate_saving(Mitigation(kind="block_offload", blocks=evenly_spread(k, n), intensity=k), t)
        return max(v - s.at(g) for g, v in before.items())

    rows = []
    for name, budget in budgets.items():
        # the analytic estimate proposes, the trace decides: walk from the estimate to the
        # smallest K whose traced peak fits and whose K-1 does not
        k = next((k for k in range(n + 1) if predicted(k) <= budget), n)
        while k < n and traced(k) > budget:
            k += 1
        while k > 0 and traced(k - 1) <= budget:
            k -= 1
        rows.append({
            "budget": name, "budget_bytes": budget, "blocks": n, "min_k": k, "estimated_k_peak": predicted(k),
            "peak_before": base.peak(), "peak_after": traced(k), "peak_k_minus_1": traced(k - 1) if k else None,
            "peak_layerwise": traced(n), "offloaded_blocks": list(evenly_spread(k, n)),
        })
    return rows


# ---------------------------------------------------------------------------- CogVideoX-5B
@contextlib.contextmanager
def unsplit_safe_conv() -> Iterator[None]:
    """Baseline only: diffusers' ``CogVideoXSafeConv3d`` splits large inputs along time into
    pieces too short for its kernel and fails from 1080p up (on a GPU as well); the baseline
    column therefore runs the plain convolution it stands for (same output, same allocations
    as an unsplit cuDNN call)."""
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXSafeConv3d
    from torch import nn

    original = CogVideoXSafeConv3d.forward
    CogVideoXSafeConv3d.forward = nn.Conv3d.forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        CogVideoXSafeConv3d.forward = original  # type: ignore[method-assign]


CHUNKS = (2, 4, 8, 16, 32, 64)
OFFLOAD = Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=1000)
Plan = list[Mitigation]


def vae_modes(t: RequestTemplate) -> list[list[Plan]]:
    """VAE options as modes, cheapest mode first; within a mode, more bands save more memory
    and cost more (halos, smaller kernels). Modes: nothing; conv-cache offload; + each unit
    of the top up-blocks in bands; + the top up-blocks' lower units in bands and a *chain*
    from the last upsampler through conv_out (its group norms cost one recompute pass each:
    9 passes); + a chain from up_blocks.2 (17 passes)."""
    lower = ["vae.decoder.up_blocks.2"]
    if t.height * t.width > 1920 * 1088:
        lower.append("vae.decoder.up_blocks.1")
    shapes = [
        ["vae.decoder.up_blocks.3", *lower, "vae.decoder.norm_out", "vae.decoder.conv_out"],
        [*lower, "vae.decoder[up_blocks.2.upsamplers.0:]"],
        [*lower[1:], "vae.decoder[up_blocks.2:]"],
    ]
    modes: list[list[Plan]] = [[[]], [[OFFLOAD]]]
    for mods in shapes:
        modes.append([[OFFLOAD, Mitigation(kind="vae_chunking", modules=tuple(mods), intensity=c)] for c in CHUNKS])
    return modes


def dit_modes(t: RequestTemplate) -> list[list[Plan]]:
    n = t.spec.num_dit_blocks
    serial = Mitigation(kind="temporary_serialization", modules=("transformer",), intensity=2)
    return [
        [[]],
        [[Mitigation(kind="dit_chunking", blocks=tuple(range(n)), intensity=c)] for c in (2, 4, 8, 16)],
        [[serial, Mitigation(kind="dit_chunking", blocks=tuple(range(n)), intensity=c)] for c in (4, 8, 16)],
    ]


def least(modes: list[list[Plan]], fits) -> Plan:  # type: ignore[no-untyped-def]
    """The first option, in order, that fits: per mode, its strongest option decides whether
    the mode can fit at all, then a bisection finds its least intensity that fits (memory falls
    with intensity within a mode). Nothing fits: the strongest option of the last mode."""
    for mode in modes:
        if not fits(mode[-1]):
            continue
        lo, hi = 0, len(mode) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mode[mid]):
                hi = mid
            else:
                lo = mid + 1
        return mode[hi]
    return modes[-1][-1]


def describe(plan: Plan) -> str:
    out = []
    for m in plan:
        if m.kind == "vae_chunking":
            chains = [p for p in m.modules or () if "[" in p]
            units = [p.removeprefix("vae.decoder.").replace("up_blocks.", "up") for p in m.modules or () if "[" not in p]
            parts = ([f"units of {','.join(units)}"] if units else []) + [f"chain {c.removeprefix('vae.decoder')}" for c in chains]
            where = " + ".join(parts)
            out.append(f"vae_chunking×{m.intensity} ({where})")
        else:
            out.append(f"{m.kind}×{m.intensity}")
    return " + ".join(out) or "none"


@functools.cache
def _meta_pipe(model: str) -> Any:
    spec = RequestTemplate(model=model, height=64, width=64).spec
    return spec.build_pipeline(BuildOptions(device="meta", dtype=default_dtype_for(spec)))


def vae_conv_flops(trace: MemoryTrace, model: str) -> float:
    """FLOPs of the decode's convolutions, read off the trace: each convolution output (its
    bytes, its module) times 2 x in-channels / groups x kernel volume. What chunking costs in
    compute (recomputed statistics passes, halos) shows up here; time splits do not."""
    ph = event_phases(trace)[trace.begin]
    vae = np.isin(ph, [i for i, n in enumerate(trace.phases) if phase_of_trace(n) == Phase.DECODE])
    conv = np.array([o == "convolution" for o in trace.ops] + [False])[trace.op]
    pipe = _meta_pipe(model)
    per_elem: dict[int, float] = {}
    total = 0.0
    for i in np.flatnonzero(vae & conv & (trace.module >= 0)):
        mi = int(trace.module[i])
        if mi not in per_elem:
            m = resolve_module(pipe, trace.modules[mi])
            if not isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                raise ValueError(f"a convolution output attributed to {trace.modules[mi]}, not a convolution module")
            per_elem[mi] = 2.0 * m.in_channels / m.groups * math.prod(m.kernel_size) / m.weight.element_size()
        total += trace.nbytes[i] * per_elem[mi]
    return total


def cogvideox_point(t: RequestTemplate, budget: int) -> dict:
    t0 = time.perf_counter()
    with unsplit_safe_conv():
        base = trace_template(t)
    before = group_peaks(base)
    cache: dict[tuple[str, bool], dict | None] = {}
    failed: list[str] = []

    def traced(plan: Plan, unsplit: bool = False) -> dict | None:
        """Group peaks and conv bytes of ``plan``; None where the plan fails to run (a decoder
        piece still above diffusers' 2 GiB SafeConv3d threshold splits along time and fails,
        on a GPU too). ``unsplit`` traces with the plain convolution (DiT probes)."""
        if not plan:
            return {"peaks": before, "conv": vae_conv_flops(base, t.model)}
        key = (json.dumps([m.model_dump(exclude_none=True) for m in plan]), unsplit)
        if key not in cache:
            try:
                with unsplit_safe_conv() if unsplit else contextlib.nullcontext():
                    tr = trace_with_mitigations(t, plan)
                cache[key] = {"peaks": group_peaks(tr), "conv": vae_conv_flops(tr, t.model)}
            except RuntimeError as e:
                failed.append(f"{describe(plan)}: {str(e)[:80]}")
                cache[key] = None
        return cache[key]

    def fits(plan: Plan, group: Phase, unsplit: bool = False) -> bool:
        r = traced(plan, unsplit)
        return r is not None and r["peaks"].get(group, 0) <= budget

    # the DiT and the VAE options act on different phases: find each side's least option
    # (DiT probes with the decoder unmitigated and unsplit), then the VAE's with that DiT plan
    dit = least(dit_modes(t), lambda d: fits(d, Phase.DENOISE, unsplit=True))
    vae = least(vae_modes(t), lambda v: fits(v + dit, Phase.DECODE))
    plan = vae + dit
    final = traced(plan) or {"peaks": {}, "conv": 0}
    after = final["peaks"]
    estimate = before.get(Phase.DECODE, 0) - sum(estimate_saving(m, t, baseline=base).at(Phase.DECODE) for m in vae)
    return {
        "template": t.key, "budget_bytes": budget,
        "before": before, "after": after, "peak_before": max(before.values()),
        "peak_after": max(after.values()) if after else None,
        "fits": bool(after) and max(after.values()) <= budget,
        "mitigations": [m.model_dump(exclude_none=True) for m in plan],
        "describe": describe(plan), "vae_estimate": estimate,
        "vae_conv_flops": final["conv"], "vae_conv_flops_before": vae_conv_flops(base, t.model),
        "traces": 1 + len(cache), "seconds": time.perf_counter() - t0, "failed_plans": failed,
    }


RESOLUTIONS = {"720p": (720, 1280), "1080p": (1088, 1920), "2K": (1440, 2560), "4K": (2160, 3840)}


def cogvideox_sweeps(steps: int, budget: int, only: list[str] | None) -> list[dict]:
    points = [(f"{r}x49f", *RESOLUTIONS[r], 49) for r in RESOLUTIONS]
    points += [(f"1080px{f}f", 1088, 1920, f) for f in (129, 209, 289)]
    rows = []
    for name, h, w, f in points:
        if only and name not in only:
            continue
        t = RequestTemplate(model="cogvideox-5b", height=h, width=w, frames=f, steps=steps)
        row = cogvideox_point(t, budget)
        row["point"] = name
        rows.append(row)
        print(f"{name}: {row['peak_before'] / 1e9:.1f} -> {(row['peak_after'] or 0) / 1e9:.1f} GB with {row['describe']} "
              f"({row['traces']} traces, {row['seconds']:.0f} s)", flush=True)
    return rows


def plot(flux: list[dict], cog: list[dict], budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    res = [r for r in cog if r["point"].endswith("x49f")]
    frames = [r for r in cog if r["point"].startswith("1080p")]
    for ax, rows, title in ((axes[0], res, "CogVideoX-5B, 49 frames"), (axes[1], frames, "CogVideoX-5B, 1080p")):
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["peak_before"] / 1e9 for r in rows], 0.4, label="no mitigation")
        ax.bar([i + 0.2 for i in x], [(r["peak_after"] or 0) / 1e9 for r in rows], 0.4, label="least mitigation")
        ax.axhline(budget / 1e9, color="k", ls="--", lw=1, label=f"budget {budget / 1e9:.0f} GB")
        ax.set_xticks(list(x), [r["point"] for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("predicted peak (GB)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/mitigation.json"))
    ap.add_argument("--budget", type=float, default=48e9, help="CogVideoX budget in bytes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="CogVideoX points to run (e.g. 720px49f)")
    ap.add_argument("--skip-flux", action="store_true")
    args = ap.parse_args()
    budget = int(args.budget)
    flux = [] if args.skip_flux else flux_minimal_k(args.steps, {"48 GiB": 48 * GIB, "48 GB": 48 * 10**9})
    cog = cogvideox_sweeps(args.steps, budget, args.only)
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "steps": args.steps, "flux2": flux, "cogvideox": cog}, indent=1))
    if cog:
        plot(flux, cog, budget, args.out.with_suffix(".png"))
    print(f"\nmachine: {machine}; {args.steps} steps traced; GB = 10^9 B\n")
    if flux:
        print("| Flux.2 1024² budget | blocks | min K | peak before GB | peak with K GB | peak with K-1 GB | peak K=56 GB |")
        print("|---|---|---|---|---|---|---|")
        for r in flux:
            km1 = f"{r['peak_k_minus_1'] / 1e9:.2f}" if r["peak_k_minus_1"] is not None else "-"
            print(f"| {r['budget']} | {r['blocks']} | {r['min_k']} | {r['peak_before'] / 1e9:.2f} | {r['peak_after'] / 1e9:.2f} | "
                  f"{km1} | {r['peak_layerwise'] / 1e9:.2f} |")
        print()
    if cog:
        print("| CogVideoX-5B | DiT peak before GB | VAE peak before GB | DiT after GB | VAE after GB | fits | least mitigation "
              "| VAE est. GB | VAE conv FLOPs × | traces | analysis s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in cog:
            b, a = r["before"], r["after"]
            print(f"| {r['point']} | {b.get('denoise', 0) / 1e9:.1f} | {b.get('decode', 0) / 1e9:.1f} | {a.get('denoise', 0) / 1e9:.1f} | "
                  f"{a.get('decode', 0) / 1e9:.1f} | {'yes' if r['fits'] else 'NO'} | {r['describe']} | "
                  f"{r['vae_estimate'] / 1e9:.1f} | {r['vae_conv_flops'] / r['vae_conv_flops_before']:.2f} | {r['traces']} | "
                  f"{r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
