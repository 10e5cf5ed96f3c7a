"""The emulated worker: the worker interface of ``xema_ray.runtime.worker`` on a GPU that is not there.

It loads no weights and does no math. A batch takes its plan entry's time, phase by phase — text
encoding, every denoising step, the decode — plus the residency switches and the pause/resume
state moves the real worker would make, all divided by the deployment's ``time_scale``; it
reports the plan's memory figures (planned peak, paused bytes) as its own. Everything around it
is the real thing: the per-step observer (progress, cancel), step-level pause and resume on a
thread of its own (``PreemptibleRun``), the SP group's per-step agreement over gloo, the model
group's dispatcher, router and job store. Outputs are valid PNG / MP4 files of the requested
size, marked as emulated (``xema_ray.runtime.emulated_media``), and say ``emulated: true``.

The phase split comes from the plan: the entry's ``latency_s`` is the total; the cost model of
the table's hardware divides what it estimates between the denoising loop and the decode, and
what the plan adds beyond the cost model (the planned text encoder) is the text phase. A table
for hardware without a profile falls back to the model group's own prior (5 % decode for
images, 10 % for videos).

Example (one worker, no Ray)::

    emu = emulation_for(table, time_scale=100)
    w = EmulatedWorker(emu)
    w.init_device(ParallelConfig(rank=0, world_size=1))
    w.load_model(ModelLoadConfig(model="cogvideox-5b", plans=(entry.config,)))
    result = w.execute(batch)
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.parallel.groups import ParallelConfig, ProcessGroups, init_process_groups
from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.platforms import MemoryStats
from xema_ray.platforms.emulated import EmulatedPlatform
from xema_ray.runtime.emulated_media import EmulatedMedia
from xema_ray.runtime.engine import DEFAULT_VIDEO_FPS, Batch, BatchResult, PhaseTimings, RequestOutput
from xema_ray.runtime.preemption import PausedRun, PreemptibleRun
from xema_ray.runtime.progress import VOTE_PAUSE, VOTE_PAUSE_OFFLOAD, VOTE_STOP, BatchCancelled, StepObserver, step_vote
from xema_ray.runtime.worker import LoadedModel, ModelLoadConfig

#: bytes/s of a paused state's move to the host and back (the dispatcher's PreemptionPolicy default)
DEFAULT_HOST_BANDWIDTH = 20e9


class EmulatedPhases(BaseModel):
    """One template's full batch on the emulated box, in emulated seconds (reference / time_scale)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(ge=1)
    text_s: float = Field(ge=0, description="text encoding (the plan's encoder placement)")
    step_s: float = Field(ge=0, description="one denoising step")
    decode_s: float = Field(ge=0, description="VAE decode and post-processing")
    latency_by_batch: dict[int, float] = Field(default_factory=dict, description="a partial batch of n: its total")
    peak_bytes: int = Field(ge=0, description="the plan's device peak per worker")
    pause_bytes: int | None = Field(default=None, ge=0, description="the plan's between-step state")
    video: bool
    width: int
    height: int
    frames: int
    fps: float = Field(gt=0)

    @property
    def total_s(self) -> float:
        return self.text_s + self.steps * self.step_s + self.decode_s

    def factor(self, n: int) -> float:
        """How much longer or shorter than the full batch a batch of ``n`` requests takes."""
        total = self.total_s
        return self.latency_by_batch[n] / total if n in self.latency_by_batch and total > 0 else 1.0


class EmulationConfig(BaseModel):
    """What an emulated worker set needs: its templates' phases and the group's move costs (JSON
    across the app -> model group -> worker boundary)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    time_scale: float = Field(gt=0, description="reference seconds per emulated second")
    hardware: str = Field(description="the emulated GPU model, e.g. 'NVIDIA RTX A6000'")
    nvlink_domain: int = Field(default=1, ge=1, description="GPUs per NVLink domain (pairs on the A6000 box)")
    templates: dict[str, EmulatedPhases] = Field(description="shape key -> phases")
    switch_s: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="emulated seconds of a residency switch, switch_s[from][to] (per_template)")
    host_bandwidth: float = Field(default=DEFAULT_HOST_BANDWIDTH, gt=0,
                                  description="reference bytes/s of a paused state's move to the host and back")

    def move_s(self, nbytes: int) -> float:
        """Emulated seconds of one move of ``nbytes`` between the device and the host."""
        return nbytes / self.host_bandwidth / self.time_scale


# ---------------------------------------------------------------------------- from the plan table
def _profile_of(table: PlanTable) -> Any:
    from xema_ray.profiling.hardware import HARDWARE

    for p in HARDWARE.values():
        if p.name in table.hardware:
            return p
    return None


def plan_phases(entry: PlanEntry, profile: Any) -> tuple[float, float, float]:
    """(text, denoise, decode) reference seconds of ``entry``'s batch, summing to its latency."""
    total = entry.prediction.latency_s
    video = entry.config.template.spec.kind == "video"
    if profile is None:
        decode = (0.10 if video else 0.05) * total
        return 0.0, total - decode, decode
    from xema_ray.profiling import estimate_latency

    est = estimate_latency(entry.config, profile).per_phase
    denoise, decode = est.get("denoise", 0.0), est.get("decode", 0.0)
    model = denoise + decode
    text = max(0.0, total - model - est.get("setup", 0.0)) + est.get("setup", 0.0)
    rest = total - min(text, total)
    if model <= 0:
        return total - rest, rest, 0.0
    return total - rest, rest * denoise / model, rest * decode / model


