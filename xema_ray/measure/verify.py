"""``xema verify``: the serving worker's own load + execute code, on the meta device, counted.

For each plan-table entry a ``Worker`` is started on the meta platform (the same class a GPU
worker actor runs; SP ranks join a fake process group, so one process stands for rank 0 of the
batch's SP group), loads the model with the entry's plans (each weight placed where the
residency says, exactly as on a GPU) and executes one batch of the plan's size, all under the
``AllocationTracer``. Device bytes are counted from the first weight placed to the end of the
request; host bytes (weights homed on pinned host memory) are reported separately, as the
worker's loader counted them (exact buffers resident, pinned, shared with the node's other workers
of the model, transient at load), beside the same tensors as the earlier loader held them (each
pinned tensor in torch's power-of-two block, nothing shared, the text encoder read whole first);
per node, one replica of each model group is added up against the node's stated RAM. Nothing is
modelled here: what is counted is what the worker allocates.

Denoising steps repeat the same allocations (the analyzer checks it), so ``VERIFY_STEPS``
steps stand for all of them.

Example:
    >>> from xema_ray.plan import ExecutionConfig
    >>> from xema_ray.templates import RequestTemplate
    >>> t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=2)
    >>> r = verify_config(ExecutionConfig(template=t), budget_bytes=10**9)
    >>> r.fits, r.device_peak_bytes > r.load_peak_bytes > 0
    (True, True)
"""

from __future__ import annotations

import contextlib

import time
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from xema_ray.analyzer.steps import REPLICATE_FROM, steps_to_trace
from xema_ray.memory.trace import MemoryTrace
from xema_ray.analyzer.tracer import ALLOC, AllocationTracer, RawTrace, round_size
from xema_ray.plan import ExecutionConfig, LoraPoolConfig, PlanTable
from xema_ray.host_budget import GroupHost, HostBytes, NodeHost
from xema_ray.runtime.worker import LoadedModel, ModelLoadConfig, ResidencyPolicy, Worker

if TYPE_CHECKING:
    from xema_ray.allocator.artifact import LayoutArtifact

VERIFY_STEPS = REPLICATE_FROM
LOAD_END = "verify:load_end"


class VerifyEntry(BaseModel):
    """What the worker's own code allocated for one plan entry."""

    model_config = ConfigDict(frozen=True)

    template: str
    plan: str = Field(description="ExecutionConfig.describe() of the entry")
    device_peak_bytes: int = Field(description="device peak from the first weight placed to the end of the request")
    load_peak_bytes: int = Field(description="device peak while loading (the weights the device holds after load)")
    host_bytes: int = Field(description="weight bytes homed on (pinned) host memory")
    host: HostBytes | None = Field(
        default=None, description="the worker's host memory as its loader placed it: exact buffers resident, pinned, "
                                  "shared with the node's other workers of the model, transient at load")
    host_before: HostBytes | None = Field(
        default=None, description="the same tensors as the loader held them before exact buffers: pinned one by one "
                                  "(torch's power-of-two blocks), nothing shared, a checkpoint's text encoder read "
                                  "whole onto the CPU first")
    text_encoder: str | None = Field(default=None, description="where the text encoder ran (None: stand-in embeddings)")
    budget_bytes: int
    predicted_peak_bytes: int | None = Field(default=None, description="the planner's prediction, for comparison")
    fits: bool
    steps_traced: int
    sp_rank_traced: int = Field(default=0, description="the SP rank whose allocations were counted")
    seconds: float
    error: str | None = Field(default=None, description="why the worker could not run the entry (then fits is false)")
    static_reserved_bytes: int | None = Field(default=None, description="the entry's static layout: reserved bytes")
    lower_bound_bytes: int | None = Field(default=None, description="max live bytes of the request (no layout can do better)")
    layout_misses: int | None = Field(default=None, description="allocations of the worker's stream the layout did not "
                                                                "place (replayed through the host arena)")
    decode_peak_bytes: int | None = Field(
        default=None, description="with a decode stage (config.decode): a decode worker's device peak, counted from the "
                                  "same worker's decode with only the decoder's weights held; device_peak_bytes is then "
                                  "the DiT workers' peak up to the decode (None: decoded in place)")
    decode_budget_bytes: int | None = Field(
        default=None, description="a decode worker's budget: its share of a GPU's (gpus_per_worker x budget)")
    predicted_decode_peak_bytes: int | None = Field(default=None, description="the planner's prediction of it")


class VerifyReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    plan_table: str | None = None
    entries: list[VerifyEntry]
    node: NodeHost | None = Field(
        default=None, description="host memory of one node holding one replica of every model group of the table "
                                  "(each group's worker: the largest of its entries), against the node's stated RAM")
    node_before: NodeHost | None = Field(default=None, description="the same node as the loader before exact, "
                                                                   "shared buffers held it")

    @property
    def all_fit(self) -> bool:
        return all(e.fits for e in self.entries)


def device_peaks(raw: RawTrace) -> tuple[int, int]:
    """(whole-run peak, peak up to the load-end marker) of a raw trace, in caching-allocator bytes."""
    kinds = np.asarray(raw.event_kind, dtype=np.int8)
    sizes = np.asarray([round_size(r.nbytes) for r in raw.records], dtype=np.int64)
    alloc_of = np.asarray(raw.event_alloc, dtype=np.int64)
    if kinds.size == 0:
        return 0, 0
    delta = np.where(kinds == ALLOC, sizes[alloc_of], -sizes[alloc_of])
    live = np.cumsum(delta)
    load_end = next((pos for pos, label in raw.markers if label == LOAD_END), len(live))
    load_peak = int(live[:load_end].max()) if load_end > 0 else 0
    return int(live.max()), load_peak


def _run_worker(config: ExecutionConfig, steps: int, tracer: AllocationTracer, markers: bool,
                group_plans: Iterable[ExecutionConfig] = (), residency: ResidencyPolicy = "per_template",
                layouts_dir: Path | None = None, replay_blocks: bool = False,
                one_expert: bool = False, adapters: LoraPoolConfig | None = None,
                decoder_bytes: dict[str, int] | None = None) -> tuple[LoadedModel | None, str | None]:
    """Load and run one batch of ``config`` (``steps`` denoising steps) with the serving worker on
    meta under ``tracer``; (what the load placed, error). ``replay_blocks``: the
    analyzer's block replay (``xema_ray.analyzer.block_replay``, exact) beneath the batch's hooks,
    SP ranks included (the fake process group's collectives are allocations like any other).
    ``adapters``: the group's LoRA pool, loaded with the model (its stacks count in the load) and
    filled with worst-case adapters that every sample of the batch stacks. ``decoder_bytes``:
    filled with the device bytes of each of the spec's decode components as the load placed them."""
    from xema_ray.placement import forget_placeholders

    template = config.template
    run = config.model_copy(update={"template": template.with_(steps=steps)})
    plans = (config, *[p for p in group_plans if p != config])
    # the placeholders' shared scalars (512 B each) are made by a process's first load: made
    # again here, the load counts them whatever this process traced before (the loaded bytes,
    # and so the entry's predicted peak, do not depend on which planning worker ran it)
    forget_placeholders("meta")
    worker = Worker(platform="meta")
    loaded = None
    try:
        from xema_ray.analyzer.assembly import assembled
        from xema_ray.parallel.groups import ParallelConfig, SPLayout
        from xema_ray.runtime.engine import Batch, GenerationRequest

        layouts = tuple({(p.ulysses, p.ring) for p in plans if p.sp > 1 and p.sp <= config.sp})
        parallel = (ParallelConfig(rank=0, world_size=1) if config.sp == 1 else
                    ParallelConfig(rank=0, world_size=config.sp, init_method="fake://", backend="fake",
                                   layouts=tuple(SPLayout(ulysses=u, ring=r) for u, r in sorted(layouts)
                                                 if config.sp % (u * r) == 0)))
        batch = Batch(config=run, requests=tuple(GenerationRequest(request_id=f"verify-{i}", prompt="a photo of a cat",
                                                                    seed=i) for i in range(config.batch)),
                      steps=steps)
        with torch.no_grad(), tracer:
            worker.init_device(parallel)
            loaded = worker.load_model(ModelLoadConfig(model=template.model, plans=plans, residency=residency,
                                                       layouts_dir=layouts_dir, adapters=adapters))
            if adapters is not None and worker.engine is not None and worker.engine.adapters is not None:
                from xema_ray.lora.memory import fill_worst_case

                uses = fill_worst_case(worker.engine.adapters, config.batch)
                batch = batch.model_copy(update={"requests": tuple(r.model_copy(update={"lora": u})
                                                                   for r, u in zip(batch.requests, uses, strict=True))})
            tracer.mark(LOAD_END)
            engine = worker.engine
            assert engine is not None
            if decoder_bytes is not None:
                decoder_bytes.update(_decoder_bytes(engine.pipe, template.spec.decode_components()))
            # the analyzer's assembly of the worker's call: its markers around the batch, the block
            # replay beneath the hooks the engine installs for the batch (its ``inner_env``)
            with assembled(engine.pipe, tracer, "meta", markers=markers, replay_blocks=replay_blocks,
                           beneath=lambda install: setattr(engine, "inner_env", install)):
                # steps to be replicated must be alike: a two-expert model's call runs one expert
                # for all of them, as the analyzer traces it (both allocate alike)
                with config.template.spec.one_expert_call(engine.pipe) if one_expert else contextlib.nullcontext():
                    worker.execute(batch)
        return loaded, None
    except Exception as e:  # noqa: BLE001 — reported per entry: one bad plan must not hide the others
        return loaded, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        worker.shutdown()


