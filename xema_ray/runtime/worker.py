"""The worker: one process, one device, one loaded model (vLLM's worker interface).

``init_device`` binds the device and joins the worker set (all SP process groups are created
here, once); ``load_model`` builds the pipeline once; ``execute`` runs a batch under any
execution config, including a different SP degree than the previous batch, without reloading;
``shutdown`` leaves the worker set (the interface: ``xema_ray.runtime.worker_base.WorkerBase``).
Arguments and results are pydantic, so the class can be wrapped as a Ray actor
(``ray.remote(Worker)``) unchanged.

Preemption: ``execute(batch, run_id=...)`` runs the batch on a thread of its own and returns
either its result or, when ``pause(run_id)`` was asked meanwhile, a ``PausedRun`` once it parked
at a step boundary; ``resume(run_id)`` switches the residency back to the batch's and continues
it. The actor must then serve calls concurrently (``max_concurrency``), so ``pause`` reaches a
worker that is busy in ``execute``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.lora import AdapterInfo, AdapterRejected, PoolStats
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.models.base import DTypeName, ModelSpec, model_dtypes
from xema_ray.placement import PLACEMENT_ATTR, PlacementReport
from xema_ray.parallel.groups import ParallelConfig, ProcessGroups, init_process_groups
from xema_ray.parallel.sp import SPBackend
from xema_ray.plan import ExecutionConfig, ExpertSwap
from xema_ray.platforms import Platform, current_platform, get_platform
from xema_ray.platforms.host_memory import SegmentHolder
from xema_ray.runtime.emulation import EmulationConfig
from xema_ray.runtime.adapters import NO_POOL, AdapterSource, LoraPoolConfig, WorkerAdapters, install_adapters
from xema_ray.runtime.engine import ArmLayout, Batch, BatchResult, ExecutionEngine
from xema_ray.runtime.out_of_memory import device_out_of_memory
from xema_ray.runtime.pause import PreemptibleRun
from xema_ray.runtime.progress import StepObserver
from xema_ray.runtime.residency import Residency, ResidencyManager, with_residency
from xema_ray.runtime.worker_base import WorkerBase

if TYPE_CHECKING:
    from xema_ray.allocator.runtime import RequestReport

ResidencyPolicy = Literal["per_template", "shared"]


def own_weights(load: ModelLoadConfig) -> str:
    """The format the worker's own transformer is loaded in: the plans' where they all run one."""
    planned = {c.weights for c in load.plans}
    return next(iter(planned)) if len(planned) == 1 else "model"


def quantize_as_placed(spec: ModelSpec, fmt: str) -> Callable[[str, str, nn.Module], None]:
    """``BuildOptions.placed`` storing each quantizable layer of the transformer in ``fmt`` as soon as
    it is placed (the device holds one layer in the model's dtype at a time, never the whole)."""
    from xema_ray.mitigation.weight_quant import WeightQuantConfig, quantize_transformer

    rule, config = spec.weight_quant, WeightQuantConfig(format=fmt)  # type: ignore[arg-type]
    assert rule is not None

    def placed(component: str, path: str, module: nn.Module) -> None:
        if component == "transformer" and rule.quantizes(path, module):
            quantize_transformer(module, spec, config)

    return placed


def hold_weight_formats(engine: ExecutionEngine, load: ModelLoadConfig) -> int:
    """The weight formats ``load`` asks for on ``engine``'s pipeline, its transformer loaded in
    ``own_weights(load)``: a quantized copy of the transformer per other format the plans or the
    group's tiers name (``xema_ray.mitigation.weight_quant``). Returns the bytes this adds to the
    placed weights: the copies', less what the own transformer's quantization saved."""
    from xema_ray.mitigation.weight_quant import WeightQuantConfig, quantized_copy, stored_bytes

    own = own_weights(load)
    engine.weights = own
    wanted = ({c.weights for c in load.plans} | set(load.weight_formats)) - {"model", own}
    if wanted and own != "model":
        raise ValueError(f"weights: a transformer loaded in {own} cannot be copied into {sorted(wanted)}")
    for fmt in sorted(wanted):
        engine.quantized[fmt] = quantized_copy(engine.pipe.transformer, engine.spec, WeightQuantConfig(format=fmt))
    saved = 0
    rule = engine.spec.weight_quant
    if own != "model" and rule is not None:
        itemsize = engine.dtype.itemsize
        for name, m in engine.pipe.transformer.named_modules():
            if rule.quantizes(name, m):
                bias = m.bias.numel() * m.bias.element_size() if m.bias is not None else 0
                saved += m.weight.numel() * itemsize + bias - stored_bytes(m)
    return sum(stored_bytes(m) for m in engine.quantized.values()) - saved


class ModelLoadConfig(BaseModel):
    """Which model a worker loads, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="registry name, e.g. 'tiny-flux2' or 'cogvideox-5b'")
    weights_dir: Path | None = Field(default=None, description="local diffusers directory; None = random weights")
    dtype: DTypeName | None = Field(default=None, description="None = bfloat16 for real models, float32 for tiny ones")
    component_dtypes: dict[str, DTypeName] = Field(
        default_factory=dict, description="components kept in a dtype of their own (e.g. {'vae': 'float32'}, as "
                                          "CogVideoX-5b stores it); the others are cast to dtype on load")
    seed: int = Field(default=0, ge=0, description="seed of random weights (identical on every worker)")
    plans: tuple[ExecutionConfig, ...] = Field(
        default=(), description="the plans of the group's templates: weights are placed once, at load, as they say")
    weight_formats: tuple[Literal["fp8", "int8"], ...] = Field(
        default=(), description="quantized formats the group also serves (its quality tiers'): the worker keeps a "
                                "quantized copy of the transformer for each, beside the plans' own weights")
    text_encoder: Literal["device", "streamed", "cpu", "none"] | None = Field(
        default=None,
        description="where the text encoder runs; None = the plans' choice (the most off-device one among them), "
                    "else on the device when weights_dir has one; 'none' = stand-in embeddings")
    layouts_dir: Path | None = Field(
        default=None, description="the plan table's layouts folder (<table>.layouts/): plans with a layout_ref arm theirs")
    budget_bytes: int | None = Field(
        default=None, ge=1, description="device memory per worker (the plan table's budget): sizes the static "
                                        "allocator's dynamic region for the group; None: not known")
    emulation: EmulationConfig | None = Field(
        default=None, description="device emulated: the templates' phases from the plan table (xema_ray.runtime.emulated); "
                                  "a real worker refuses a load config that has one")
    residency: ResidencyPolicy = Field(
        default="per_template",
        description="per_template: each batch's plan decides, switching moves only the difference; "
                    "shared: one residency (every plan's offloaded blocks) for the whole group, no switches")
    share_host_weights: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="host-homed weights in one shared segment per node for all workers of this model, weights "
                    "and residency (xema_ray.platforms.host_memory): auto = on CUDA workers (and on meta, which "
                    "stands for them in xema verify); off = each worker "
                    "its own exact-size buffer")
    app: str = Field(
        default="default", min_length=1,
        description="the Serve application the worker serves: its shared host segments are named after it "
                    "(xema-<app>-<key>), so two apps on one node never share or sweep each other's")
    host_copy: bool = Field(
        default=False,
        description="keep every weight in the node's host copy (a shared /dev/shm segment, page-locked on CUDA) "
                    "and copy the device's from it: a later worker of this node, weights and residency maps "
                    "it instead of reading the checkpoint (docs/serving.md, 'Warm replicas')")
    host_copy_holder: SegmentHolder | None = Field(
        default=None, description="the node-level process that keeps the host copy after the last worker closes it "
                                  "(a group scaled to zero wakes warm); None: the last worker out removes it")

    adapters: LoraPoolConfig | None = Field(
        default=None, description="serve LoRA adapters per sample: the device pool's size (xema_ray.lora); None: none")
    adapter_sources: tuple[AdapterSource, ...] = Field(
        default=(), description="adapter files read at load (the YAML's folder and those added since)")

    def shares_host(self, platform: str) -> bool:
        """Whether this load keeps its host-homed weights in the node's shared segment."""
        return self.share_host_weights == "on" or (self.share_host_weights == "auto" and platform in ("cuda", "meta"))

    def encoder_placement(self) -> str | None:
        """The text encoder placement to load with (see ``text_encoder``)."""
        if self.text_encoder is not None:
            return self.text_encoder
        order = {"device": 0, "streamed": 1, "cpu": 2}
        chosen = [c.text_encoder for c in self.plans if c.text_encoder is not None]
        return max(chosen, key=order.__getitem__) if chosen else None

    def expert_swap(self) -> ExpertSwap | None:
        """How the plans hold a two-expert model's experts (one way per group: the load places
        the experts' blocks for it); None: as the pipeline holds them."""
        ways = {(c.experts.strategy, c.experts.host_blocks) for c in self.plans if c.experts is not None}
        if len(ways) > 1 or (ways and any(c.experts is None for c in self.plans)):
            raise ValueError(f"the plans of one worker hold the experts in different ways ({sorted(ways)}); "
                             "a group's templates share one")
        return next((c.experts for c in self.plans if c.experts is not None), None)

    def initial_residency(self) -> Residency:
        """Where weights are placed at load: every plan's host blocks (shared), else the first plan's."""
        per_plan = [Residency.of_config(c) for c in self.plans]
        if self.residency == "shared":
            return Residency.union(per_plan)
        return per_plan[0] if per_plan else Residency()


class LoadedModel(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: str
    device: str
    dtype: str
    parameters: int
    device_bytes: int = Field(description="weight bytes placed on the device at load")
    host_bytes: int = Field(description="weight bytes placed on (pinned) host memory at load")
    host_buffer_bytes: int = Field(default=0, description="the exact-size host buffers holding them")
    host_pinned_bytes: int = Field(default=0, description="of those, page-locked (CUDA; meta stands for it)")
    host_pow2_bytes: int = Field(default=0, description="what pinning the same tensors one by one with torch's "
                                                        "pinned allocator holds (power-of-two blocks)")
    host_shared_bytes: int = Field(default=0, description="of the buffers, the node's shared segments")
    host_attached_bytes: int = Field(default=0, description="of the shared segments, those another worker filled")
    transient_bytes: int = Field(default=0, description="most anonymous host memory the load held at once beyond "
                                                        "the buffers")
    host_copy_bytes: int = Field(default=0, description="device-homed weight bytes copied from the node's host copy")
    source_s: float = Field(default=0.0, ge=0, description="weight phase: seconds reading (or generating) values into "
                                                          "their host slot or home; near zero when the host copy was mapped")
    device_copy_s: float = Field(default=0.0, ge=0, description="weight phase: seconds copying the host copy to the device")
    host_blocks: tuple[int, ...] = Field(description="DiT blocks homed on the host")
    text_encoder: str | None = Field(default=None, description="where the text encoder runs (None: stand-in embeddings)")
    layout_status: str | None = Field(default=None, description="the plans' static layouts: armed per batch, or why not")
    adapters: tuple[str, ...] = Field(default=(), description="LoRA adapters loaded (names)")
    adapters_refused: tuple[str, ...] = Field(default=(), description="adapter files refused at load, each with why")


class Worker(WorkerBase):
    """One GPU (or CPU slot) of a worker set.

    Example (SP = 1, one process)::

        w = Worker()
        w.init_device(ParallelConfig(rank=0, world_size=1))
        w.load_model(ModelLoadConfig(model="tiny-flux2"))
        result = w.execute(batch)

    ``static_allocator``: on CUDA, install libxema_alloc as torch's allocator (before anything
    touches CUDA) and arm the plans' layouts; on a CPU, the same library's host arena stands in
    for the device (each batch's tensors mirrored into it, its limit the budget less the weights),
    so layouts arm and a batch that outgrows it fails as ``DeviceOutOfMemory`` as on a GPU.

    ``adapters``: the loaded model's LoRA adapter pool (``WorkerAdapters``; None when its group
    serves none), which the worker set's adapter calls reach.
    """

    def __init__(self, platform: Platform | str | None = None, sp_backend: SPBackend = "auto", arm_layout: ArmLayout | None = None,
                 static_allocator: bool = False) -> None:
        super().__init__()  # the preemptible runs' bookkeeping
        self.platform = get_platform(platform) if isinstance(platform, str) else (platform or current_platform())  # type: ignore[arg-type]
        self.sp_backend: SPBackend = sp_backend
        self.arm_layout = arm_layout
        self.allocator: Any = None
        #: layout_ref -> its artifact, validated at load (hash, version, GPU model), and the plan armed per batch
        self.layouts: dict[str, Any] = {}
        self._step_plans: dict[tuple[str, int], Any] = {}  # (layout, requested steps) -> its repeated plan
        self._plans: dict[str, Any] = {}
        self.layout_status: str | None = None
        self.arena: Any = None  # TemplateArena: the static allocator's arena, following the template run
        self.alloc_device = 0  # the allocator's device index (a host arena's own slot on a CPU worker)
        self._mirror_host = False  # a CPU worker's batches mirrored into the host arena (allocator.host_tensors)
        self._run_residency: dict[str, Residency] = {}  # each preemptible run's residency
        self._run_moved: dict[str, int] = {}  # weight bytes the resumes' residency switches moved
        if self.platform.name == "cuda":
            from xema_ray.allocator.cuda import install_cuda_allocator, pin_kernels

            if static_allocator:
                # first, before anything touches CUDA: the pluggable allocator is process-wide and
                # must be installed before the caching allocator initialises
                # (docs/measured-facts.md, "The pluggable allocator");
                # nothing above initialised CUDA (the platform object is stateless; topology is NVML)
                self.allocator = install_cuda_allocator()
                self.arm_layout = arm_layout or self._arm
            # the kernels a layout (and the analyzer) assume: cudnn.benchmark off, SDPA pinned; flags only
            pin_kernels()
        elif static_allocator and self.platform.allocator_backend == "host":
            # the emulated asynchronous device (tests): the host arena is its device memory
            from xema_ray.allocator.emulated import install_host_allocator
            from xema_ray.allocator.host_tensors import claim_host_device

            self.alloc_device = claim_host_device()
            self.allocator = install_host_allocator(self.platform, self.alloc_device)
            self.arm_layout = arm_layout or self._arm
        elif static_allocator and self.platform.name == "cpu":
            # the host arena stands in for the device: each batch's tensors are mirrored into it, so
            # its layouts arm, its limit (the budget) holds and out of memory fails the batch as on CUDA
            from xema_ray.allocator.host_tensors import claim_host_device
            from xema_ray.allocator.runtime import StaticAllocator

            self.allocator = StaticAllocator("host")
            self.alloc_device = claim_host_device()
            self.arm_layout = arm_layout or self._arm
            self._mirror_host = True
        self.groups: ProcessGroups | None = None
        self.device: torch.device | None = None
        self.engine: ExecutionEngine | None = None
        self.adapters: WorkerAdapters | None = None
        self.residency: ResidencyManager | None = None
        self.load_config: ModelLoadConfig | None = None
        #: how many times a model was built: SP switches must leave it at 1
        self.load_count = 0

    def device_topology(self, local_index: int = 0) -> tuple[str, list[str]]:
        """This worker's device id and its direct-link peers (for NVLink-aware rank order)."""
        dev, peers = self.platform.device_topology(local_index)
        return dev, sorted(peers)

    def init_device(self, parallel: ParallelConfig, local_index: int = 0) -> None:
        """Bind this process's device and create every SP process group of the worker set."""
        self.platform.set_device(local_index)
        self.device = self.platform.device(local_index)
        self.groups = init_process_groups(parallel)

    def load_model(self, load: ModelLoadConfig) -> LoadedModel:
        """Build the pipeline on this worker's device (replacing any previous model), each weight
        placed once where ``load``'s plans keep it: the device never holds a block they offload."""
        if self.device is None:
            raise ValueError("call init_device before load_model")
        if load.emulation is not None:
            raise ValueError("this load config is for emulated workers (device: emulated), not a real one")
        spec = get_model_spec(load.model)
        for c in load.plans:
            if c.template.model != spec.name:
                raise ValueError(f"a plan for {c.template.key} was given to a worker loading {spec.name}")
        dtype, kept = model_dtypes(spec, load.dtype, load.component_dtypes)
        residency = load.initial_residency()
        experts = load.expert_swap()
        self._drop_model()  # drop the previous model before placing the next
        expert_homes: tuple[str, ...] = ()
        if experts is not None:
            from xema_ray.mitigation.expert_swap import expert_host_modules
            from xema_ray.runtime.residency import block_paths

            expert_homes = expert_host_modules(experts, block_paths(spec))
        host_modules = tuple(dict.fromkeys((*residency.host_modules(spec), *expert_homes)))
        opts = BuildOptions(device=str(self.device), dtype=dtype, weights_dir=load.weights_dir, seed=load.seed,
                            component_dtypes=kept,
                            host_modules=host_modules, place_on_meta=True,
                            text_encoder=load.encoder_placement(),  # type: ignore[arg-type]
                            share_host=load.shares_host(self.platform.name), app=load.app,
                            host_copy=load.host_copy, host_holder=load.host_copy_holder,
                            placed=None if own_weights(load) == "model" else quantize_as_placed(spec, own_weights(load)))
        pipe = spec.build_pipeline(opts)
        placement = opts.encoder_placement()
        self.engine = ExecutionEngine(
            pipe, spec, self.device, dtype, groups=self.groups, platform=self.platform,
            arm_layout=self.arm_layout, sp_backend=self.sp_backend, text_encoder_placement=placement or "device",
        )
        quantized_bytes = hold_weight_formats(self.engine, load)
        self.residency = ResidencyManager(spec, pipe.transformer, residency)
        swapped = 0
        if experts is not None and experts.strategy == "swap_prefetched":
            # both experts homed on the host; the high-noise one comes to the device now
            from xema_ray.mitigation.expert_swap import ExpertSwapper

            self.engine.experts = ExpertSwapper(pipe, spec)
            swapped = self.engine.experts.block_bytes
        self._scheduler_as_loaded = copy.deepcopy(pipe.scheduler)  # no call's state yet
        placed = PlacementReport()
        for comp in pipe.components.values():
            report = getattr(comp, PLACEMENT_ATTR, None)
            if report is not None:
                placed.add(report)
        if self._mirror_host:
            # the host arena is the device less its weights (placed at load, never mirrored): a
            # batch that would not fit next to them on a budget-sized device does not fit here
            limit = (max(1, load.budget_bytes - placed.device_bytes - swapped - quantized_bytes)
                     if load.budget_bytes is not None else 0)
            self.allocator.set_limit(limit, device=self.alloc_device)
            # on a CPU host and device are one memory: the embedding cache (host-side on a GPU)
            # would keep a batch's mirrored blocks, static ones included, alive past the batch
            from xema_ray.runtime.text import EmbeddingCache

            self.engine.prompts.cache = EmbeddingCache(0)
        self.adapters, refused = install_adapters(self.engine, load.adapters, load.adapter_sources,
                                                  self.platform.synchronize)
        self._load_layouts(load)
        self.load_config = load
        self.load_count += 1
        params = sum(p.numel() for p in pipe.transformer.parameters())
        return LoadedModel(model=spec.name, device=str(self.device), dtype=str(dtype).removeprefix("torch."),
                           parameters=params, device_bytes=placed.device_bytes + swapped + quantized_bytes,
                           host_bytes=placed.host_bytes,
                           host_buffer_bytes=placed.host_buffer_bytes, host_pinned_bytes=placed.host_pinned_bytes,
                           host_pow2_bytes=placed.host_pow2_bytes, host_shared_bytes=placed.host_shared_bytes,
                           host_attached_bytes=placed.host_attached_bytes, transient_bytes=placed.transient_bytes,
                           host_copy_bytes=placed.host_copy_bytes, source_s=placed.source_s,
                           device_copy_s=placed.device_copy_s, host_blocks=residency.host_blocks, text_encoder=placement,
                           layout_status=self.layout_status, adapters_refused=tuple(refused),
                           adapters=tuple(i.name for i in self.list_adapters()))

    # ------------------------------------------------------------------ adapters (the worker set's collective_rpc)
    def _pool(self) -> WorkerAdapters:
        if self.adapters is None:
            raise AdapterRejected(NO_POOL, "")
        return self.adapters

    def add_adapter(self, source: AdapterSource) -> AdapterInfo:
        """``WorkerAdapters.add``; raises ``AdapterRejected`` (nothing changed)."""
        return self._pool().add(source)

    def remove_adapter(self, name: str) -> bool:
        return self._pool().remove(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.info() if self.adapters is not None else []

    def adapter_stats(self) -> PoolStats | None:
        return self.adapters.stats() if self.adapters is not None else None

    def _load_layouts(self, load: ModelLoadConfig) -> None:
        """Read and check every plan's layout (version, content hash, GPU model); on CUDA with the
        static allocator installed, reserve the arena's dynamic region for all of them and warm
        up once (the static region follows the template: ``xema_ray.runtime.arena``)."""
        from xema_ray.runtime.arena import ArenaEntry, TemplateArena
        from xema_ray.allocator.artifact import load_artifact

        refs = sorted({c.layout_ref for c in load.plans if c.layout_ref is not None})
        self.layouts = {}
        self._step_plans: dict[tuple[str, int], Any] = {}
        self.arena = None
        if not refs:
            self.layout_status = None
            return
        if load.layouts_dir is None:
            raise ValueError(f"plans name static layouts {refs} but no layouts_dir was given (the plan table's .layouts folder)")
        gpu = self.platform.hardware_name() if self.platform.name == "cuda" else None
        for ref in refs:
            art = load_artifact(Path(load.layouts_dir), ref, gpu=gpu)
            self.layouts[ref] = art
            self._plans[ref] = art.replay_plan()
        if self.allocator is None:
            why = ("the static allocator is a CUDA pluggable allocator; this worker runs on "
                   f"{self.platform.name}" if self.platform.name != "cuda" else "the worker was started without it")
            self.layout_status = f"{len(refs)} layout(s) loaded and validated; not armed: {why}"
            return
        from xema_ray.hash_seed import seeded, unseeded_reason

        if not seeded():  # the stream would not be the one solved: every planned allocation would miss
            self.layout_status = f"{len(refs)} layout(s) loaded and validated; not armed: {unseeded_reason()}"
            return
        self.arena = TemplateArena(self.allocator, {r: ArenaEntry(a.loaded_bytes, a.reserved_bytes)
                                                    for r, a in self.layouts.items()}, load.budget_bytes,
                                   device=self.alloc_device)
        self.arena.reserve()
        # cuBLAS workspaces (one per handle and stream, on the first matmul) and attention scratch
        # land in the dynamic region now, once, instead of derailing the first armed batch's plan
        # (the host backend, in CPU tests, has none)
        self.allocator.warm_up(None if self.allocator.backend == "cuda" else (lambda: None), device=self.alloc_device)
        self.layout_status = self.arena.describe()

    @contextlib.contextmanager
    def _arm(self, layout_ref: str, steps: int) -> Iterator[RequestReport | None]:
        """Arm ``layout_ref``'s plan at ``steps`` denoising steps for the batch (``ArmLayout``) and
        yield its report, filled at exit; None, arming nothing, where nothing was reserved for it
        (no arena: an unseeded process, see ``_load_layouts``) or it was not loaded, as
        ``layout_status`` / the batch's ``layout_note`` say."""
        plan = self._step_plan(layout_ref, steps)
        if plan is None or self.allocator is None or self.arena is None:
            yield None
            return
        with self.allocator.armed(plan, device=self.alloc_device) as report:
            yield report

    def _step_plan(self, layout_ref: str, steps: int) -> Any:
        """``layout_ref``'s replay plan at ``steps`` steps: the one loaded with the layout at its
        solved count, else repeated to them (cached); None where it was not loaded or does not
        repeat to them."""
        art = self.layouts.get(layout_ref)
        if art is None:
            return None
        if steps == art.steps:
            return self._plans[layout_ref]
        key = (layout_ref, steps)
        if key not in self._step_plans:
            self._step_plans[key] = art.plan_for_steps(steps)
        return self._step_plans[key]

    def _switch(self, layout_ref: str | None, move: Any) -> tuple[Any, str | None]:
        """The residency switch ``move`` for a batch of ``layout_ref`` (None: it runs disarmed),
        with the arena following it; returns its report and why the batch cannot arm its layout."""
        if self.arena is None:
            # the allocator is installed but reserved no arena (an unseeded process): arming would
            # fail, so the batch runs disarmed and says why, as the load did
            why = (f"{layout_ref} not armed for this batch: {self.layout_status}"
                   if layout_ref is not None and self.allocator is not None and self.layout_status is not None else None)
            return move(), why
        out = self.arena.switch(layout_ref, move)
        if out.not_armed is None or layout_ref is None:
            return out.moved, None
        return out.moved, f"{layout_ref} not armed for this batch: {out.not_armed}"

    def layout_reserved_bytes(self) -> int:
        """Device bytes the static allocator holds now (arena + driver blocks; 0 when not installed)."""
        return self.allocator.stats(device=self.alloc_device).reserved_bytes if self.allocator is not None else 0

    def target_residency(self, config: ExecutionConfig) -> Residency:
        """The residency a batch of ``config`` runs under (the group's shared one, or its plan's)."""
        assert self.load_config is not None and self.residency is not None
        if self.load_config.residency == "shared":
            return self.residency.current
        return Residency.of_config(config)

    # ------------------------------------------------------------------ batches (WorkerBase's hooks)
    # ``execute`` (WorkerBase): first the residency is switched to the batch's, moving only the blocks
    # whose home changes; ``resume`` switches back to the paused batch's own residency.
    def _loaded(self) -> bool:
        return self.engine is not None and self.residency is not None

    def _state_device(self) -> torch.device | None:
        return self.device

    def _before_resume(self, run_id: str) -> None:
        assert self.residency is not None
        residency = self.residency
        # back to the batch's own residency; it continues disarmed (its allocation order restarted),
        # so the static region goes before its weights come back
        moved = self._switch(None, lambda: residency.switch(self._run_residency[run_id]))[0].bytes_moved
        self._run_moved[run_id] = self._run_moved.get(run_id, 0) + moved

    def _finished(self, run_id: str, result: BatchResult, run: PreemptibleRun) -> dict[str, Any]:
        moved = self._run_moved.pop(run_id, 0)
        return {**super()._finished(run_id, result, run), "residency_bytes_moved": result.residency_bytes_moved + moved}

    def _forget(self, run_id: str) -> None:
        super()._forget(run_id)
        self._run_residency.pop(run_id, None)
        self._run_moved.pop(run_id, None)

    def _run_batch(self, batch: Batch, observer: StepObserver | None, control: Any) -> BatchResult:
        assert self.engine is not None and self.residency is not None
        target = self.target_residency(batch.config)
        residency = self.residency
        c = batch.config  # as planned (its layout_ref is dropped below if it cannot arm)
        entry = c.template.key + (f" (layout {c.layout_ref})" if c.layout_ref is not None else "")
        layout_ref, steps_note = c.layout_ref, None
        if layout_ref in self.layouts and self._step_plan(layout_ref, batch.steps) is None:
            # a layout repeats its step window only to counts of its parity, from its solved steps
            # on: another count runs on the dynamic region (same residency, same mitigations)
            steps_note = (f"{layout_ref} not armed for this batch: solved for {c.template.steps} denoising steps, "
                          f"it does not repeat to {batch.steps}")
            layout_ref = None
        switch, not_armed = self._switch(layout_ref, lambda: residency.switch(target))
        not_armed = not_armed or steps_note
        if control is not None:
            self._run_residency[control.run_id] = target
        config = with_residency(batch.config, self.residency.current)
        if not_armed is not None:  # runs as without a layout: the dynamic region, then the driver
            config = config.model_copy(update={"layout_ref": None})
        if config is not batch.config:
            batch = batch.model_copy(update={"config": config})
        result = self._execute_guarded(batch, observer, control, entry)  # its layout hits: the engine's report
        return result.model_copy(update={"residency_bytes_moved": switch.bytes_moved,
                                         "host_weight_bytes": self.residency.host_bytes(),
                                         "layout_status": self.layout_status,
                                         "layout_note": not_armed,
                                         "layout_reserved_bytes": self.layout_reserved_bytes()})

    def _execute_guarded(self, batch: Batch, observer: StepObserver | None, control: Any, entry: str) -> BatchResult:
        """``engine.execute``, a batch that ran out of device memory failing alone as
        ``DeviceOutOfMemory`` (``xema_ray.runtime.out_of_memory``); on a CPU worker with the host
        arena, its tensors mirrored into it."""
        assert self.engine is not None
        alloc, dev = self.allocator, self.alloc_device
        before = alloc.out_of_memory(device=dev) if alloc is not None else None
        mirror: Any = contextlib.nullcontext()
        if self._mirror_host:
            from xema_ray.allocator.host_tensors import HostArenaTensors

            mirror = HostArenaTensors(alloc, device=dev)
        try:
            with mirror:
                return self.engine.execute(batch, observer, control)
        except (RuntimeError, MemoryError) as e:  # torch's, the host arena's, torch.OutOfMemoryError
            record = alloc.out_of_memory(device=dev).since(before) if alloc is not None else None
            failure = device_out_of_memory(e, entry, str(self.device), record)
            if failure is None:
                raise
        finally:
            if self.arena is not None:
                # what the pipeline keeps of a batch after it: the scheduler's timesteps and sigmas
                # (diffusers' set_timesteps puts them on the device), allocated under the batch's
                # plan. Left there they hold static blocks past the batch, so the next switch cannot
                # re-size the static region and the next batch runs disarmed (or its plan falls back
                # at their offsets). (The engine keeps no prompt embeddings past the batch.)
                self.engine.pipe.scheduler = copy.deepcopy(self._scheduler_as_loaded)
        # out of the except block: the batch's frames (and tensors) went with the dropped tracebacks
        gc.collect()
        self.platform.release_cached_memory()
        raise failure

    def _drop_model(self) -> None:
        """Forget the loaded model and release its host buffers (the last worker of the node
        holding a shared segment removes it)."""
        from xema_ray.models.host_pack import close_host_buffers

        if self.engine is not None:
            comps = list(self.engine.pipe.components.values())
            if self.residency is not None:
                comps += [b for _, b in self.residency.blocks]
            close_host_buffers(comps)
        self.engine = None
        self.residency = None
        self.adapters = None

    def shutdown(self) -> None:
        """Drop the model and leave the worker set."""
        self._drop_model()
        if self.groups is not None:
            self.groups.shutdown()
            self.groups = None
