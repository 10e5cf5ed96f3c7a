"""Reading a memory trace: peaks, pressure intervals, segments and the event CDF (paper §3.3, §5).

Measurement (``analyzer``) and interpretation (this module) are separate, as in PyTorch's
MemTracker: everything here is pure numpy over a ``MemoryTrace`` and never runs a model.

Vocabulary:
- *active curve*: live bytes after each event.
- *pressure interval*: a maximal run of events where the curve exceeds the budget B (§7.3 stage 2).
- *segment* e_i: a maximal run of events executed by one unit (a DiT block, a VAE up-block,
  or the code between them) within one phase (§5.1). Segments with the same *pattern* (same
  event sequence) are the same operator combination; the profiler measures one per pattern.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.vocabulary import Phase, phase_of_trace

_UNIT_RE = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def unit_of(module_path: str) -> str:
    """The mitigation unit a module belongs to: its path up to the first list index
    (``transformer.transformer_blocks.3.attn1.to_q`` -> ``transformer.transformer_blocks.3``),
    else its first two components (``vae.decoder``)."""
    m = _UNIT_RE.match(module_path)
    if m:
        return m.group(1)
    return ".".join(module_path.split(".")[:2])


class PressureInterval(BaseModel):
    """A contiguous event range whose live memory exceeds the budget."""

    model_config = ConfigDict(frozen=True)

    start: int = Field(description="first event above the budget")
    stop: int = Field(description="one past the last event above the budget")
    peak_bytes: int
    excess_bytes: int = Field(description="peak minus budget: what mitigation must remove")
    phases: list[str]
    units: list[str] = Field(description="mitigation units (blocks) running inside, in order")
    ops: list[str] = Field(description="operators allocating inside, largest bytes first")


class Segment(BaseModel):
    """A maximal run of events of one unit in one phase (the paper's e_i)."""

    model_config = ConfigDict(frozen=True)

    start: int
    stop: int
    unit: str
    phase: str
    pattern: str = Field(description="hash of the segment's event sequence; equal = same operator combination")
    peak_bytes: int
    alloc_bytes: int = Field(description="bytes allocated inside the segment")


class PhasePeak(BaseModel):
    model_config = ConfigDict(frozen=True)

    phase: str
    peak_bytes: int
    event: int


class ExpertUse(BaseModel):
    """When one denoiser component runs, read off a trace (a two-expert model has two)."""

    component: str = Field(description="pipeline component, e.g. transformer (high-noise) or transformer_2 (low-noise)")
    weight_bytes: int = Field(ge=0, description="its weights in the trace")
    first_step: int = Field(ge=0, description="first denoising step it runs")
    last_step: int = Field(ge=0, description="last denoising step it runs")
    first_event: int = Field(ge=0, description="its first allocation event")
    last_event: int = Field(ge=0, description="its last allocation event")


class MemorySummary(BaseModel):
    """What ``xema analyze`` prints and writes; everything in bytes."""

    template: str
    n_allocations: int
    n_events: int
    peak_bytes: int
    peak_event: int
    peak_phase: str
    peak_module: str
    weight_bytes: int
    input_bytes: int
    activation_bytes_at_peak: int
    phase_peaks: list[PhasePeak]
    budget_bytes: int | None = None
    pressure_intervals: list[PressureInterval] = Field(default_factory=list)
    pressure_event_fraction: float = 0.0
    weight_bytes_by_component: dict[str, int] = Field(
        default_factory=dict, description="device-resident weights per pipeline component (transformer, vae, text_encoder, ...)")
    text_peak_bytes: int = Field(default=0, description="peak of the text phase, before the first denoising step (text encoding included)")
    dit_cdf: dict[str, float] = Field(default_factory=dict, description="fraction of DiT events below x% of the DiT peak")
    vae_cdf: dict[str, float] = Field(default_factory=dict, description="fraction of VAE events below x% of the VAE peak")
    experts: list[ExpertUse] = Field(default_factory=list, description="the denoisers and their steps, where more than one runs")


# ---------------------------------------------------------------------------- per-event views
def event_modules(trace: MemoryTrace) -> np.ndarray:
    """Module index active at each event (allocations: allocating module, frees: freeing module)."""
    mod = np.full(trace.n_events, -1, dtype=np.int32)
    mod[trace.begin] = trace.module
    freed = trace.end < trace.n_events
    mod[trace.end[freed]] = trace.free_module[freed]
    return mod


def event_phases(trace: MemoryTrace) -> np.ndarray:
    """Phase index of each event: allocations carry theirs; frees inherit the latest allocation's."""
    ph = np.full(trace.n_events, -1, dtype=np.int32)
    ph[trace.begin] = trace.phase
    # forward-fill frees with the phase of the most recent allocation event
    idx = np.where(ph >= 0, np.arange(trace.n_events), 0)
    np.maximum.accumulate(idx, out=idx)
    return ph[idx]


# A trace's phase names ("text", "denoise.step<k>", "decode.<component>", "post") and the phase each
# belongs to: ``xema_ray.vocabulary`` (``Phase``, ``phase_of_trace``), the one phase vocabulary.


# ---------------------------------------------------------------------------- peaks
def phase_peaks(trace: MemoryTrace, curve: np.ndarray | None = None) -> list[PhasePeak]:
    curve = trace.active_curve() if curve is None else curve
    ph = event_phases(trace)
    out = []
    for i, name in enumerate(trace.phases):
        sel = np.flatnonzero(ph == i)
        if len(sel) == 0:
            continue
        j = sel[np.argmax(curve[sel])]
        out.append(PhasePeak(phase=name, peak_bytes=int(curve[j]), event=int(j)))
    return out


def pressure_intervals(trace: MemoryTrace, budget: int, curve: np.ndarray | None = None, top_ops: int = 5,
                       index: IntervalIndex | None = None) -> list[PressureInterval]:
    """Maximal event ranges with live bytes above ``budget`` (stage 2 of the planner).

    ``curve`` replaces the trace's active curve (the planner's transformed per-GPU curve);
    ``index`` reuses the per-trace tables across calls on the same trace.

    Example:
        >>> # a trace that never exceeds its budget has no intervals
        >>> pressure_intervals(trace, budget=trace.peak())  # doctest: +SKIP
        []
    """
    return (index or IntervalIndex(trace)).intervals(budget, trace.active_curve() if curve is None else curve, top_ops)


class IntervalIndex:
    """Per-trace tables that turn any curve over the trace's events into pressure intervals.

    Built once per trace: the planner asks for the intervals of hundreds of transformed curves
    of the same trace, and a Flux.2 request is above a 48 GB budget for 99.8 % of its events, so
    everything per event is vectorised and everything per trace is done here once."""

    def __init__(self, trace: MemoryTrace) -> None:
        self.trace = trace
        self.unit_names = sorted({unit_of(m) for m in trace.modules})
        unit_id = {u: i for i, u in enumerate(self.unit_names)}
        module_unit = np.array([unit_id[unit_of(m)] for m in trace.modules] + [-1], dtype=np.int64)
        self.event_unit = module_unit[event_modules(trace)]  # module -1 indexes the trailing -1
        self.event_phase = event_phases(trace)
        self.order = np.argsort(trace.begin, kind="stable")
        self.begins_sorted = trace.begin[self.order]
        n_ops = len(trace.ops)
        self.op_names = [*trace.ops, "?"]
        self.op_sorted = np.where(trace.op[self.order] >= 0, trace.op[self.order], n_ops)
        self.size_sorted = trace.size[self.order].astype(np.float64)
        # (start, stop, top_ops) -> (units, phases, ops): what runs in a range never changes
        self._described: dict[tuple[int, int, int], tuple[list[str], list[str], list[str]]] = {}
        self._unit_runs = _rle(self.event_unit)
        self._phase_runs = _rle(self.event_phase)
        self._made: dict[tuple[int, int, int, int, int], PressureInterval] = {}
        self._lazy: dict[tuple[int, int, int, int, int], PressureInterval] = {}

    def _describe(self, s: int, e: int, lo: int, hi: int, top_ops: int) -> tuple[list[str], list[str], list[str]]:
        """(units, phases, ops) of events [s, e); allocations lo:hi of the begin-sorted order."""
        # each unit once, in first-seen order (a unit may run in several steps): from the runs
        # of equal units overlapping [s, e), not event by event
        units = [self.unit_names[i] for i in dict.fromkeys(_runs_in(self._unit_runs, s, e)) if i >= 0]
        phases = sorted(self.trace.phases[p] for p in set(_runs_in(self._phase_runs, s, e)) if p >= 0)
        op = self.op_sorted[lo:hi]
        n_ops = len(self.op_names)
        # bytes per operator, summed in allocation order (as a bincount over the rows)
        nbytes_all = np.bincount(op, weights=self.size_sorted[lo:hi], minlength=n_ops)
        present = np.flatnonzero(np.bincount(op, minlength=n_ops))
        first_all = np.full(n_ops, len(op), dtype=np.int64)
        np.minimum.at(first_all, op, np.arange(len(op), dtype=np.int64))
        # largest bytes first; ties in first-allocation order
        rank = np.lexsort((first_all[present], -nbytes_all[present]))
        return units, phases, [self.op_names[i] for i in present[rank][:top_ops]]

    def intervals(self, budget: int, curve: np.ndarray, top_ops: int = 5, lazy: bool = False) -> list[PressureInterval]:
        """The maximal runs of ``curve`` above ``budget``, largest operators first in each; with
        ``lazy`` the units, phases and operators of each are found only when read
        (``LazyPressureInterval``)."""
        if budget < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget}")
        over = curve > budget
        if not over.any():
            return []
        edges = np.diff(np.concatenate([[0], over.astype(np.int8), [0]]))
        starts = np.flatnonzero(edges == 1)
        stops = np.flatnonzero(edges == -1)
        lo_hi = np.searchsorted(self.begins_sorted, np.stack([starts, stops]))
        bounds = np.empty(2 * len(starts), dtype=np.int64)
        bounds[0::2], bounds[1::2] = starts, stops
        peaks = np.maximum.reduceat(np.append(curve, curve[-1]), bounds)[0::2].tolist()  # max of each [start, stop)
        out: list[PressureInterval] = []
        made = self._lazy if lazy else self._made
        for s, e, lo, hi, peak in zip(starts.tolist(), stops.tolist(), lo_hi[0].tolist(), lo_hi[1].tolist(), peaks, strict=True):
            peak = int(peak)
            # candidates mostly share intervals (same range, same peak): one frozen object each,
            # built without validation (every field is already of its type)
            key = (s, e, top_ops, peak, budget)
            iv = made.get(key)
            if iv is None:
                if lazy:
                    iv = LazyPressureInterval.model_construct(start=s, stop=e, peak_bytes=peak, excess_bytes=peak - budget)
                    iv._where = (self, s, e, lo, hi, top_ops)
                else:
                    units, phases, ops = self.described(s, e, lo, hi, top_ops)
                    iv = PressureInterval.model_construct(start=s, stop=e, peak_bytes=peak, excess_bytes=peak - budget,
                                                          phases=list(phases), units=list(units), ops=list(ops))
                if len(made) > 50_000:
                    made.clear()
                made[key] = iv
            out.append(iv)
        return out

    def described(self, s: int, e: int, lo: int, hi: int, top_ops: int) -> tuple[list[str], list[str], list[str]]:
        """(units, phases, ops) of events [s, e) (memoised: what runs in a range never changes)."""
        got = self._described.get((s, e, top_ops))
        if got is None:
            got = self._describe(s, e, lo, hi, top_ops)
            # bound the memo: candidates share most ranges, but grid search visits many
            if len(self._described) > 20_000:
                self._described.clear()
            self._described[(s, e, top_ops)] = got
        return got