def _decoder_bytes(pipe: object, components: tuple[str, ...]) -> dict[str, int]:
    """Device bytes (caching-allocator rounded) of each decode component's weights as placed."""
    out = {}
    for name in components:
        comp = getattr(pipe, name, None)
        if isinstance(comp, torch.nn.Module):
            tensors = [*comp.parameters(), *comp.buffers()]
            out[name] = sum(round_size(t.numel() * t.element_size()) for t in tensors if t.device.type != "cpu")
    return out


def stage_peaks(raw: RawTrace, components: tuple[str, ...], decoder_bytes: int) -> tuple[int, int]:
    """(the DiT workers' peak up to the first decode, a decode worker's peak) of one worker's run
    with the analyzer's markers: the decode worker holds the decoder's weights and what the decode
    allocates, not the rest of the model's weights (the device bytes placed at load less the
    decoder's)."""
    kinds = np.asarray(raw.event_kind, dtype=np.int8)
    sizes = np.asarray([round_size(r.nbytes) for r in raw.records], dtype=np.int64)
    alloc_of = np.asarray(raw.event_alloc, dtype=np.int64)
    live = np.cumsum(np.where(kinds == ALLOC, sizes[alloc_of], -sizes[alloc_of]))
    load_end = next(pos for pos, label in raw.markers if label == LOAD_END)
    begins = [pos for pos, label in raw.markers if label in {f"begin:{c}" for c in components}]
    ends = [pos for pos, label in raw.markers if label in {f"end:{c}" for c in components}]
    if not begins or not ends:
        raise RuntimeError("the worker's run has no decode: nothing to hand a decode stage")
    first, last = min(begins), max(ends)
    loaded = int(live[load_end - 1]) if load_end > 0 else 0
    dit = int(live[:first].max()) if first > 0 else 0
    decode = int(live[first:last + 1].max()) - (loaded - decoder_bytes)
    return dit, max(decoder_bytes, decode)


