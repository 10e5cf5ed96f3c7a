"""The emulated worker: the worker interface (``xema_ray.runtime.worker_base``) on a GPU that is not there.

It loads no weights and does no math. A batch takes its plan entry's time, phase by phase — text
encoding, every denoising step, the decode — plus the residency switches and the pause/resume
state moves the real worker would make, all divided by the deployment's ``time_scale``; it
reports the plan's memory figures (planned peak, paused bytes) as its own. Everything around it
is the real thing: the per-step observer (progress, cancel), step-level pause and resume on a
thread of its own (``PreemptibleRun``), the SP group's per-step agreement over gloo, the model
group's dispatcher, router and job store. Outputs are valid PNG / MP4 files of the requested
size, marked as emulated (``xema_ray.runtime.emulated_media``), and say ``emulated: true``.

The phases come from the plan table (``xema_ray.runtime.emulation``), given with the load config.

Example (one worker, no Ray)::

    emu = emulation_for(table, time_scale=100)
    w = EmulatedWorker(emu)
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model="cogvideox-5b", plans=(entry.config,)))
    result = w.execute(batch)
"""

from __future__ import annotations

import threading
import time
from typing import Any

from xema_ray.parallel.groups import ParallelConfig, ProcessGroups, init_process_groups
from xema_ray.platforms import MemoryStats
from xema_ray.platforms.emulated import EmulatedPlatform
from xema_ray.runtime.emulated_media import EmulatedMedia
from xema_ray.runtime.emulation import (  # noqa: F401 - re-exported: the emulated box's API in one place
    DEFAULT_HOST_BANDWIDTH,
    EmulatedPhases,
    EmulationConfig,
    emulation_for,
    plan_phases,
    scale_table,
)
from xema_ray.runtime.engine import DEFAULT_VIDEO_FPS, Batch, BatchResult, PhaseTimings, RequestOutput
from xema_ray.runtime.progress import VOTE_PAUSE, VOTE_PAUSE_OFFLOAD, VOTE_STOP, BatchCancelled, StepObserver, step_vote
from xema_ray.runtime.worker import LoadedModel, ModelLoadConfig
from xema_ray.runtime.worker_base import WorkerBase