def emulation_for(table: PlanTable, time_scale: float, keys: list[str] | None = None,
                  host_bandwidth: float = DEFAULT_HOST_BANDWIDTH) -> EmulationConfig:
    """The emulation of ``table``'s plans (all, or ``keys``) at ``time_scale``.

    Args:
        table: the reference plan table (latencies in the reference box's seconds).
        time_scale: reference seconds per emulated second (100: a 2,154 s request takes 21.5 s).
        keys: the templates to emulate (default: every entry).
        host_bandwidth: reference bytes/s of a paused state's move.
    """
    from xema_ray.runtime.engine import DEFAULT_VIDEO_FPS as fps_default

    profile = _profile_of(table)
    phases = {}
    for key in keys if keys is not None else sorted(table.entries):
        e = table.entries[key]
        t = e.config.template
        text, denoise, decode = plan_phases(e, profile)
        phases[key] = EmulatedPhases(
            steps=t.steps, text_s=text / time_scale, step_s=denoise / t.steps / time_scale, decode_s=decode / time_scale,
            latency_by_batch={n: s / time_scale for n, s in e.prediction.latency_by_batch.items()},
            peak_bytes=e.prediction.peak_bytes, pause_bytes=e.prediction.pause_bytes, video=t.spec.kind == "video",
            width=t.width, height=t.height, frames=t.frames, fps=float(getattr(t.spec, "frame_rate", fps_default)))
    switch: dict[str, dict[str, float]] = {}
    for r in table.residency.values():
        if r.policy == "per_template":
            for a, row in r.switch_s.items():
                if a in phases:
                    switch[a] = {b: s / time_scale for b, s in row.items() if b in phases}
    return EmulationConfig(time_scale=time_scale, hardware=profile.gpu_model if profile is not None else table.hardware,
                           nvlink_domain=profile.nvlink_domain if profile is not None else 1,
                           templates=phases, switch_s=switch, host_bandwidth=host_bandwidth)


def scale_table(table: PlanTable, time_scale: float | dict[str, float]) -> PlanTable:
    """``table`` on the emulated clock: every latency, SLO and switch cost divided by ``time_scale``
    (what the dispatcher, the router's hints and the job progress of an emulated box use); a dict
    gives each model its own scale (models it does not name keep theirs)."""
    def ts(model: str) -> float:
        return time_scale.get(model, 1.0) if isinstance(time_scale, dict) else time_scale

    entries = {}
    for k, e in table.entries.items():
        p = e.prediction
        time_scale_ = ts(e.config.template.model)
        entries[k] = e.model_copy(update={"prediction": p.model_copy(update={
            "latency_s": p.latency_s / time_scale_, "slo_s": p.slo_s / time_scale_,
            "goodput_rps": p.goodput_rps * time_scale_,
            "latency_by_batch": {n: s / time_scale_ for n, s in p.latency_by_batch.items()}})})
    residency = {m: r.model_copy(update={"switch_s": {a: {b: s / ts(m) for b, s in row.items()}
                                                      for a, row in r.switch_s.items()}})
                 for m, r in table.residency.items()}
    return table.model_copy(update={"entries": entries, "residency": residency,
                                    "provenance": {**table.provenance, "emulated_time_scale": str(time_scale)}})