def verify_stages(config: ExecutionConfig, budget_bytes: int, predicted_peak_bytes: int | None = None,
                  predicted_decode_peak_bytes: int | None = None, adapters: LoraPoolConfig | None = None) -> VerifyEntry:
    """An entry with a decode stage (``config.decode``), its two workers checked apart: the DiT
    workers' peak up to the decode (the worker's own run of the DiT's config; the decode is handed
    over there) against the budget, and a decode worker's peak (the worker's decode of one request
    under the pool's mitigations, with only the decoder's weights held) against its share of a GPU."""
    assert config.decode is not None
    t0 = time.perf_counter()
    spec = config.template.spec
    steps = min(config.template.steps, steps_to_trace(spec.settling_steps_for(config.template), spec.step_lifetime))
    dit_cfg = config.dit_stage()
    components = spec.decode_components()
    tracer = AllocationTracer("meta", {})
    held: dict[str, int] = {}
    loaded, error = _run_worker(dit_cfg, steps, tracer, markers=True, adapters=adapters, decoder_bytes=held)
    dit_peak = decode_peak = 0
    load_peak = device_peaks(tracer.raw())[1]
    if error is None:
        dit_peak, decode_peak = stage_peaks(tracer.raw(), components, sum(held.values()))
        pool = config.decode_worker()
        if pool.mitigations or config.batch > 1:
            # a decode worker decodes one request, under the pool's mitigations: that decode counted
            # in a run of its own (one request, one GPU, the pool's mitigations)
            tracer = AllocationTracer("meta", {})
            held = {}
            _, error = _run_worker(pool, steps, tracer, markers=True, decoder_bytes=held)
            if error is None:
                decode_peak = stage_peaks(tracer.raw(), components, sum(held.values()))[1]
    decode_budget = int(budget_bytes * config.decode.gpus_per_worker) if config.decode.gpus_per_worker < 1 else budget_bytes
    return VerifyEntry(
        template=config.template.shape_key, plan=config.describe(), device_peak_bytes=dit_peak,
        load_peak_bytes=load_peak, host_bytes=loaded.host_bytes if loaded else 0,
        host=host_of(loaded) if loaded else None, host_before=host_before_of(config, loaded) if loaded else None,
        text_encoder=loaded.text_encoder if loaded else None, budget_bytes=budget_bytes,
        predicted_peak_bytes=predicted_peak_bytes,
        fits=error is None and dit_peak <= budget_bytes and decode_peak <= decode_budget,
        steps_traced=steps, seconds=time.perf_counter() - t0, error=error,
        decode_peak_bytes=decode_peak if error is None else None, decode_budget_bytes=decode_budget,
        predicted_decode_peak_bytes=predicted_decode_peak_bytes)


def worker_trace(config: ExecutionConfig, layouts_dir: Path | None = None, replay_blocks: bool = True) -> MemoryTrace:
    """The allocations one batch of ``config`` makes in the serving worker after its weights are
    placed, for the template's full step count (steps traced and replicated like the analyzer's;
    DiT blocks replayed where exact: ``replay_blocks``, the same stream, ~4x faster on LTX-2).

    Always the stream of a process started with ``PYTHONHASHSEED=0``, as serving workers are
    (``xema_ray.hash_seed``: the model code's set iteration order depends on it): traced
    here when this process is, else in a seeded child process."""
    return worker_streams(config, (config.template.steps,), layouts_dir, replay_blocks)[0]


def worker_streams(config: ExecutionConfig, steps: tuple[int, ...], layouts_dir: Path | None = None,
                   replay_blocks: bool = True) -> list[MemoryTrace]:
    """``worker_trace`` with the traced steps replicated to each of ``steps`` step counts (one
    worker run; a step count below the traced ones is not allowed)."""
    from xema_ray.hash_seed import seeded

    if not seeded():
        from xema_ray.measure.seeded_trace import trace_in_child

        return trace_in_child(config, steps, layouts_dir, replay_blocks)
    return trace_here(config, steps, layouts_dir, replay_blocks)


