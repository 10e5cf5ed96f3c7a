"""What an emulated worker set takes from the plan table: each template's phases on the emulated
clock and the group's move costs (``EmulationConfig``), and the plan table itself on that clock
(``scale_table``). Kept apart from the worker (``xema_ray.runtime.emulated``) so the load config
can carry it without importing the worker.

The phase split is ``xema_ray.profiling.phases.plan_phases``: the same one the model group's
prior and the simulator's preemption model use.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xema_ray.plan import PlanTable
from xema_ray.profiling.phases import plan_phases, table_profile, time_scales
from xema_ray.vocabulary import refuse_renamed_fields

#: bytes/s of a paused state's move to the host and back (the dispatcher's PreemptionPolicy default)
DEFAULT_HOST_BANDWIDTH = 20e9


class EmulatedPhases(BaseModel):
    """One template's full batch on the emulated box, in emulated seconds (reference / time_scale), by
    phase (``xema_ray.vocabulary.Phase``: text, denoise per step, decode)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(ge=1)
    text_s: float = Field(ge=0, description="text encoding (the plan's encoder placement)")
    denoise_step_s: float = Field(ge=0, description="one denoising step")
    decode_s: float = Field(ge=0, description="VAE decode and post-processing")
    latency_by_batch: dict[int, float] = Field(default_factory=dict, description="a partial batch of n: its total")
    peak_bytes: int = Field(ge=0, description="the plan's device peak per worker")
    pause_bytes: int | None = Field(default=None, ge=0, description="the plan's between-step state")
    video: bool
    width: int
    height: int
    frames: int
    fps: float = Field(gt=0)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        return refuse_renamed_fields(data, "emulated phases", {"step_s": "denoise_step_s"},
                                     "text_s, denoise_step_s, decode_s")

    @property
    def total_s(self) -> float:
        return self.text_s + self.steps * self.denoise_step_s + self.decode_s

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

    profile = table_profile(table)
    phases = {}
    for key in keys if keys is not None else sorted(table.entries):
        e = table.entries[key]
        t = e.config.template
        text, denoise, decode = plan_phases(e, profile)
        phases[key] = EmulatedPhases(
            steps=t.steps, text_s=text / time_scale, denoise_step_s=denoise / t.steps / time_scale, decode_s=decode / time_scale,
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
    # per model, composed with any earlier scaling: what reads the table's phases scales them back
    scales = time_scales(table)
    for m in {e.config.template.model for e in table.entries.values()}:
        scales[m] = scales.get(m, 1.0) * ts(m)
    provenance = table.provenance.model_copy(update={"emulated_time_scale": dict(sorted(scales.items()))})
    return table.model_copy(update={"entries": entries, "residency": residency, "provenance": provenance})