_DESCRIBED = frozenset(("units", "phases", "ops"))


class LazyPressureInterval(PressureInterval):
    """A pressure interval whose ``units``, ``phases`` and ``ops`` are read off the trace on first
    access (``IntervalIndex.intervals(..., lazy=True)``). The planner's memory views hold dozens of
    intervals per candidate (a long video has one per block, step and VAE unit) and read the
    description of the first few only; every other use (``start``, ``stop``, peaks) needs none.
    Dumping, comparing or printing one describes it first, so it is never seen half-made."""

    _where: tuple[IntervalIndex, int, int, int, int, int] | None = PrivateAttr(default=None)

    def __getattr__(self, name: str) -> Any:
        if name in _DESCRIBED:
            self.describe()
            return self.__dict__[name]
        return super().__getattr__(name)  # type: ignore[misc]

    def describe(self) -> LazyPressureInterval:
        if "units" not in self.__dict__:
            index, s, e, lo, hi, top_ops = self._where  # type: ignore[misc]
            units, phases, ops = index.described(s, e, lo, hi, top_ops)
            values = {**self.__dict__, "units": list(units), "phases": list(phases), "ops": list(ops)}
            self.__dict__.clear()  # in field order, as a described interval has them
            self.__dict__.update({k: values[k] for k in PressureInterval.model_fields})
            self.__pydantic_fields_set__.update(_DESCRIBED)
        return self

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        return super(LazyPressureInterval, self.describe()).model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        return super(LazyPressureInterval, self.describe()).model_dump_json(**kwargs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyPressureInterval):
            other.describe()
        self.describe()
        return self.__dict__ == other.__dict__ if isinstance(other, PressureInterval) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr_args__(self) -> Any:
        return super(LazyPressureInterval, self.describe()).__repr_args__()


