"""Words that cross the layers, defined once: the phases of a batch (``Phase``) and where a latency
came from (``LatencySource``).

Every module that names a phase — the analyzer's traces, the memory analysis, the cost model and
profile store, the engine's timings, job progress, the phase shares the dispatcher and simulator
use, the planner's estimates — names it with ``Phase``. A batch runs them in this order:

=========  ===================================================================================
phase      what runs
=========  ===================================================================================
text       before the first denoising step: the prompt's text encoding and the pipeline's
           set-up of latents and timesteps
denoise    the denoising steps (DiT calls and scheduler updates); a step boundary is where a
           batch can pause
post       after the last step, outside the decoders (latent unpacking, post-processing): a
           trace's own phase; its time counts in ``decode`` (``LATENCY_PHASES``)
decode     the VAE decode (and audio VAE, vocoder)
encode     the worker's PNG / MP4 / WAV encoding of the outputs, after the pipeline
=========  ===================================================================================

A trace names its phases finer, each prefixed by its phase: ``text``, ``denoise.step<k>``,
``post``, ``decode.<component>`` (``phase_of_trace``). Where several phases are counted as one
the aggregate is named from these words (``PhaseShares.decode_encode``: every phase after the
last step, where no step boundary is left).

Earlier versions called ``text`` "setup" in traces, the cost model and the profile store:
``read_stored_phase`` reads such stored data (a trace cache, a profile store) as the new word;
``parse_phase`` refuses old names in input, naming the new ones.

Where a latency came from has one vocabulary too (``LatencySource``), read by the cost model's
estimates, the profile store's records and a plan entry's ``latency_source``:

====================  ===================================================================================
source                the latency
====================  ===================================================================================
measured              timed on the hardware it is for, a whole request
profiled              composed of segments timed on that hardware (the segment-reuse profiler)
estimated             the roofline cost model alone
measured+estimated    some of each: the cost model calibrated by measurements of that hardware, or
                      latencies of both kinds behind one plan entry
====================  ===================================================================================

A profile store records what was timed (``TimedSource``); an estimate is one of the first three
(``EstimateSource``; a calibrated cost model says ``estimated`` with ``calibrated`` set); a plan
entry, which sums several latencies up, counts a profiled one as measured — both were timed on
the device it plans for — so it says one of ``PlanLatencySource``.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator


class Phase(StrEnum):
    """One phase of a batch (see the module docstring); its value is its one name (also its repr, so
    a mapping keyed by phase prints as it serialises)."""

    TEXT = "text"
    DENOISE = "denoise"
    POST = "post"
    DECODE = "decode"
    ENCODE = "encode"

    def __repr__(self) -> str:
        return repr(self.value)


#: the phases a batch's time is reported in (engine timings, cost model, profile store): POST counts in DECODE
LATENCY_PHASES: tuple[Phase, ...] = (Phase.TEXT, Phase.DENOISE, Phase.DECODE, Phase.ENCODE)

#: names earlier versions used for a phase -> the phase
RENAMED_PHASES: dict[str, Phase] = {"setup": Phase.TEXT}


def _names() -> str:
    return ", ".join(p.value for p in Phase)


def parse_phase(name: str) -> Phase:
    """``name`` as a ``Phase``; an old or unknown name is refused with the new ones.

    Example:
        >>> parse_phase("denoise") is Phase.DENOISE
        True
        >>> parse_phase("setup")
        Traceback (most recent call last):
        ...
        ValueError: phase 'setup' is now called 'text' (phases: text, denoise, post, decode, encode)
    """
    if name in RENAMED_PHASES:
        raise ValueError(f"phase {name!r} is now called {RENAMED_PHASES[name].value!r} (phases: {_names()})")
    try:
        return Phase(name)
    except ValueError:
        raise ValueError(f"unknown phase {name!r} (phases: {_names()})") from None


def read_stored_phase(name: str) -> str:
    """A phase name (or a trace's finer name, ``setup`` included) as stored by an earlier version ->
    today's name; anything else is returned as it is. For data this project wrote itself (trace
    caches, profile stores), never for input.

    Example:
        >>> read_stored_phase("setup"), read_stored_phase("denoise.step3")
        ('text', 'denoise.step3')
    """
    return RENAMED_PHASES[name].value if name in RENAMED_PHASES else name


def trace_step(k: int) -> str:
    """A trace's name for denoising step ``k`` (``denoise.step<k>``)."""
    return f"{Phase.DENOISE}.step{k}"


