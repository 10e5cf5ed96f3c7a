"""The latency profiler (paper §7.2): a request's latency from a few measured segments.

Profiling a whole request can take minutes to hours. The memory trace already names every
*segment* of the request (a maximal run of one unit — a DiT block, a VAE up-block, the code
between them — in one phase) and its operator pattern. Runs with the same pattern are the same
operator combination and take the same time under the same execution shape, so:

1. trace the template on the meta device (the analyzer) and group its segments by
   (unit, phase); the *signature* of a group is the unit's class plus its segments' patterns;
2. if the store holds a latency for every signature of the request under this execution shape,
   nothing runs; otherwise run one *calibration request* of ``min(steps, 3)`` denoising steps
   (step 0 carries one-off set-up, steps 1-2 are the steady state every later step repeats) with
   hooks that attribute wall time exclusively to the innermost unit running, per phase;
3. the latency of a signature is the median over the calibration groups sharing it (identical
   DiT blocks measure each other); the request's estimate is the sum, over every group of the
   full request's trace, of its signature's latency, plus the time no unit claims (scheduler,
   pipeline glue), extrapolated per steady step.

Measurements go to the ``ProfileStore`` keyed by hardware fingerprint, model, execution shape
and signature, so a second template with the same shape but more steps, or a config whose
mitigations leave a region untouched, reuses them.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.memory.analysis import segments as trace_segments
from xema_ray.memory.analysis import unit_of
from xema_ray.analyzer.assembly import trace_markers
from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.analyzer.steps import DIT_BEGIN, STEP_BOUNDARY
from xema_ray.memory.trace import MemoryTrace
from xema_ray.plan import ExecutionConfig
from xema_ray.platforms import Platform, current_platform
from xema_ray.profiling.store import ProfileStore, RequestRecord, SegmentRecord, now
from xema_ray.runtime.engine import ExecutionEngine, apply_config_mitigations
from xema_ray.tier_plan import StepCacheSchedule
from xema_ray.vocabulary import LatencySource, Phase, PhaseKeyed, latency_phase, trace_decode, trace_step

PIPELINE_UNIT = "<pipeline>"
#: denoising steps of the calibration request: step 0 (with set-up) and two steady steps (the
#: analyzer's replication window; two samples of every steady operator combination)
CALIBRATION_STEPS = 3
#: the step cache ``measure_reuse`` times: the first step computed, every later one reused (a
#: two-expert model computes each expert's first step: the cache resets at the switch)
REUSE_ALL = StepCacheSchedule(warmup=0.0, min_warmup=1, compute_every=1_000_000, final=0)

UnitPhase = tuple[str, str]


class ProfileReport(BaseModel):
    """What one ``LatencyProfiler.profile`` call did and estimated."""

    model_config = ConfigDict(frozen=True)

    template: str
    config_hash: str
    fingerprint: str
    estimate_s: float = Field(description="estimated pipeline latency of one batch (text + denoise + decode)")
    per_phase: PhaseKeyed[float] = Field(description="seconds by phase (xema_ray.vocabulary.LATENCY_PHASES)")
    segments_estimated: int = Field(description="trace segments of the full request the estimate covers")
    segments_profiled: int = Field(description="trace segments executed by the calibration request (0: all reused)")
    signatures: int = Field(description="distinct operator combinations in the request")
    signatures_measured: int = Field(description="of which measured now")
    signatures_reused: int = Field(description="of which taken from the store")
    matched_by_unit: int = Field(description="(unit, phase) runs whose exact pattern was not measured, timed by the same unit's run")
    calibration_steps: int
    profiling_s: float = Field(description="wall time spent profiling (trace + calibration run)")


def _phase_kind(phase: str) -> str:
    """Steps >= 1 are interchangeable (the analyzer replicates them); step 0 and the rest keep their name."""
    if phase.startswith(f"{Phase.DENOISE}.step") and phase != trace_step(0):
        return f"{Phase.DENOISE}.step*"
    return phase


def _unit_key(unit: str, phase: str) -> str:
    return f"unit:{unit}@{_phase_kind(phase)}"


def _unit_classes(pipe: Any) -> dict[str, str]:
    """Unit name -> class name of the module at that path (the unit's root)."""
    out: dict[str, str] = {}
    for comp, module in pipe.components.items():
        if not isinstance(module, nn.Module):
            continue
        for path, sub in module.named_modules():
            full = f"{comp}.{path}" if path else comp
            if unit_of(full) == full:
                out.setdefault(full, type(sub).__name__)
    return out


def group_signatures(trace: MemoryTrace, classes: dict[str, str]) -> tuple[dict[UnitPhase, str], int]:
    """(unit, phase) -> signature of its segments, and the number of segments."""
    patterns: dict[UnitPhase, list[str]] = defaultdict(list)
    segs = trace_segments(trace)
    for s in segs:
        patterns[(s.unit, s.phase)].append(s.pattern)
    sigs = {}
    for (unit, phase), pats in patterns.items():
        text = classes.get(unit, PIPELINE_UNIT if unit == PIPELINE_UNIT else unit) + "|" + ",".join(pats)
        sigs[(unit, phase)] = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return sigs, len(segs)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Collect first, then keep Python's cyclic GC out of the timed region: a generation-2
    collection over the pipeline's objects takes ~0.1-0.2 s on the CI box and would land in
    whichever segment it interrupts. Applied to calibration and measurement alike."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Timeline:
    """Wall-clock attribution of a pipeline call to (innermost unit, phase).

    Hooks push/pop unit roots; the analyzer's markers (``trace_markers``) record DiT entry, step
    boundaries and decoder windows, so phases here are the trace's phases."""

    def __init__(self, pipe: Any, platform: Platform) -> None:
        self.pipe = pipe
        self.platform = platform
        self.events: list[tuple[float, str, str]] = []
        self._handles: list[Any] = []

    def _now(self) -> float:
        self.platform.synchronize()  # device work queued so far belongs to the interval that launched it
        return time.perf_counter()

    def mark(self, label: str) -> None:
        self.events.append((self._now(), "mark", label))

    @contextlib.contextmanager
    def recording(self, device_type: str) -> Iterator[None]:
        for comp, module in self.pipe.components.items():
            if not isinstance(module, nn.Module):
                continue
            for path, sub in module.named_modules():
                full = f"{comp}.{path}" if path else comp
                if unit_of(full) != full:
                    continue
                self._handles.append(sub.register_forward_pre_hook(lambda *_a, _n=full: self.events.append((self._now(), "push", _n))))
                self._handles.append(sub.register_forward_hook(lambda *_a, _n=full: self.events.append((self._now(), "pop", _n))))
        try:
            with _no_gc(), trace_markers(self.pipe, self, device_type):
                self.events.append((self._now(), "start", ""))
                yield
                self.events.append((self._now(), "end", ""))
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def hook_overhead(self, calls: int = 2000) -> float:
        """Seconds one recorded event adds to the interval it ends (hook dispatch + clock read),
        measured on a trivial module with the same hooks; subtracted per interval so the hooks'
        own cost does not inflate small segments."""
        probe = nn.Identity()
        x = object()
        sink: list[tuple[float, str, str]] = []

        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                probe(x)
            return time.perf_counter() - t0

        plain = min(run() for _ in range(3))
        handles = [
            probe.register_forward_pre_hook(lambda *_a: sink.append((self._now(), "push", "probe"))),
            probe.register_forward_hook(lambda *_a: sink.append((self._now(), "pop", "probe"))),
        ]
        try:
            hooked = min(run() for _ in range(3))
        finally:
            for h in handles:
                h.remove()
        return max(0.0, (hooked - plain) / (2 * calls))

    def attribute(self, overhead_s: float = 0.0) -> dict[UnitPhase, float]:
        marks = [(t, label) for t, kind, label in self.events if kind == "mark"]
        first_dit = next((t for t, label in marks if label == DIT_BEGIN), float("inf"))
        bounds = [t for t, label in marks if label == STEP_BOUNDARY]
        windows: list[tuple[float, float, str]] = []
        opened: dict[str, float] = {}
        for t, label in marks:
            if label.startswith("begin:"):
                opened[label[6:]] = t
            elif label.startswith("end:") and label[4:] in opened:
                windows.append((opened.pop(label[4:]), t, label[4:]))

        def phase_at(t: float) -> str:
            if t < first_dit and (not bounds or t < bounds[0]):
                return Phase.TEXT.value
            k = sum(1 for b in bounds if b <= t)
            if k < len(bounds) or not bounds:
                return trace_step(k)
            for s, e, name in windows:
                if s <= t < e:
                    return trace_decode(name)
            return Phase.POST.value

        out: dict[UnitPhase, float] = defaultdict(float)
        stack: list[str] = []
        for (t, kind, name), (t_next, _, _) in zip(self.events, self.events[1:], strict=False):
            if kind == "push":
                stack.append(name)
            elif kind == "pop" and stack and stack[-1] == name:
                stack.pop()
            key = (stack[-1] if stack else PIPELINE_UNIT, phase_at(t))
            out[key] += max(0.0, t_next - t - overhead_s)
        return dict(out)


def _calibration_samples(calib_sigs: dict[UnitPhase, str],
                         times: dict[UnitPhase, float]) -> list[tuple[str, str, list[float]]]:
    """(signature, unit, seconds samples) of a calibration run: per signature, per (unit, phase
    kind), and per phase kind for the time no unit claimed. A traced unit that did not execute
    (resident weights registered at set-up) takes 0 s."""
    by_sig: dict[str, list[float]] = defaultdict(list)
    by_unit: dict[str, list[float]] = defaultdict(list)
    units: dict[str, str] = {}
    untraced: dict[str, list[float]] = defaultdict(list)
    for (unit, phase), seconds in times.items():
        sig = calib_sigs.get((unit, phase))
        if sig is None:
            untraced[_phase_kind(phase)].append(seconds)  # a unit that allocated nothing
        else:
            by_sig[sig].append(seconds)
            by_unit[_unit_key(unit, phase)].append(seconds)
            units.setdefault(sig, unit)
    for (unit, phase), sig in calib_sigs.items():
        if (unit, phase) not in times:
            # allocations with no execution time: resident weights registered at set-up
            by_sig[sig].append(0.0)
            by_unit[_unit_key(unit, phase)].append(0.0)
            units.setdefault(sig, unit)
    for phase in {_phase_kind(p) for _, p in calib_sigs}:
        untraced.setdefault(phase, [0.0])
    records = [(sig, units.get(sig, "?"), vals) for sig, vals in by_sig.items()]
    records += [(k, k, vals) for k, vals in by_unit.items()]
    records += [(f"untraced:{k}", "untraced", vals) for k, vals in untraced.items()]
    return records


class LatencyProfiler:
    """Segment-reuse latency profiling on one worker's engine.

    Args:
        engine: the worker's engine (its pipeline is what gets measured; SP and mitigations of
            the config are installed by the engine, so every SP rank must profile together).
        store: where measurements are looked up and recorded.
        platform: for synchronisation and the hardware fingerprint (default: current).

    Example:
        >>> profiler = LatencyProfiler(engine, ProfileStore("profiles.json"))  # doctest: +SKIP
        >>> profiler.profile(ExecutionConfig(template=t)).estimate_s  # doctest: +SKIP
    """

    def __init__(self, engine: ExecutionEngine, store: ProfileStore, platform: Platform | None = None) -> None:
        self.engine = engine
        self.store = store
        self.platform = platform or engine.platform or current_platform()
        self.fingerprint = self.platform.hardware_fingerprint()
        self._classes = _unit_classes(engine.pipe)

    @staticmethod
    def exec_key(config: ExecutionConfig) -> str:
        """The execution shape a segment's latency depends on besides its own pattern."""
        return f"{config.template.shape_key}/b{config.batch}/u{config.ulysses}r{config.ring}"

    def _trace(self, config: ExecutionConfig, steps: int) -> MemoryTrace:
        spec = self.engine.spec
        template = config.batched_template.with_(steps=steps)

        def prepare(pipe: Any, _tracer: Any) -> contextlib.AbstractContextManager[None]:
            return apply_config_mitigations(pipe, spec, config.mitigations)

        return trace_template(template, TraceOptions(device="meta", dtype=self.engine.dtype), prepare=prepare)

    def calibrate(self, config: ExecutionConfig, steps: int) -> dict[UnitPhase, float]:
        """Run ``config``'s request with ``steps`` denoising steps under the timeline hooks."""
        calib = ExecutionConfig(**{**config.model_dump(exclude={"template"}), "template": config.template.with_(steps=steps)})
        timeline = _Timeline(self.engine.pipe, self.platform)
        overhead = timeline.hook_overhead()
        with timeline.recording(self.engine.device.type):
            self.engine.run_pipeline(calib, ["profiling"] * config.batch, list(range(config.batch)), output_type="np",
                                     steps=steps)
        return timeline.attribute(overhead)

    def profile(self, config: ExecutionConfig) -> ProfileReport:
        """Estimate one batch's pipeline latency under ``config``, measuring only what the store lacks."""
        t0 = time.perf_counter()
        steps = config.template.steps
        full_sigs, n_segments = group_signatures(self._trace(config, steps), self._classes)
        wanted = set(full_sigs.values())
        missing = self._missing(config, full_sigs)
        calib_steps = min(steps, CALIBRATION_STEPS)
        profiled = 0
        measured: set[str] = set()
        if missing:
            profiled, measured = self._calibrate_into_store(config, calib_steps, missing)
        per_phase, by_unit_fallbacks = self._per_phase(config, full_sigs, calib_steps)
        estimate = sum(per_phase.values())
        report = ProfileReport(
            template=config.template.key,
            config_hash=config.config_hash(),
            fingerprint=self.fingerprint,
            estimate_s=estimate,
            per_phase=dict(per_phase),
            segments_estimated=n_segments,
            segments_profiled=profiled,
            signatures=len(wanted),
            signatures_measured=len(measured & wanted),
            signatures_reused=len(wanted - measured),
            matched_by_unit=by_unit_fallbacks,
            calibration_steps=calib_steps if missing else 0,
            profiling_s=time.perf_counter() - t0,
        )
        self.store.put_request(
            RequestRecord(
                fingerprint=self.fingerprint, model=config.template.model, template=config.template.key,
                config_hash=config.config_hash(), source=LatencySource.PROFILED, total_s=estimate,
                per_phase=dict(per_phase), steps=steps, measured_at=now(), config=config,
            )
        )
        return report

    def _missing(self, config: ExecutionConfig, full_sigs: dict[UnitPhase, str]) -> set[str]:
        """The request's signatures (and untraced phase kinds) the store has no segment for, by
        signature nor by unit."""
        key, model = self.exec_key(config), config.template.model
        phase_kinds = {_phase_kind(p) for _, p in full_sigs}
        missing = {
            s for (unit, phase), s in full_sigs.items()
            if self.store.get_segment(self.fingerprint, model, key, s) is None
            and self.store.get_segment(self.fingerprint, model, key, _unit_key(unit, phase)) is None
        }
        missing |= {f"untraced:{k}" for k in phase_kinds if self.store.get_segment(self.fingerprint, model, key, f"untraced:{k}") is None}
        return missing

    def _calibrate_into_store(self, config: ExecutionConfig, calib_steps: int,
                              missing: set[str]) -> tuple[int, set[str]]:
        """Run the calibration request and store a segment per signature, per unit and per untraced
        phase kind: (trace segments it executed, the missing signatures it measured)."""
        key, model = self.exec_key(config), config.template.model
        calib_sigs, profiled = group_signatures(self._trace(config, calib_steps), self._classes)
        times = self.calibrate(config, calib_steps)
        measured: set[str] = set()
        for sig, unit, vals in _calibration_samples(calib_sigs, times):
            if sig in missing:
                measured.add(sig)
            self.store.put_segment(
                SegmentRecord(
                    fingerprint=self.fingerprint, model=model, exec_key=key, signature=sig, unit=unit,
                    seconds=statistics.median(vals), samples=len(vals), config_hash=config.config_hash(),
                    measured_at=now(),
                )
            )
        return profiled, measured

    def _per_phase(self, config: ExecutionConfig, full_sigs: dict[UnitPhase, str],
                   calib_steps: int) -> tuple[dict[Phase, float], int]:
        """Seconds by latency phase from the store's segments of every (unit, phase) of the full
        request, plus the untraced time per phase; and how many runs were timed by their unit."""
        key, model = self.exec_key(config), config.template.model
        per_phase: dict[Phase, float] = defaultdict(float)
        by_unit_fallbacks = 0
        for (unit, phase), sig in full_sigs.items():
            rec = self.store.get_segment(self.fingerprint, model, key, sig)
            if rec is None:
                # the same unit in the same kind of phase with a slightly different allocation
                # sequence, e.g. the set-up's timestep table, whose length is the step count
                rec = self.store.get_segment(self.fingerprint, model, key, _unit_key(unit, phase))
                by_unit_fallbacks += 1
            if rec is None:
                raise RuntimeError(
                    f"unit {unit} in phase {phase} of {config.template.key} was not executed by the "
                    f"{calib_steps}-step calibration request"
                )
            per_phase[latency_phase(phase)] += rec.seconds
        phases_present: dict[str, int] = defaultdict(int)
        for phase in {p for _, p in full_sigs}:
            phases_present[_phase_kind(phase)] += 1
        for kind, count in phases_present.items():
            rec = self.store.get_segment(self.fingerprint, model, key, f"untraced:{kind}")
            if rec is not None:
                per_phase[latency_phase(kind)] += rec.seconds * count
        return per_phase, by_unit_fallbacks

    def measure_reuse(self, config: ExecutionConfig, repeats: int = 3) -> tuple[RequestRecord, RequestRecord]:
        """What a step-cached (reused) denoising step costs on this device: ``config``'s request
        lossless and with every step after the first reusing the cached output (``REUSE_ALL``;
        a two-expert model computes each expert's first step), run in ``repeats`` interleaved
        pairs (a loaded machine slows both alike); the pair whose denoising ratio is the median is
        recorded, both as "measured" (the lossless one is the calibration's measurement of
        ``config``). ``reused_step_share`` reads the share from the two records."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        cached = config.model_copy(update={"step_cache": REUSE_ALL, "layout_ref": None})
        pairs = [(self._timed(config), self._timed(cached)) for _ in range(repeats)]
        ratios = [r[1][Phase.DENOISE] / max(lossless[1][Phase.DENOISE], 1e-12) for lossless, r in pairs]
        lossless, reused = pairs[ratios.index(statistics.median_low(ratios))]
        return self._record(config, *lossless), self._record(cached, *reused)

    def _timed(self, config: ExecutionConfig) -> tuple[float, dict[Phase, float]]:
        """(wall seconds, seconds by latency phase) of one full request of ``config``."""
        with _no_gc():
            t0 = time.perf_counter()
            ph = self.engine.run_pipeline(config, ["profiling"] * config.batch, list(range(config.batch)),
                                          output_type="np", steps=config.template.steps).phases
            return time.perf_counter() - t0, {latency_phase(k): v for k, v in ph.items()}

    def _record(self, config: ExecutionConfig, total_s: float, per_phase: dict[Phase, float]) -> RequestRecord:
        record = RequestRecord(
            fingerprint=self.fingerprint, model=config.template.model, template=config.template.key,
            config_hash=config.config_hash(), source=LatencySource.MEASURED, total_s=total_s, per_phase=per_phase,
            steps=config.template.steps, measured_at=now(), config=config,
        )
        self.store.put_request(record)
        return record

    def measure(self, config: ExecutionConfig, repeats: int = 1) -> RequestRecord:
        """Run the full request ``repeats`` times and record the median pipeline latency as "measured"."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        runs = [self._timed(config) for _ in range(repeats)]
        totals = [t for t, _ in runs]
        return self._record(config, *runs[totals.index(statistics.median_low(totals))])


def reused_step_share(lossless: RequestRecord, reused: RequestRecord, computed: int) -> float:
    """A reused step's seconds as a share of a computed step's, from ``measure_reuse``'s records:
    the lossless request's denoising phase is ``n`` steps of ``s``, the step-cached one's
    ``computed`` steps of ``s`` and ``n - computed`` of ``r``; the share is ``r / s`` (clamped
    to [0, 1]: timing noise cannot make a reused step dearer than a computed one, nor free).

    Example:
        >>> from xema_ray.vocabulary import Phase
        >>> rec = lambda d: RequestRecord(fingerprint="f", model="m", template="t", config_hash="h",
        ...     source="measured", total_s=d, per_phase={Phase.DENOISE: d}, steps=4, measured_at=0.0)
        >>> reused_step_share(rec(4.0), rec(1.6), computed=1)
        0.2
    """
    n = lossless.steps
    step = lossless.per_phase.get(Phase.DENOISE, 0.0) / n
    if n <= computed or step <= 0:
        raise ValueError(f"no reused step to price: {computed} of {n} steps computed")
    r = (reused.per_phase.get(Phase.DENOISE, 0.0) - computed * step) / (n - computed)
    return round(min(1.0, max(0.0, r / step)), 6)