def _rle(values: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Run-length encoding of a per-event array: (start event of each run, value of each run)."""
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64), []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(values)) + 1])
    return starts, values[starts].tolist()


def _runs_in(runs: tuple[np.ndarray, list[int]], s: int, e: int) -> list[int]:
    """Values of the runs overlapping events [s, e), in event order."""
    starts, vals = runs
    i0 = int(np.searchsorted(starts, s, side="right")) - 1
    i1 = int(np.searchsorted(starts, e, side="left"))
    return vals[max(i0, 0):i1]


def segments(trace: MemoryTrace, curve: np.ndarray | None = None) -> list[Segment]:
    """Maximal runs of events of one unit within one phase, with a pattern hash per run."""
    curve = trace.active_curve() if curve is None else curve
    if trace.n_events == 0:
        return []
    mods = event_modules(trace)
    phs = event_phases(trace)
    unit_names = {m: unit_of(trace.modules[m]) for m in np.unique(mods) if m >= 0}
    unit_names[-1] = "<pipeline>"
    unit_ids = {u: i for i, u in enumerate(sorted(set(unit_names.values())))}
    unit_of_event = np.fromiter((unit_ids[unit_names[m]] for m in mods), dtype=np.int64, count=len(mods))
    key = unit_of_event * (len(trace.phases) + 1) + phs
    change = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate([[0], change])
    stops = np.concatenate([change, [trace.n_events]])
    # signed byte delta per event, and each event's size: the pattern of a segment is its
    # sequence of (alloc/free, size), which is what identical blocks share
    delta = trace.event_deltas()
    inv_units = {i: u for u, i in unit_ids.items()}
    out = []
    for s, e in zip(starts, stops, strict=True):
        d = delta[s:e]
        pattern = hashlib.blake2b(d.tobytes(), digest_size=8).hexdigest()
        out.append(
            Segment(
                start=int(s), stop=int(e), unit=inv_units[int(unit_of_event[s])],
                phase=trace.phases[phs[s]] if phs[s] >= 0 else "?", pattern=pattern,
                peak_bytes=int(curve[s:e].max()), alloc_bytes=int(d[d > 0].sum()),
            )
        )
    return out


def event_cdf(trace: MemoryTrace, group: Phase, thresholds: tuple[int, ...] = (50, 70, 90), curve: np.ndarray | None = None) -> dict[str, float]:
    """Fraction of the events of a phase (``Phase.DENOISE`` or ``Phase.DECODE``) whose live memory is below x% of
    that phase's peak (the paper's Figure 2). Memory is measured above the resident floor
    (weights and inputs), as the figure shows the phase's own dynamics."""
    curve = trace.active_curve() if curve is None else curve
    ph = event_phases(trace)
    groups = np.array([phase_of_trace(p) for p in trace.phases] + ["?"])
    sel = groups[ph] == group
    if not sel.any():
        return {}
    floor = int(trace.size[trace.category != Category.ACTIVATION].sum())
    vals = curve[sel] - floor
    peak = vals.max()
    if peak <= 0:
        return {}
    return {f"<{x}%": float((vals < peak * x / 100).mean()) for x in thresholds}