# ---------------------------------------------------------------------------- the worker
def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class EmulatedWorker:
    """One emulated GPU of a worker set (same interface as ``Worker``; see the module docstring).

    Args:
        emulation: the templates' phases and move costs (``EmulationConfig`` or its JSON).
    """

    def __init__(self, emulation: EmulationConfig | str, **_: Any) -> None:
        self.emulation = emulation if isinstance(emulation, EmulationConfig) else EmulationConfig.model_validate_json(emulation)
        self.platform = EmulatedPlatform(self.emulation.hardware, self.emulation.nvlink_domain)
        self.groups: ProcessGroups | None = None
        self.load_config: ModelLoadConfig | None = None
        self.load_count = 0
        self.media = EmulatedMedia()
        self._template: str | None = None  # whose residency the worker holds (per_template switches)
        self._runs: dict[str, PreemptibleRun] = {}
        self._early: dict[str, bool] = {}
        self._ended: collections.deque[str] = collections.deque(maxlen=1024)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
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
        ph = self.emulation.templates[key]
        return self.media.get(key, ph.width, ph.height, ph.frames, ph.fps or DEFAULT_VIDEO_FPS, ph.video)

    # ------------------------------------------------------------------ batches
    def execute(self, batch: Batch, observer: StepObserver | None = None,
                run_id: str | None = None) -> BatchResult | PausedRun:
        """As ``Worker.execute``: the batch's time passes, step by step; ``run_id``: preemptible."""
        if self.load_config is None:
            raise ValueError("no model loaded: call load_model first")
        if run_id is None:
            return self._run(batch, observer, None)
        if run_id in self._runs:
            raise ValueError(f"run {run_id!r} is already running or paused on this worker")
        run = PreemptibleRun(run_id, lambda control: self._run(batch, observer, control))
        if run_id in self._early:  # the pause overtook the batch
            run.control.request(self._early.pop(run_id))
        self._runs[run_id] = run
        return self._settle(run_id, run.start)

    def pause(self, run_id: str, offload: bool = False) -> bool:
        """As ``Worker.pause``: park at the next step boundary (state kept, or moved: ``offload``)."""
        run = self._runs.get(run_id)
        if run is None:
            if run_id not in self._ended:
                self._early[run_id] = offload
                return True
            return False
        if run.done:
            return False
        run.control.request(offload)
        return True

    def resume(self, run_id: str) -> BatchResult | PausedRun:
        """As ``Worker.resume`` (the batch's own residency switch and state move are emulated on its thread)."""
        run = self._runs.get(run_id)
        if run is None or run.control.paused is None:
            raise ValueError(f"run {run_id!r} is not paused on this worker")
        return self._settle(run_id, run.resume)

    def paused_runs(self) -> list[PausedRun]:
        return [r.control.paused for r in self._runs.values() if r.control.paused is not None]

    def _settle(self, run_id: str, step: Any) -> BatchResult | PausedRun:
        try:
            out = step()
        except BaseException:
            self._forget(run_id)
            raise
        if isinstance(out, PausedRun):
            return out
        run = self._runs[run_id]
        self._forget(run_id)
        return out.model_copy(update={"paused_s": run.paused_s, "pauses": run.control.pauses})

    def _forget(self, run_id: str) -> None:
        self._ended.append(run_id)
        self._early.pop(run_id, None)
        self._runs.pop(run_id, None)

    def _switch_to(self, key: str) -> float:
        """Emulated seconds of the residency switch to ``key``'s plan (0 when it is already held)."""
        with self._lock:
            prev, self._template = self._template, key
        if prev is None or prev == key:
            return 0.0
        return self.emulation.switch_s.get(prev, {}).get(key, 0.0)

    def _run(self, batch: Batch, observer: StepObserver | None, control: Any) -> BatchResult:
        assert self.groups is not None
        config = batch.config
        key = config.template.shape_key
        ph = self.emulation.templates.get(key)
        if ph is None:
            raise ValueError(f"batch for {key}, which this emulated worker set has no plan for")
        group = self.groups.select(config.ulysses, config.ring) if config.sp > 1 else None
        output_rank = group is None or group.rank == 0
        f = ph.factor(len(batch.requests))
        t0 = time.perf_counter()
        start = t0 + self._switch_to(key)  # the batch's phases begin once its residency is in place
        text_end = start + ph.text_s * f
        data = self._media(key) if output_rank else b""  # rendered at load: normally a cache hit
        _sleep_until(text_end)
        denoise_from = time.perf_counter()
        shift = 0.0  # time the batch spent not running (paused, moving state)
        for step in range(1, ph.steps + 1):
            _sleep_until(text_end + shift + step * ph.step_s * f)
            vote = step_vote(observer, control, step, ph.steps, group, output_rank)
            if vote == VOTE_STOP:
                raise BatchCancelled(step)
            if vote in (VOTE_PAUSE, VOTE_PAUSE_OFFLOAD) and control is not None:
                parked = time.perf_counter()
                offload = vote == VOTE_PAUSE_OFFLOAD
                state = ph.pause_bytes or 0
                move = self.emulation.move_s(state) if offload else 0.0
                time.sleep(move)  # the state leaves the device before the preempting batch may start
                control.hold(step, ph.steps, state, offload, move)
                # resumed: the batch's residency comes back (the preemptor may have switched it), then its state
                time.sleep(self._switch_to(key) + move)
                shift += time.perf_counter() - parked
        decode_from = time.perf_counter()
        _sleep_until(text_end + shift + ph.steps * ph.step_s * f + ph.decode_s * f)
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