def trace_decode(component: str) -> str:
    """A trace's name for the decode of ``component`` (``decode.vae``, ``decode.audio_vae``)."""
    return f"{Phase.DECODE}.{component}"


def phase_of_trace(name: str) -> Phase:
    """A trace's phase name (``text``, ``denoise.step<k>``, ``decode.<component>``, ``post``) -> its
    phase. A name of none of these forms (a device recording's single ``request``) counts as
    ``text``, before the first step, as it always did.

    Example:
        >>> phase_of_trace("denoise.step3"), phase_of_trace("decode.vae"), phase_of_trace("post")
        ('denoise', 'decode', 'post')
    """
    if name.startswith(Phase.DENOISE):
        return Phase.DENOISE
    if name.startswith(Phase.DECODE):
        return Phase.DECODE
    return Phase.POST if name == Phase.POST else Phase.TEXT


def latency_phase(name: str) -> Phase:
    """A trace's phase name -> the phase its time is reported in (``LATENCY_PHASES``): POST (the few
    operators after the last step) counts in DECODE, as the engine's clock counts it."""
    phase = phase_of_trace(name)
    return Phase.DECODE if phase is Phase.POST else phase


V = TypeVar("V")


def _phase_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {parse_phase(str(k)): v for k, v in value.items()}
    return value


#: a mapping keyed by phase (pydantic field type): an old or unknown phase name is refused, naming the new ones
PhaseKeyed = Annotated[dict[Phase, V], BeforeValidator(_phase_keys)]


def refuse_renamed_fields(data: object, owner: str, renamed: Mapping[str, str], fields: str) -> object:
    """A model validator's ``mode="before"`` body: ``data`` with a field under an old name is refused,
    naming the new name and the fields (``owner: 'old' is now called 'new' (fields)``)."""
    if isinstance(data, Mapping):
        for old, new in renamed.items():
            if old in data:
                raise ValueError(f"{owner}: {old!r} is now called {new!r} ({fields})")
    return data


# ---------------------------------------------------------------------------- latency sources
class LatencySource(StrEnum):
    """Where a latency came from (see the module docstring); its value is its one name (also its repr)."""

    MEASURED = "measured"
    PROFILED = "profiled"
    ESTIMATED = "estimated"
    MEASURED_ESTIMATED = "measured+estimated"

    def __repr__(self) -> str:
        return repr(self.value)


#: what a profile store records: latencies timed on the hardware (a whole request, or its segments)
TimedSource = Literal[LatencySource.MEASURED, LatencySource.PROFILED]
#: what one estimate says (``LatencyEstimate.source``): timed, or the cost model (calibrated or not)
EstimateSource = Literal[LatencySource.MEASURED, LatencySource.PROFILED, LatencySource.ESTIMATED]
#: what a plan entry says (``PlanPrediction.latency_source``): a profiled latency counts as measured
PlanLatencySource = Literal[LatencySource.MEASURED, LatencySource.ESTIMATED, LatencySource.MEASURED_ESTIMATED]
#: the timed sources, in the order a look-up prefers them (a whole request before its segments)
TIMED_SOURCES: tuple[LatencySource, ...] = (LatencySource.MEASURED, LatencySource.PROFILED)


# ---------------------------------------------------------------------------- quality tiers
class QualityTier(StrEnum):
    """How far a request's plan may trade exactness for speed; the API's ``quality`` resolves to one
    (``serving/api/quality.py``). ``lossless`` runs the unmitigated model's math (bitwise where the
    math is the same); ``balanced`` and ``fast`` name the lossy tiers a deployment may serve;
    ``auto`` leaves the choice to the server."""

    LOSSLESS = "lossless"
    BALANCED = "balanced"
    FAST = "fast"
    AUTO = "auto"

    def __repr__(self) -> str:
        return repr(self.value)
