"""What a model group is given beside its own ``ModelGroupConfig`` (``GroupSettings``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from xema_ray.runtime.emulation import EmulationConfig
from xema_ray.plan import AdmissionPolicy
from xema_ray.scheduling.preemption_policy import PreemptionPolicy
from xema_ray.serving.jobs.store import JobStoreConfig
from xema_ray.profiling.phases import PhaseShares

class GroupSettings(BaseModel):
    """What a model group is given beside its own ``ModelGroupConfig``: the app's settings and
    what the plan table chose for the group (``deployments/app.py`` composes it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(default="cpu", description='the kind of worker (``worker_set.WORKER_KINDS``: "cpu", '
                                                   '"cuda", "emulated")')
    worker_cpus: float = Field(default=0.25, description="CPUs per worker")
    jobs: JobStoreConfig | None = Field(default=None, description="the job store's config; None: no video jobs")
    layouts_dir: Path | None = Field(default=None, description="the plan table's layouts folder (plans with a "
                                                               "layout_ref arm theirs)")
    budget_bytes: int | None = Field(default=None, description="device memory per worker (the plan table's budget): "
                                     "the static allocator's arena is sized for it (``xema_ray.runtime.arena``); "
                                     "None: not known")
    preemption: PreemptionPolicy | None = Field(default=None, description="the step-level preemption policy; None: off")
    admission: AdmissionPolicy | None = Field(default=None, description="the SLO-aware admission policy the plan "
                                              "table chose for this group's load; None: plain EDF, every request served")
    phases: dict[str, PhaseShares] | None = Field(
        default=None, description="each template's phase shares on the plan table's hardware (``phase_shares``, as "
                                  "the simulator's): where its step boundaries fall until its first batch is "
                                  "measured; None: the fallback split (``PhaseEstimate.from_plan``)")
    emulation: EmulationConfig | None = Field(default=None, description='device "emulated": the templates\' phases '
                                              "from the plan table (docs/emulated.md)")
