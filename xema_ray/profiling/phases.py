"""Where a plan entry's batch spends its time: text encoding, the denoising steps, and decode and
encode (every phase after the last step, ``PhaseShares.decode_encode``); the phases are
``xema_ray.vocabulary.Phase``.

One split for everything that reasons about step boundaries — the emulated worker (which sleeps
through these phases), the live model group's prior before any batch of a template has run
(``PhaseEstimate.from_shares``; measured batches replace it), and the simulator's preemption model
(where a paused batch parks) — so that the live stack and the simulator agree on where a batch
can be paused.

The split comes from the plan: the entry's ``latency_s`` is the total; the cost model of the
table's hardware divides what it estimates between the denoising loop and the decode, and what the
plan adds beyond the cost model (the planned text encoder) is the text phase. A table for hardware
without a profile falls back to 5 % decode for images and 10 % for videos.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.vocabulary import Phase, refuse_renamed_fields

#: the decode share when the table's hardware has no profile (images, videos)
FALLBACK_DECODE_SHARE = (0.05, 0.10)


def fallback_shares(video: bool) -> PhaseShares:
    """The split where nothing better is known: no text phase, 5 % decode for images, 10 % for videos."""
    decode = FALLBACK_DECODE_SHARE[video]
    return PhaseShares(text=0.0, denoise=1.0 - decode, decode_encode=decode)


class PhaseShares(BaseModel):
    """Shares of a template's batch latency by phase (they sum to 1): ``Phase.TEXT``,
    ``Phase.DENOISE``, and every phase after the last step as one (``Phase.POST``, ``Phase.DECODE``,
    ``Phase.ENCODE``: the plan's split has no encode, so that is its decode)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: float = Field(ge=0, le=1, description="text encoding, before the first step")
    denoise: float = Field(gt=0, le=1, description="the denoising steps (their boundaries are where a batch can pause)")
    decode_encode: float = Field(ge=0, lt=1, description="decode and encode, after the last step (no boundary left)")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        return refuse_renamed_fields(data, "phase shares", {"tail": "decode_encode"}, "shares: text, denoise, decode_encode")

    @model_validator(mode="after")
    def _sums_to_one(self) -> PhaseShares:
        if abs(self.text + self.denoise + self.decode_encode - 1.0) > 1e-6:
            raise ValueError(f"phase shares must sum to 1, got {self.text} + {self.denoise} + {self.decode_encode}")
        return self

    @classmethod
    def of_seconds(cls, text_s: float, denoise_s: float, decode_encode_s: float) -> PhaseShares:
        total = text_s + denoise_s + decode_encode_s
        if total <= 0 or denoise_s <= 0:
            return cls(text=0.0, denoise=1.0, decode_encode=0.0)
        decode_encode = min(decode_encode_s / total, 0.99)
        text = min(text_s / total, 1.0 - decode_encode)
        return cls(text=text, denoise=max(1e-9, 1.0 - text - decode_encode), decode_encode=decode_encode)


def table_profile(table: PlanTable) -> Any:
    """The hardware profile the table was planned for (None: hardware without a profile)."""
    from xema_ray.profiling.hardware import HARDWARE

    for p in HARDWARE.values():
        if p.name in table.hardware:
            return p
    return None


def time_scales(table: PlanTable) -> dict[str, float]:
    """Model -> the time scale ``scale_table`` divided its latencies by (empty: the hardware's own seconds)."""
    return dict(table.provenance.emulated_time_scale)


def plan_phases(entry: PlanEntry, profile: Any, time_scale: float = 1.0) -> tuple[float, float, float]:
    """(text, denoise, decode) seconds of ``entry``'s batch, summing to its latency.

    ``time_scale``: the entry's latencies were divided by it (an emulated box's clock); the cost
    model's are in the hardware's own seconds, so the split is made there and scaled back."""
    total = entry.prediction.latency_s * time_scale  # in the hardware's own seconds
    if profile is None:
        sh = fallback_shares(entry.config.template.spec.kind == "video")
        text, denoise, decode = 0.0, total * sh.denoise, total * sh.decode_encode
    else:
        from xema_ray.profiling import estimate_latency

        est = estimate_latency(entry.config, profile).per_phase
        loop, vae = est.get(Phase.DENOISE, 0.0), est.get(Phase.DECODE, 0.0)
        model = loop + vae
        text = min(total, max(0.0, total - model - est.get(Phase.TEXT, 0.0)) + est.get(Phase.TEXT, 0.0))
        rest = total - text
        denoise, decode = (rest, 0.0) if model <= 0 else (rest * loop / model, rest * vae / model)
    return text / time_scale, denoise / time_scale, decode / time_scale


def phase_shares(table: PlanTable, entries: Mapping[str, PlanEntry] | None = None) -> dict[str, PhaseShares]:
    """The phase shares of ``entries`` (default: the table's), planned on ``table``'s hardware (a
    time-scaled table's entries are split on the hardware's own clock, ``time_scales``)."""
    profile, scales = table_profile(table), time_scales(table)
    return {k: PhaseShares.of_seconds(*plan_phases(e, profile, scales.get(e.config.template.model, 1.0)))
            for k, e in sorted((entries if entries is not None else table.entries).items())}