def trace_here(config: ExecutionConfig, steps: tuple[int, ...], layouts_dir: Path | None = None,
               replay_blocks: bool = True) -> list[MemoryTrace]:
    """``worker_streams`` in this process, whatever its string-hash seed (``steps``: the step counts
    to expand to; ``(config.template.steps,)`` for the template's own)."""
    from xema_ray.analyzer.steps import expand_steps

    tracer = AllocationTracer("meta", {})
    spec = config.template.spec
    traced = min(config.template.steps, steps_to_trace(spec.settling_steps_for(config.template), spec.step_lifetime))
    if config.experts is not None and config.experts.strategy == "swap_prefetched":
        # the swap's steps differ by design (the prefetch, the switch): every step is traced
        traced = max(config.template.steps, *steps)
    two_experts = len(spec.expert_stages(config.template)) > 1
    _, error = _run_worker(config, traced, tracer, markers=True, layouts_dir=layouts_dir, replay_blocks=replay_blocks,
                           one_expert=two_experts and traced < config.template.steps)
    if error is not None:
        raise RuntimeError(f"{config.template.shape_key} ({config.describe()}): the worker failed: {error}")
    raw = tracer.raw()
    load_end = next(pos for pos, label in raw.markers if label == LOAD_END)
    loaded = device_peaks(raw)[1]
    out = []
    for n in steps:
        trace = expand_steps(raw, n, spec.step_lifetime)
        request = trace.subset(trace.begin >= load_end)
        # events numbered from the request's start: what the load made before it (a first load in a
        # process makes one lazily built buffer more) does not shift the stream, so the layout solved
        # from it, and its id, are the same in every process
        request.begin, request.end = request.begin - load_end, request.end - load_end
        request.n_events -= load_end
        request.step_bounds = [b - load_end for b in request.step_bounds]
        request.loaded_bytes = loaded  # the weights the worker placed before the request
        out.append(request)
    return out


def verify_config(
    config: ExecutionConfig,
    budget_bytes: int,
    group_plans: Iterable[ExecutionConfig] = (),
    residency: ResidencyPolicy = "per_template",
    predicted_peak_bytes: int | None = None,
    layout: LayoutArtifact | None = None,
    layouts_dir: Path | None = None,
    adapters: LoraPoolConfig | None = None,
) -> VerifyEntry:
    """Load and run ``config``'s batch with the serving worker on meta and count its device bytes.

    Args:
        config: the plan to run.
        budget_bytes: the per-GPU budget it must stay within.
        group_plans: the other plans of the worker's group (they shape the residency at load).
        residency: the group's residency policy.
        predicted_peak_bytes: the planner's prediction, reported beside the count.
        layout: the entry's static layout artifact: the worker's full request stream (with the
            GPU-only allocations the layout was solved with, if any) is replayed through the C++
            allocator's host arena against it (misses, reserved bytes reported).
        layouts_dir: the plan table's layouts folder (the worker validates the layouts it names).
        adapters: the group's LoRA adapter pool: its stacks in the load, every sample stacking
            ``max_per_request`` worst-case adapters (max rank, every linear layer) in the batch.
    """
    t0 = time.perf_counter()
    spec = config.template.spec
    steps = min(config.template.steps, steps_to_trace(spec.settling_steps_for(config.template), spec.step_lifetime))
    tracer = AllocationTracer("meta", {})
    loaded, error = _run_worker(config, steps, tracer, markers=False, group_plans=group_plans,
                                residency=residency, layouts_dir=layouts_dir, adapters=adapters)
    peak, load_peak = device_peaks(tracer.raw())
    replayed = None
    if layout is not None and error is None:
        from xema_ray.allocator.device_allocs import include
        from xema_ray.allocator.layout_replay import replay

        stream = worker_trace(config, layouts_dir)
        if layout.device_allocs is not None:
            # the GPU-only allocations recorded on this GPU model count in the device peak too
            stream = include(stream, layout.device_allocs)[0]
            peak = max(peak, stream.loaded_bytes + stream.peak())
        replayed = replay(layout.solved(), stream)
    return VerifyEntry(
        template=config.template.shape_key, plan=config.describe(), device_peak_bytes=peak, load_peak_bytes=load_peak,
        host_bytes=loaded.host_bytes if loaded else 0, host=host_of(loaded) if loaded else None,
        host_before=host_before_of(config, loaded) if loaded else None,
        text_encoder=loaded.text_encoder if loaded else None, budget_bytes=budget_bytes,
        predicted_peak_bytes=predicted_peak_bytes,
        fits=error is None and peak <= budget_bytes and (replayed is None or replayed.misses == 0),
        steps_traced=steps, seconds=time.perf_counter() - t0, error=error,
        static_reserved_bytes=replayed.static_reserved_bytes if replayed else None,
        lower_bound_bytes=replayed.lower_bound_bytes if replayed else None,
        layout_misses=replayed.misses if replayed else None,
    )


