"""``xema`` command line: ``xema analyze`` (memory analysis of one template), ``xema plan``
(the offline planner, same as ``python -m planner plan``) and ``xema verify`` (the serving
worker's own load + execute of every plan entry, counted on the meta device).

Example:
    xema analyze --model cogvideox-5b --height 720 --width 1280 --frames 49 --budget 48GB \\
        --json trace.json --plot trace.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from pydantic import ValidationError

from xema_ray.memory.analysis import MemorySummary, gb, parse_bytes, summarize
from xema_ray.models import MODEL_NAMES
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import Phase, phase_of_trace


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="shape-only memory trace of one request template (no weights, no GPU)")
    p.add_argument("--model", required=True, choices=MODEL_NAMES)
    p.add_argument("--height", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--references", type=int, default=0,
                   help="reference images per request (Flux.2 edits; image-to-video: 1), traced through their "
                        "preprocessing, VAE encode and the longer sequence")
    p.add_argument("--reference-size", default=None, metavar="WxH",
                   help="size the references are encoded at (default: the output size)")
    p.add_argument("--budget", default=None, help="per-GPU budget, e.g. 48GB (10^9) or 44.7GiB")
    p.add_argument("--json", type=Path, default=None, help="write the trace and the summary as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG like the paper's Figures 2 and 13")
    p.add_argument("--text-encoder", choices=("device", "streamed", "cpu", "none"), default="device",
                   help="trace the model's text encoder in the text phase, placed so (default: on the device)")
    p.add_argument("--weights", choices=("bf16", "model", "fp8", "int8"), default="model",
                   help="the transformer's weight format: bf16/model (its own dtype; the tiny models' is fp32), fp8 "
                        "or int8 (its quantizable layers stored weight-only, torchao's tensors: docs/quality.md)")
    p.add_argument("--layout", action="store_true",
                   help="also solve the static layout and compare with a simulated caching allocator")
    p.add_argument("--device-allocs", type=Path, default=None,
                   help="a record of GPU-only allocations (make gpu-check: device-allocs-*.json): include its entry "
                        "for this trace (convolution workspaces etc.) in the peak and the layout")
    p.set_defaults(func=cmd_analyze)


def print_summary(s: MemorySummary, out: TextIO | None = None) -> None:
    w = (out or sys.stdout).write
    w(f"template            {s.template}\n")
    w(f"allocations         {s.n_allocations:,} ({s.n_events:,} events)\n")
    w(f"peak (active)       {gb(s.peak_bytes)} at event {s.peak_event:,} in {s.peak_phase}, {s.peak_module}\n")
    w(f"  weights           {gb(s.weight_bytes)}" + (" (" + ", ".join(f"{k} {gb(v)}" for k, v in s.weight_bytes_by_component.items()) + ")" if s.weight_bytes_by_component else "") + "\n")
    w(f"  inputs            {gb(s.input_bytes)}\n")
    w(f"  activations       {gb(s.activation_bytes_at_peak)}\n")
    groups: dict[str, int] = {}
    for p in s.phase_peaks:
        g = "denoise (max over steps)" if phase_of_trace(p.phase) is Phase.DENOISE else p.phase
        groups[g] = max(groups.get(g, 0), p.peak_bytes)
    for g, v in groups.items():
        w(f"  phase {g:<26}{gb(v)}\n")
    for i, e in enumerate(s.experts):
        w(f"{'experts' if i == 0 else '':<20}{e.component}: {gb(e.weight_bytes)}, steps {e.first_step}-{e.last_step} "
          f"(events {e.first_event:,}-{e.last_event:,})\n")
    if len(s.experts) > 1:
        w(f"expert switch       {s.experts[0].component} -> {s.experts[1].component} at step {s.experts[1].first_step} "
          f"(event {s.experts[1].first_event:,}); both experts' weights are on the device throughout\n")
    w(f"text peak           {gb(s.text_peak_bytes)} (before the first step; text encoding included when traced)\n")
    if s.dit_cdf:
        w("DiT events below   " + ", ".join(f"{k} of peak: {v:.0%}" for k, v in s.dit_cdf.items()) + "\n")
    if s.vae_cdf:
        w("VAE events below   " + ", ".join(f"{k} of peak: {v:.0%}" for k, v in s.vae_cdf.items()) + "\n")
    if s.budget_bytes is not None:
        n = len(s.pressure_intervals)
        w(f"budget              {gb(s.budget_bytes)}: {'fits' if n == 0 else f'{n} pressure interval(s), {s.pressure_event_fraction:.2%} of events'}\n")
        for iv in s.pressure_intervals[:12]:
            units = ", ".join(iv.units[:4]) + (" …" if len(iv.units) > 4 else "")
            w(f"  events {iv.start:>9,}–{iv.stop:<9,} +{gb(iv.excess_bytes):>10}  {'/'.join(iv.phases)}: {units} [{', '.join(iv.ops[:3])}]\n")
        if n > 12:
            w(f"  … {n - 12} more\n")


def cmd_analyze(args: argparse.Namespace) -> int:
    try:
        rw, rh = (int(x) for x in args.reference_size.lower().split("x")) if args.reference_size else (0, 0)
        template = RequestTemplate(model=args.model, height=args.height, width=args.width, frames=args.frames,
                                   steps=args.steps, batch=args.batch, references=args.references,
                                   reference_width=rw, reference_height=rh)
        budget = parse_bytes(args.budget) if args.budget is not None else None
    except (ValidationError, ValueError) as e:
        print(f"xema analyze: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    # the analysis needs torch (and builds the model with diffusers): imported here, not at start-up
    from xema_ray.analyzer.run import TraceOptions, trace_template
    from xema_ray.models.text_encoders import encoder_weight_bytes

    imports = time.perf_counter() - t0
    placement = None if args.text_encoder == "none" else args.text_encoder
    weights = "model" if args.weights == "bf16" else args.weights
    if weights != "model" and template.spec.weight_quant is None:
        print(f"xema analyze: --weights {weights}: {template.model}'s spec names no quantizable weights", file=sys.stderr)
        return 2
    trace = trace_template(template, TraceOptions(text_encoder=placement, weights=weights))
    elapsed = time.perf_counter() - t0
    if args.device_allocs is not None:
        from xema_ray.allocator.device_allocs import DeviceAllocMismatch, include, load_record, trace_key

        try:
            record = load_record(args.device_allocs)
            entry = record.entries.get(trace_key(trace))
            if entry is None:
                print(f"device allocs       {args.device_allocs}: no entry for this trace ({trace_key(trace)}): "
                      "not included (record it on the GPU for this template)")
            else:
                trace = include(trace, entry)[0]
                print(f"device allocs       {record.gpu}: +{len(entry.extra)} GPU-only ({gb(entry.extra_bytes)}), "
                      f"-{len(entry.absent)} meta-only allocations included")
        except (DeviceAllocMismatch, ValueError, OSError) as e:
            print(f"xema analyze: --device-allocs: {e}", file=sys.stderr)
            return 2
    enc = template.spec.text_encoder
    if enc is not None:
        import torch

        total, layers = encoder_weight_bytes(enc, torch.bfloat16 if template.spec.size == "real" else torch.float32)
        print(f"text encoder        {enc.config.get('_class')}: {gb(total)} of weights in {len(layers)} layers, "
              f"traced {'as ' + args.text_encoder if placement else 'not (stand-in embeddings)'}")
    summary = summarize(trace, budget)
    print_summary(summary)
    print(f"analysis time       {elapsed:.1f} s ({imports:.1f} s of it importing torch, the rest building the meta "
          "model and tracing)")
    result: dict[str, object] = {"summary": summary.model_dump(), "trace": trace.to_file().model_dump()}
    if args.layout:
        from xema_ray.allocator.caching_sim import simulate_caching_allocator
        from xema_ray.allocator.solver import solve_layout

        layout = solve_layout(trace)
        caching = simulate_caching_allocator(trace)
        lb = layout.lower_bound_bytes
        print(f"lower bound         {gb(lb)} (max live bytes)")
        print(f"static layout       {gb(layout.reserved_bytes)} ({layout.reserved_bytes / lb:.3f}x, solved in {layout.solve_seconds:.2f} s)")
        print(f"caching allocator   {gb(caching.reserved_peak_bytes)} ({caching.reserved_peak_bytes / lb:.3f}x, simulated)")
        result["layout"] = {"lower_bound_bytes": lb, "static_reserved_bytes": layout.reserved_bytes,
                            "caching_reserved_bytes": caching.reserved_peak_bytes, "solve_seconds": layout.solve_seconds}
        if args.plot:
            from xema_ray.allocator.plot import plot_address_time

            fig7 = args.plot.with_name(args.plot.stem + ".layout" + args.plot.suffix)
            plot_address_time(trace, layout, caching, fig7)
            print(f"wrote {fig7}")
    if args.json:
        args.json.write_text(json.dumps(result))
        print(f"wrote {args.json}")
    if args.plot:
        from xema_ray.memory.plot import plot_trace

        plot_trace(trace, args.plot, budget)
        print(f"wrote {args.plot}")
    return 0


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="run the serving worker's own load + execute for every plan entry on the "
                                      "meta device and check its device bytes against the budget")
    p.add_argument("--plan-table", type=Path, required=True, help="a plan table (xema plan --out)")
    p.add_argument("--templates", default=None, help="comma-separated shape keys to verify (default: all entries)")
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON (list `entries`)")
    p.add_argument("--host-memory", default=None,
                   help="the node's RAM, e.g. 512GB, for the per-node host check (default: the table's host budget, "
                        "recorded from --host-budget or the deployment's host_memory)")
    p.add_argument("--adapters", default=None, metavar="SLOTSxRANK[xSTACKED]",
                   help="run every entry with a LoRA adapter pool of SLOTS adapters at RANK, each sample stacking "
                        "STACKED of them (default 1), e.g. 4x64 (default: the table's adapter_pools)")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from xema_ray.plan import PlanTable
    from xema_ray.measure.verify import verify_table

    try:
        table = PlanTable.load(str(args.plan_table))
    except (OSError, ValidationError, ValueError) as e:
        print(f"xema verify: {args.plan_table}: {e}", file=sys.stderr)
        return 2
    keys = None
    if args.templates:
        keys = [k.strip() for k in args.templates.split(",") if k.strip()]
        unknown = [k for k in keys if k not in table.entries]
        if unknown:
            print(f"xema verify: no entry for {', '.join(unknown)}; the table has {', '.join(sorted(table.entries))}",
                  file=sys.stderr)
            return 2
    from xema_ray.allocator.artifact import LayoutMismatch


    try:
        host_memory = parse_bytes(args.host_memory) if args.host_memory else None
    except ValueError as e:
        print(f"xema verify: --host-memory: {e}", file=sys.stderr)
        return 2
    pool = None
    if args.adapters:
        from xema_ray.lora_pool import LoraPoolConfig

        try:
            parts = [int(x) for x in args.adapters.lower().split("x")]
            if len(parts) not in (2, 3):
                raise ValueError("expected SLOTSxRANK or SLOTSxRANKxSTACKED")
            pool = LoraPoolConfig(slots=parts[0], max_rank=parts[1], max_per_request=parts[2] if len(parts) == 3 else 1)
        except ValueError as e:
            print(f"xema verify: --adapters {args.adapters!r}: {e}", file=sys.stderr)
            return 2
    try:
        report = verify_table(table, keys, path=str(args.plan_table), host_memory_bytes=host_memory, adapters=pool)
    except LayoutMismatch as e:
        print(f"xema verify: {e}", file=sys.stderr)
        return 2
    w = sys.stdout.write
    w(f"{'template':<32}{'plan':<44}{'encoder':>9}{'device peak':>13}{'load peak':>12}{'host':>11}{'budget':>10}  fits\n")
    for e in report.entries:
        w(f"{e.template:<32}{e.plan[:43]:<44}{e.text_encoder or '-':>9}{gb(e.device_peak_bytes):>13}{gb(e.load_peak_bytes):>12}"
          f"{gb(e.host_bytes):>11}{gb(e.budget_bytes):>10}  {'yes' if e.fits else 'NO'}\n")
        if e.decode_peak_bytes is not None:
            w(f"    decode stage: the DiT workers' peak above is up to the decode; a decode worker's peak "
              f"{gb(e.decode_peak_bytes)} of its {gb(e.decode_budget_bytes or 0)} "
              f"(predicted {gb(e.predicted_decode_peak_bytes or 0)}): "
              f"{'fits' if e.decode_peak_bytes <= (e.decode_budget_bytes or 0) else 'OVER'}\n")
        if e.layout_misses is not None:
            w(f"    static layout: reserved {gb(e.static_reserved_bytes or 0)} = "
              f"{(e.static_reserved_bytes or 0) / max(1, e.lower_bound_bytes or 0):.3f} x the lower bound "
              f"{gb(e.lower_bound_bytes or 0)}, {e.layout_misses} misses replaying the worker's stream\n")
        elif e.error is None:
            w(f"    static layout: {_no_layout(table, e.template)}\n")
        if e.host is not None and e.host_before is not None:
            h, b = e.host, e.host_before
            w(f"    host: resident {gb(h.resident_bytes)}, pinned {gb(h.pinned_bytes)} ({gb(h.shared_bytes)} shared per "
              f"node), transient at load {gb(h.transient_bytes)}; before: pinned {gb(b.pinned_bytes)}, transient "
              f"{gb(b.transient_bytes)}\n")
        if e.error:
            w(f"    error: {e.error}\n")
    w(f"{sum(e.fits for e in report.entries)} of {len(report.entries)} entries fit "
      f"({sum(e.seconds for e in report.entries):.1f} s)\n")
    _print_node(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(report.model_dump_json(indent=1))
        print(f"wrote {args.json}")
    return 0 if report.all_fit else 1


def _no_layout(table, key: str) -> str:  # type: ignore[no-untyped-def]
    """Why an entry names no static layout, as the table's provenance records it: solved but not
    kept (the reason), planned with --no-layouts, or neither recorded."""
    prov = table.provenance
    if key in prov.layouts_not_armed:
        return f"none kept (solved; {prov.layouts_not_armed[key]}: the worker runs it on the dynamic region)"
    if prov.layouts_wall_s is None:
        return "none (the entry names no layout: planned with --no-layouts)"
    return "none (the entry names no layout; the table records no reason)"


def _print_node(report) -> None:  # type: ignore[no-untyped-def]
    """The per-node host memory, after (exact, shared) and before (power-of-two, per worker)."""
    node, before = report.node, report.node_before
    if node is None or before is None:
        return
    w = sys.stdout.write
    ram = gb(node.budget_bytes) if node.budget_bytes else "not stated"
    w(f"host memory per node (one replica of each group; RAM {ram}):\n")
    w(f"  {'group':<14}{'workers':>8}{'first worker':>14}{'each further':>14}{'pinned':>11}{'transient':>11}"
      f"{'before/worker':>15}{'before pinned':>15}\n")
    for g, b in zip(node.groups, before.groups, strict=True):
        w(f"  {g.model:<14}{g.workers:>8}{gb(g.first_worker_bytes):>14}{gb(g.further_worker_bytes):>14}"
          f"{gb(g.pinned_bytes):>11}{gb(g.worker.transient_bytes):>11}{gb(b.worker.resident_bytes):>15}"
          f"{gb(b.pinned_bytes):>15}\n")
    for label, n in (("before", before), ("after", node)):
        fits = "" if n.budget_bytes is None else ("  fits" if n.fits else "  DOES NOT FIT")
        w(f"  {label:<6} resident {gb(n.resident_bytes)}, pinned {gb(n.pinned_bytes)}, while loading "
          f"{gb(n.load_peak_bytes)}{fits}\n")


def _add_layouts(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layouts", help="write the static layout files a plan table names (solved again from the "
                                       "table's entries: deterministic, the ids must match)")
    p.add_argument("--plan-table", type=Path, required=True, help="a plan table (xema plan --out)")
    p.add_argument("--gpu", default=None, help="GPU model the layouts are for (default: the table's provenance "
                                               "layouts_gpu)")
    p.add_argument("--update-refs", action="store_true",
                   help="write a layout that solves to another id and put the new id in the table (its configs "
                        "unchanged): for a change of the allocation stream that leaves the plans' choices valid; "
                        "`xema verify` then checks every entry still fits")
    p.set_defaults(func=cmd_layouts)


def cmd_layouts(args: argparse.Namespace) -> int:
    """Solve every missing or unreadable layout the table names; exit 1 if one solves to another id
    (the model code or the solver changed since planning: re-plan)."""
    from xema_ray.plan import PlanTable
    from xema_ray.allocator.artifact import LayoutMismatch, layouts_dir, load_artifact, save_artifact
    from xema_ray.measure.layout_solve import solve_entry_layout

    try:
        table = PlanTable.load(str(args.plan_table))
    except (OSError, ValidationError, ValueError) as e:
        print(f"xema layouts: {args.plan_table}: {e}", file=sys.stderr)
        return 2
    gpu = args.gpu or table.provenance.layouts_gpu
    if gpu is None:
        print(f"xema layouts: {args.plan_table} does not say which GPU model its layouts are for: give --gpu",
              file=sys.stderr)
        return 2
    folder = layouts_dir(args.plan_table)
    mismatched = []
    renamed: dict[str, str] = {}
    for key, e in sorted(table.entries.items()):
        ref = e.config.layout_ref
        if ref is None:
            print(f"{key:<32} no layout: {_no_layout(table, key)}")
            continue
        try:
            load_artifact(folder, ref, gpu=gpu)
            print(f"{key:<32} {ref} present")
            continue
        except (LayoutMismatch, OSError, ValidationError, ValueError):
            pass
        t0 = time.perf_counter()
        art = solve_entry_layout(e.config.model_copy(update={"layout_ref": None}), gpu, folder)
        if art.layout_id != ref and not args.update_refs:
            mismatched.append(key)
            print(f"{key:<32} solved {art.layout_id}, the table names {ref}: NOT written")
            continue
        if art.layout_id != ref:
            renamed[ref] = art.layout_id
            print(f"{key:<32} solved {art.layout_id}, the table named {ref}: written, the table updated")
        save_artifact(art, folder)
        print(f"{key:<32} {art.layout_id} solved in {time.perf_counter() - t0:.1f} s")
    if renamed:
        # the ids are content hashes, unique in the file: replace them where they stand (the rest
        # of the table, byte for byte as planned)
        text = Path(args.plan_table).read_text()
        for before, after in renamed.items():
            text = text.replace(f'"{before}"', f'"{after}"')
        Path(args.plan_table).write_text(text)
        PlanTable.load(str(args.plan_table))
    if mismatched:
        print(f"xema layouts: {len(mismatched)} layout(s) solve differently than when planned (the model code or "
              "the solver changed): plan the table again (make plan)", file=sys.stderr)
        return 1
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="`serve run CONFIG` with the app's Ray settings: Ray's ports on 127.0.0.1 only "
                                     "(XEMA_RAY_OPEN_PORTS=1 opens them) and the proxy's errors as JSON")
    p.add_argument("config", help="a Serve config file, e.g. deployments/xema.yaml")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="further `serve run` arguments, e.g. --address local; or --reload-plans TABLE "
                        "[--dashboard URL] [--app NAME] [--timeout S]: serve TABLE in the app already running from "
                        "CONFIG without restarting it (Serve's in-place config update; docs/serving.md "
                        "\"A new plan table\")")
    p.set_defaults(func=_serve)


def _reload_parser() -> argparse.ArgumentParser:
    import os

    p = argparse.ArgumentParser(prog="xema serve CONFIG --reload-plans", add_help=False)
    p.add_argument("--reload-plans", dest="table", default=None)
    p.add_argument("--dashboard", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"),
                   help="the running cluster's dashboard (Serve's REST API), default RAY_DASHBOARD_ADDRESS or :8265")
    p.add_argument("--app", default=None, help="the application's name (default: CONFIG's deployments.app one)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every group to serve it")
    return p


def _serve(args: argparse.Namespace) -> int:
    """Replace this process with ``serve run`` in the app's Ray environment (``ray_env``): the
    Ray cluster ``serve run`` starts then listens on 127.0.0.1 only. A setting of the process
    that starts Ray, hence not one the YAML or the app can make (docs/serving.md "Ports")."""
    import os

    from xema_ray.serving.ray_env import ray_env, serve_run_config

    if "--reload-plans" in args.serve_args:
        from deployments.reload import reload_plans

        opts, rest = _reload_parser().parse_known_args(args.serve_args)
        if rest:
            print(f"xema serve --reload-plans: unexpected arguments {rest}", file=sys.stderr)
            return 2
        return reload_plans(args.config, opts.table, dashboard=opts.dashboard, app_name=opts.app, timeout_s=opts.timeout)
    serve = Path(sys.executable).parent / "serve"
    env = ray_env()
    config = serve_run_config(args.config, env, args.serve_args)
    if config != args.config:
        print(f"xema serve: {args.config} without its controller_options, which this cluster's environment sets "
              f"({config})", file=sys.stderr, flush=True)
    os.execve(str(serve), [str(serve), "run", config, *args.serve_args], env)
    return 1  # not reached


#: subcommands whose result depends on the allocation stream's set-iteration order: run under the
#: fixed string-hash seed (``xema_ray.hash_seed``; the process re-starts itself once)
SEEDED_COMMANDS = ("verify", "layouts", "plan")


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in SEEDED_COMMANDS and not {"-h", "--help"} & set(sys.argv):
        from xema_ray.hash_seed import reexec_seeded

        reexec_seeded()
    parser = argparse.ArgumentParser(prog="xema", description="Xema-Ray: memory analysis and planning for diffusion serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_analyze(sub)
    _add_verify(sub)
    _add_layouts(sub)
    _add_serve(sub)
    from planner.cli import add_plan_parser

    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