# ---------------------------------------------------------------------------- the worker
def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class EmulatedWorker(WorkerBase):
    """One emulated GPU of a worker set (``WorkerBase``, as ``Worker``; see the module docstring).

    Constructed as the worker set constructs every worker (``worker_set.WORKER_KINDS["emulated"]``);
    the templates' phases arrive with the load config (``ModelLoadConfig.emulation``).

    Args:
        platform: ignored beyond its name (the platform is the emulated one).
        static_allocator: ignored (nothing is allocated).
        emulation: the phases, for a worker used without a load config's (tests).
    """

    def __init__(self, platform: Any = None, static_allocator: bool = False,
                 emulation: EmulationConfig | None = None) -> None:
        super().__init__()  # the preemptible runs' bookkeeping (pause, resume: as ``Worker``'s)
        self.emulation = emulation
        # NVLink pairs (the A6000 box) until the load config names the emulated hardware
        self.platform = EmulatedPlatform("emulated GPU", nvlink_domain=2) if emulation is None \
            else EmulatedPlatform(emulation.hardware, emulation.nvlink_domain)
        self.groups: ProcessGroups | None = None
        self.load_config: ModelLoadConfig | None = None
        self.load_count = 0
        self.media = EmulatedMedia()
        self._template: str | None = None  # whose residency the worker holds (per_template switches)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def _config(self) -> EmulationConfig:
        if self.emulation is None:
            raise ValueError("no model loaded: call load_model first")
        return self.emulation

    def device_topology(self, local_index: int = 0) -> tuple[str, list[str]]:
        dev, peers = self.platform.device_topology(local_index)
        return dev, sorted(peers)

    def init_device(self, parallel: ParallelConfig, local_index: int = 0) -> None:
        """Join the worker set: the SP groups are real gloo groups (the per-step agreement runs on them)."""
        self.groups = init_process_groups(parallel)

    def load_model(self, load: ModelLoadConfig) -> LoadedModel:
        """Load nothing; check that every plan of the group is emulated; render the outputs in the background."""
        if self.groups is None:
            raise ValueError("call init_device before load_model")
        if load.emulation is not None:
            self.emulation = load.emulation
            self.platform = EmulatedPlatform(load.emulation.hardware, load.emulation.nvlink_domain)
        if self.emulation is None:
            raise ValueError("an emulated worker takes its latencies from the plan table: the load config has no emulation")
        missing = [c.template.shape_key for c in load.plans if c.template.shape_key not in self.emulation.templates]
        if missing:
            raise ValueError(f"no emulated phases for {', '.join(missing)}; emulated: {', '.join(sorted(self.emulation.templates))}")
        self.load_config = load
        self.load_count += 1
        keys = [c.template.shape_key for c in load.plans]
        threading.Thread(target=self._render_all, args=(keys,), name="xema-emulated-render", daemon=True).start()
        return LoadedModel(model=load.model, device=self.device_topology()[0], dtype="bfloat16", parameters=0,
                           device_bytes=0, host_bytes=0, host_blocks=(), text_encoder=None,
                           layout_status="emulated: no weights, no static layout")

    def _render_all(self, keys: list[str]) -> None:
        for k in keys:
            self._media(k)

    def _media(self, key: str) -> bytes:
        ph = self._config().templates[key]
        return self.media.get(key, ph.width, ph.height, ph.frames, ph.fps or DEFAULT_VIDEO_FPS, ph.video)

    # ------------------------------------------------------------------ batches
    # ``execute``, ``pause``, ``resume`` (WorkerBase): the batch's time passes, step by step; the
    # batch's own residency switch and state move on resume are emulated on its thread
    def _loaded(self) -> bool:
        return self.load_config is not None

    def _switch_to(self, key: str) -> float:
        """Emulated seconds of the residency switch to ``key``'s plan (0 when it is already held)."""
        with self._lock:
            prev, self._template = self._template, key
        if prev is None or prev == key:
            return 0.0
        return self._config().switch_s.get(prev, {}).get(key, 0.0)

    def _run_batch(self, batch: Batch, observer: StepObserver | None, control: Any) -> BatchResult:
        assert self.groups is not None
        config = batch.config
        key = config.template.shape_key
        ph = self._config().templates.get(key)
        if ph is None:
            raise ValueError(f"batch for {key}, which this emulated worker set has no plan for")
        group = self.groups.select(config.ulysses, config.ring) if config.sp > 1 else None
        output_rank = group is None or group.rank == 0
        f = ph.factor(len(batch.requests))
        ph = ph.model_copy(update={"steps": batch.steps})  # the batch's step count, each step the template's time
        t0 = time.perf_counter()
        start = t0 + self._switch_to(key)  # the batch's phases begin once its residency is in place
        text_end = start + ph.text_s * f
        data = self._media(key) if output_rank else b""  # rendered at load: normally a cache hit
        _sleep_until(text_end)
        denoise_from = time.perf_counter()
        shift = 0.0  # time the batch spent not running (paused, moving state)
        for step in range(1, ph.steps + 1):
            _sleep_until(text_end + shift + step * ph.denoise_step_s * f)
            vote = step_vote(observer, control, step, ph.steps, group, output_rank)
            if vote == VOTE_STOP:
                raise BatchCancelled(step)
            if vote in (VOTE_PAUSE, VOTE_PAUSE_OFFLOAD) and control is not None:
                parked = time.perf_counter()
                offload = vote == VOTE_PAUSE_OFFLOAD
                state = ph.pause_bytes or 0
                move = self._config().move_s(state) if offload else 0.0
                time.sleep(move)  # the state leaves the device before the preempting batch may start
                control.hold(step, ph.steps, state, offload, move)
                # resumed: the batch's residency comes back (the preemptor may have switched it), then its state
                time.sleep(self._switch_to(key) + move)
                shift += time.perf_counter() - parked
        decode_from = time.perf_counter()
        _sleep_until(text_end + shift + ph.steps * ph.denoise_step_s * f + ph.decode_s * f)
        end = time.perf_counter()
        if observer is not None and output_rank:
            observer.on_decoded()
        outputs = []
        if output_rank:
            frames = ph.frames if ph.video else 1
            outputs = [RequestOutput(request_id=r.request_id, seed=r.seed, media_type="video/mp4" if ph.video else "image/png",
                                     data=data, width=ph.width, height=ph.height, frames=frames, emulated=True)
                       for r in batch.requests]
        return BatchResult(
            template=config.template.key, config_hash=config.config_hash(), sp_rank=group.rank if group is not None else 0,
            outputs=outputs,
            timings=PhaseTimings(text_s=denoise_from - t0, denoise_s=max(0.0, decode_from - denoise_from - shift),
                                 decode_s=end - decode_from, encode_s=0.0, total_s=time.perf_counter() - t0),
            memory=MemoryStats(source="plan (emulated)", peak_bytes=ph.peak_bytes, current_bytes=0),
            mitigations=len(config.mitigations), layout_armed=False, layout_status="emulated",
        )

    def layout_reserved_bytes(self) -> int:
        return 0

    def shutdown(self) -> None:
        """Leave the worker set."""
        self.load_config = None
        if self.groups is not None:
            self.groups.shutdown()
            self.groups = None