def summarize(trace: MemoryTrace, budget: int | None = None) -> MemorySummary:
    """Everything ``xema analyze`` reports for one trace."""
    curve = trace.active_curve()
    j = int(np.argmax(curve)) if trace.n_events else 0
    live = (trace.begin <= j) & (trace.end > j)
    weights = int(trace.size[trace.category == Category.WEIGHT].sum())
    inputs = int(trace.size[trace.category == Category.INPUT].sum())
    act = int(trace.size[live & (trace.category == Category.ACTIVATION)].sum())
    mods = event_modules(trace)
    phs = event_phases(trace)
    intervals = pressure_intervals(trace, budget, curve) if budget is not None else []
    frac = float((curve > budget).mean()) if budget is not None and trace.n_events else 0.0
    by_component: dict[str, int] = {}
    is_w = trace.category == Category.WEIGHT
    for m, size in zip(trace.module[is_w], trace.size[is_w], strict=True):
        comp = trace.modules[m].split(".", 1)[0] if m >= 0 else "?"
        by_component[comp] = by_component.get(comp, 0) + int(size)
    text = [p.peak_bytes for p in phase_peaks(trace, curve) if p.phase == Phase.TEXT]
    return MemorySummary(
        template=trace.meta.get("template", "?"),
        n_allocations=len(trace),
        n_events=trace.n_events,
        peak_bytes=int(curve[j]) if trace.n_events else 0,
        peak_event=j,
        peak_phase=trace.phases[phs[j]] if trace.n_events and phs[j] >= 0 else "?",
        peak_module=trace.modules[mods[j]] if trace.n_events and mods[j] >= 0 else "<pipeline>",
        weight_bytes=weights,
        input_bytes=inputs,
        activation_bytes_at_peak=act,
        phase_peaks=phase_peaks(trace, curve),
        budget_bytes=budget,
        pressure_intervals=intervals,
        pressure_event_fraction=frac,
        dit_cdf=event_cdf(trace, Phase.DENOISE, curve=curve),
        vae_cdf=event_cdf(trace, Phase.DECODE, curve=curve),
        weight_bytes_by_component=dict(sorted(by_component.items(), key=lambda kv: -kv[1])),
        text_peak_bytes=max(text, default=0),
        experts=expert_uses(trace),
    )


