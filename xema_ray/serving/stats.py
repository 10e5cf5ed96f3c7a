"""Request counters kept outside the Router (a Serve deployment of their own), so that
``/v1/stats`` does not restart from 0 when a Router replica is replaced."""

from __future__ import annotations

from pydantic import BaseModel, Field

from xema_ray.serving.layout_stats import GroupLayoutStats
from xema_ray.serving.preemption import PreemptionReport


class StatsResponse(BaseModel):
    """``GET /v1/stats``."""

    received: int = Field(ge=0, description="generation requests received by every Router replica since the app started")
    static_layouts: dict[str, GroupLayoutStats] = Field(
        default_factory=dict, description="per model group: the static allocator's status and counters per template")
    preemption: dict[str, PreemptionReport] = Field(
        default_factory=dict, description="per model group (that answered within the probe timeout): step-level "
                                          "preemption per template, and the dispatcher's latest decisions")


class Stats:
    """Serve deployment body; wrapped by ``serve.deployment`` in ``deployments/app.py``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    async def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    async def get(self) -> dict[str, int]:
        return dict(self.counts)