def host_of(loaded: LoadedModel) -> HostBytes:
    """The worker's host figures as its loader counted them."""
    return HostBytes(resident_bytes=loaded.host_buffer_bytes, pinned_bytes=loaded.host_pinned_bytes,
                     shared_bytes=loaded.host_shared_bytes,
                     shared_pinned_bytes=min(loaded.host_shared_bytes, loaded.host_pinned_bytes),
                     transient_bytes=loaded.transient_bytes)


def host_before_of(config: ExecutionConfig, loaded: LoadedModel) -> HostBytes:
    """The same placed tensors as the earlier loader held them: its pinned ones in torch's
    power-of-two blocks (counted from the same tensors), the CPU encoder's as they are, nothing
    shared, and with the model's published checkpoint (the reference deployment loads one) its
    text encoder read whole onto the CPU before being placed on the device or pinned."""
    from xema_ray.models.text_encoders import encoder_weight_bytes

    spec = config.template.spec
    whole = 0
    if loaded.text_encoder in ("device", "streamed") and spec.text_encoder is not None:
        whole = encoder_weight_bytes(spec.text_encoder, torch.bfloat16 if spec.size == "real" else torch.float32)[0]
    unpinned = loaded.host_buffer_bytes - loaded.host_pinned_bytes
    return HostBytes(resident_bytes=loaded.host_pow2_bytes + unpinned, pinned_bytes=loaded.host_pow2_bytes,
                     transient_bytes=whole + loaded.transient_bytes)


def node_host(table: PlanTable, entries: list[VerifyEntry], before: bool = False,
              budget_bytes: int | None = None) -> NodeHost | None:
    """One node with one replica of each of the table's model groups (``group_gpus``; a table
    planned without a deployment: one group of all its GPUs per model), each DiT worker holding the
    largest of its model's verified entries (a decode pool's workers hold the VAE alone: not counted)."""
    per_model: dict[str, HostBytes] = {}
    for e in entries:
        h = e.host_before if before else e.host
        if h is None:
            continue
        model = table.entries[e.template].config.template.model
        per_model[model] = per_model[model].max(h) if model in per_model else h
    if not per_model:
        return None
    groups = [GroupHost(model=m, workers=table.dit_workers(m), worker=h) for m, h in sorted(per_model.items())]
    budget = budget_bytes if budget_bytes is not None else (table.host.budget_bytes if table.host is not None else None)
    return NodeHost.of(groups, budget)


def verify_table(table: PlanTable, templates: Iterable[str] | None = None, path: str | None = None,
                 host_memory_bytes: int | None = None, adapters: LoraPoolConfig | None = None) -> VerifyReport:
    """``verify_config`` for every entry of ``table`` (or the named shape keys). Each entry is
    loaded with its own plan first, as a per-template worker loads it for that template; a
    switch from another template's residency only moves blocks out before others come in, so
    it never exceeds the larger of the two residencies' device bytes. A group with an adapter
    pool (``table.adapter_pools``, or ``adapters`` for every entry) runs with it full."""
    keys = list(templates) if templates is not None else sorted(table.entries)
    out = []
    for key in keys:
        e = table.entries[key]
        layout = folder = None
        if e.config.layout_ref is not None and path is not None:
            from xema_ray.allocator.artifact import load_artifact, layouts_dir

            folder = layouts_dir(path)
            layout = load_artifact(folder, e.config.layout_ref)
        pool = adapters if adapters is not None else table.adapter_pools.get(e.config.template.model)
        if e.config.decode is not None:
            out.append(verify_stages(e.config, table.budget_bytes, predicted_peak_bytes=e.prediction.peak_bytes,
                                     predicted_decode_peak_bytes=e.prediction.decode_peak_bytes, adapters=pool))
            continue
        out.append(verify_config(e.config, table.budget_bytes, group_plans=(),
                                 predicted_peak_bytes=e.prediction.peak_bytes, layout=layout, layouts_dir=folder,
                                 adapters=pool))
    return VerifyReport(plan_table=path, entries=out, node=node_host(table, out, budget_bytes=host_memory_bytes),
                        node_before=node_host(table, out, before=True, budget_bytes=host_memory_bytes))