def expert_uses(trace: MemoryTrace) -> list[ExpertUse]:
    """The denoiser components (``transformer``, ``transformer_2``, ...) that allocate during
    the denoising steps, with their weights and the steps they run; empty when only one does
    (``xema_ray.analyzer.experts`` has an example)."""
    if not trace.step_bounds or not len(trace):
        return []
    comps = np.array([m.split(".", 1)[0] for m in trace.modules] + ["?"])
    comp = comps[trace.module]  # module -1 -> "?"
    bounds = np.asarray(trace.step_bounds, dtype=np.int64)
    act = (trace.category == Category.ACTIVATION) & (trace.begin < bounds[-1])
    is_w = trace.category == Category.WEIGHT
    out: list[ExpertUse] = []
    for name in sorted({c for c in comp[act] if c.startswith("transformer")}):
        ev = trace.begin[act & (comp == name)]
        steps = np.searchsorted(bounds, ev, side="right")
        out.append(ExpertUse(component=name, weight_bytes=int(trace.size[is_w & (comp == name)].sum()),
                             first_step=int(steps.min()), last_step=int(steps.max()),
                             first_event=int(ev.min()), last_event=int(ev.max())))
    return out if len(out) > 1 else []


def between_step_bytes(trace: MemoryTrace) -> int:
    """Bytes live at a denoising step boundary besides weights: what a batch paused there holds
    (latents, prompt and rotary embeddings, the step's guidance output, scheduler state). The
    largest over the steady steps' boundaries (a scheduler-step entry: the next step's first
    event); 0 when the trace has fewer than two steps."""
    starts = []
    for i, name in enumerate(trace.phases):
        if name.startswith(f"{Phase.DENOISE}.step") and name != f"{Phase.DENOISE}.step0":
            sel = trace.begin[trace.phase == i]
            if len(sel):
                starts.append(int(sel.min()))
    if not starts or trace.n_events == 0:
        return 0
    curve = trace.active_curve()
    is_w = trace.category == Category.WEIGHT
    deltas = np.zeros(trace.n_events + 1, dtype=np.int64)
    np.add.at(deltas, trace.begin[is_w], trace.size[is_w])
    np.add.at(deltas, trace.end[is_w], -trace.size[is_w])
    weights = np.cumsum(deltas[:-1])
    at = np.asarray(starts) - 1  # just before the boundary's first event
    at = at[at >= 0]
    return int((curve[at] - weights[at]).max()) if len(at) else 0


# ---------------------------------------------------------------------------- units
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_FACTORS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
            "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str | int) -> int:
    """"48GB" -> 48e9 bytes, "48GiB" -> 48·2^30, "1024" -> 1024.

    Example:
        >>> parse_bytes("48GB"), parse_bytes("1.5GiB")
        (48000000000, 1610612736)
    """
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 48GB (10^9), 48GiB (2^30) or a byte count")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _FACTORS[unit])


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"
