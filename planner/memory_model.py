"""Per-GPU memory of a candidate configuration, derived from the analyzer's trace (stage 2).

The analyzer traces each (template, batch) once on the meta device. A candidate's memory is that
trace's active curve transformed by what the configuration changes, event by event, so pressure
intervals keep their event positions across candidates (stage 3 compares them):

- sequence parallelism: the DiT phase's activations above the resident floor are split across
  the SP ranks (Ulysses and ring both give each rank 1/SP of the token-proportional tensors);
  the VAE decodes on one rank and is unchanged;
- block offload / HSDP of K blocks: those blocks' weights (all but each rank's shard) leave the
  resident floor; each is whole on the device again from when the previous chosen block starts
  (its hook issues the copy / all-gather: the library's prefetch) until the block ends, in every
  forward, and sequence parallelism does not split it (the library's phase-wide estimate,
  ``estimate_block_offload`` / ``estimate_hsdp``, where block runs do not line up per forward);
- chunking (DiT blocks, VAE up-blocks) by c: inside each chunked unit, what the unit allocates
  above its entry level is divided by c (the chunk's share);
- temporary serialization into k sub-batches: inside the serialized phase, what is allocated
  above the phase's entry level is divided by k.
- activation offload: at each event, the conv caches alive then (all but the one being read)
  leave the device.
- static layout: reserved = weights + activations × the layout solver's overhead × (1 + the dynamic
  fraction), the runtime allocator's own arithmetic (``xema_ray.allocator.margins``): the weights
  are placed at load outside the arena, the static region holds the request's allocations
  (``LAYOUT_OVERHEAD`` × their lower bound before a layout is solved) and the dynamic region is
  ``DYNAMIC_FRACTION`` of the static region (§6.2). Once ``xema plan --layouts`` has solved an
  entry's layout, ``planner.layouts.attach_layout`` replaces the entry's predicted peak by the
  solver's reserved bytes with the same margin (``margins.reserved_with_layout``).

The planner confirms its chosen configuration by tracing it with the mitigations applied when the
mitigation library is installed (``confirm``); the transform is the fast model used in the search.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from xema_ray.allocator.margins import DYNAMIC_FRACTION, LAYOUT_OVERHEAD
from xema_ray.memory.analysis import IntervalIndex, PressureInterval, event_phases
from xema_ray.memory.trace import Category, MemoryTrace
from xema_ray.mitigation.block_offload import BlockOffloadConfig
from xema_ray.mitigation.hsdp import HSDPConfig
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.vocabulary import Phase, phase_of_trace

from planner.estimates import conv_cache_allocations, estimate_block_offload, estimate_hsdp, evenly_spread
from planner.vae_bands import BandGroup

#: (modules, chunks) -> band groups of a VAE chunking action (``planner.vae_bands.VaeLayout.groups``)
VaeGroups = Callable[[tuple[str, ...], int], "list[BandGroup]"]


_BLOCK_RE = re.compile(r"^transformer\.(\w+)\.(\d+)(?:\.|$)")


@dataclass
class TraceProfile:
    """What the memory model needs from one trace, computed once."""

    trace: MemoryTrace
    block_paths: list[str]  # DiT block unit names in execution order ("transformer.transformer_blocks.3")
    curve: np.ndarray = field(init=False)
    floor: int = field(init=False)
    _runs: dict[tuple[object, str], list[tuple[int, int]]] = field(init=False, default_factory=dict)
    _curves: dict[tuple[object, ...], np.ndarray] = field(init=False, default_factory=dict)
    _spans: dict[tuple[object, ...], tuple[int, np.ndarray]] = field(init=False, default_factory=dict)
    #: per event, bytes of block weights a mitigation in the traced run holds whole on the device
    #: (traced as activations, but not split by sequence parallelism); None for unmitigated traces
    held_weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.curve = self.trace.active_curve().astype(np.float64)
        self.floor = int(self.trace.size[self.trace.category != Category.ACTIVATION].sum())

    @cached_property
    def groups(self) -> np.ndarray:
        """Phase per event (``Phase``: text, denoise, post, decode; '?' before any allocation)."""
        ph = event_phases(self.trace)
        names = np.array([phase_of_trace(p) for p in self.trace.phases] + ["?"])
        return names[ph]

    @cached_property
    def interval_index(self) -> IntervalIndex:
        return IntervalIndex(self.trace)

    def in_group(self, group: Phase) -> np.ndarray:
        """Per event, whether it belongs to a phase group (cached: a string comparison per event)."""
        key = ("in_group", group)
        if key not in self._curves:
            self._curves[key] = self.groups == group
        return self._curves[key]

    def group_runs(self, group: Phase) -> list[tuple[int, int]]:
        """Runs of events of a phase group (cached: every candidate asks again)."""
        key = ("group", group)
        if key not in self._runs:
            self._runs[key] = self.runs(self.in_group(group))
        return self._runs[key]

    def live_caches(self, paths: tuple[str, ...]) -> np.ndarray:
        """Per event, the bytes of conv caches (clones returned by modules under ``paths``)
        alive after it, less the largest one (cached)."""
        key = ("caches", paths)
        if key not in self._curves:
            t = self.trace
            sel = np.flatnonzero(conv_cache_allocations(t, paths))
            delta = np.zeros(t.n_events + 1, dtype=np.float64)
            np.add.at(delta, t.begin[sel], t.size[sel].astype(np.float64))
            np.add.at(delta, t.end[sel], -t.size[sel].astype(np.float64))
            # the cache being read is back on the device: the largest one of the convolution
            # running (it reads its own cache, made by the same module one frame batch before)
            owner_max: dict[str, float] = {}
            for i in sel.tolist():
                name = t.modules[t.module[i]]
                if not name.rsplit(".", 1)[-1].startswith("conv"):
                    continue  # a norm's short-lived clone, not a convolution's cache
                owner_max[name] = max(owner_max.get(name, 0.0), float(t.size[i]))
            per_module = np.zeros(len(t.modules) + 1, dtype=np.float64)  # last slot: no module
            for j, name in enumerate(t.modules):
                parts = name.split(".")
                # the owner itself, or the inner convolution of a causal conv that owns the cache
                for k in ((len(parts), len(parts) - 1) if parts[-1] == "conv" else (len(parts),)):
                    got = owner_max.get(".".join(parts[:k]))
                    if got is not None:
                        per_module[j] = got
                        break
            kept = per_module[self.event_modules]
            self._curves[key] = np.maximum(np.cumsum(delta)[:-1] - kept, 0.0)
        return self._curves[key]

    def unit_runs(self, paths: list[str], group: Phase) -> list[tuple[int, int]]:
        """Runs of events of the given mitigation units within a phase group (cached)."""
        key = (tuple(sorted(paths)), group)
        if key not in self._runs:
            index = self.interval_index
            wanted = np.zeros(len(index.unit_names) + 1, dtype=bool)  # last slot: events of no unit
            chosen = set(paths)
            wanted[[i for i, u in enumerate(index.unit_names) if u in chosen]] = True
            self._runs[key] = self.runs(wanted[index.event_unit] & self.in_group(group))
        return self._runs[key]

    def module_runs(self, paths: tuple[str, ...], group: Phase, glue: tuple[str, ...] | None = None) -> list[tuple[int, int]]:
        """Runs of events of the modules under ``paths`` (module-path prefixes, finer than
        mitigation units: an up-block's resnets one by one, a chain's modules) within a phase
        group (cached). With ``glue`` (a chain's parent and the start's ancestors), their own
        events and events of no module continue a run (code between the chain's modules, frees
        when they return)."""
        key = ("modules", paths, group, glue)
        if key not in self._runs:
            t = self.trace
            chosen = set(paths)
            under = np.array([not chosen.isdisjoint(a) for a in self.module_ancestors] + [False])
            mods = self.event_modules
            inside = under[mods] & self.in_group(group)
            if glue is None:
                self._runs[key] = self.runs(inside)
            else:
                own = (np.array([n in glue for n in t.modules] + [True])[mods]) & self.in_group(group)
                runs = []
                for s, e in self.runs(inside | own):
                    hits = np.flatnonzero(inside[s:e])
                    if len(hits):
                        runs.append((s + int(hits[0]), e))  # from the chain's first event on
                self._runs[key] = runs
        return self._runs[key]

    def temporaries(self, paths: tuple[str, ...], group: Phase, glue: tuple[str, ...] | None = None) -> np.ndarray:
        """Per event, the bytes of allocations made *and freed* inside one run of the modules
        under ``paths`` (what banding shrinks: a chunked unit's or chain's output, the conv
        caches it returns and anything else it leaves behind stay whole) (cached)."""
        key = ("temporaries", paths, group, glue)
        if key not in self._curves:
            t, index = self.trace, self.interval_index
            delta = np.zeros(t.n_events + 1, dtype=np.float64)
            for s, e in self.module_runs(paths, group, glue):
                lo, hi = np.searchsorted(index.begins_sorted, [s, e])
                sel = index.order[lo:hi]
                sel = sel[t.end[sel] <= e]
                np.add.at(delta, t.begin[sel], t.size[sel].astype(np.float64))
                np.add.at(delta, t.end[sel], -t.size[sel].astype(np.float64))
            self._curves[key] = np.cumsum(delta)[:-1]
        return self._curves[key]

    def temporaries_span(self, paths: tuple[str, ...], group: Phase, glue: tuple[str, ...] | None = None) -> tuple[int, np.ndarray]:
        """``temporaries`` cut to the events where it is not zero: (first event, values) (cached)."""
        key = ("span", paths, group, glue)
        if key not in self._spans:
            full = self.temporaries(paths, group, glue)
            nz = np.flatnonzero(full)
            lo, hi = (int(nz[0]), int(nz[-1]) + 1) if len(nz) else (0, 0)
            self._spans[key] = (lo, full[lo:hi])
        return self._spans[key]

    @cached_property
    def module_ancestors(self) -> list[frozenset[str]]:
        """Per module of the trace, its path and every enclosing path ("a.b.c": a, a.b, a.b.c)."""
        out = []
        for n in self.trace.modules:
            parts = n.split(".")
            out.append(frozenset(".".join(parts[:k]) for k in range(1, len(parts) + 1)))
        return out

    @cached_property
    def event_modules(self) -> np.ndarray:
        from xema_ray.memory.analysis import event_modules

        return event_modules(self.trace)

    def block_windows(self) -> np.ndarray | None:
        """Per DiT block, its [start, stop) event run in each transformer forward, as an array
        (blocks, forwards, 2); None if the blocks' runs do not line up one per forward."""
        if "windows" not in self._curves:
            runs = [self.unit_runs([p], Phase.DENOISE) for p in self.block_paths]
            same = runs and all(len(r) == len(runs[0]) and r for r in runs)
            self._curves["windows"] = np.array(runs, dtype=np.int64) if same else None  # type: ignore[assignment]
        return self._curves["windows"]  # type: ignore[return-value]

    @cached_property
    def block_weights(self) -> np.ndarray:
        """Resident weight bytes of each DiT block (index = position in ``block_paths``), as the
        allocator holds them: one rounded allocation per parameter."""
        return self._block_sum(self.trace.size)

    @cached_property
    def blocks_by_weight(self) -> list[int]:
        """DiT block indices, heaviest first (ties: execution order)."""
        w = self.block_weights
        return sorted(range(len(w)), key=lambda i: (-int(w[i]), i))

    @cached_property
    def block_flat_weights(self) -> np.ndarray:
        """Each DiT block's weights flattened into one buffer (HSDP's gather unit): the
        parameters' own bytes, without per-allocation rounding."""
        return self._block_sum(self.trace.nbytes)

    def _block_sum(self, sizes: np.ndarray) -> np.ndarray:
        index = {p: i for i, p in enumerate(self.block_paths)}
        w = np.zeros(len(self.block_paths), dtype=np.int64)
        resident = np.flatnonzero(self.trace.category == Category.WEIGHT)
        for r in resident:
            name = self.trace.modules[self.trace.module[r]]
            m = _BLOCK_RE.match(name)
            if m:
                key = f"transformer.{m.group(1)}.{m.group(2)}"
                if key in index:
                    w[index[key]] += sizes[r]
        return w

    def runs(self, mask: np.ndarray) -> list[tuple[int, int]]:
        """Maximal [start, stop) runs of True in an event mask."""
        edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
        return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


def weight_action_bytes(prof: TraceProfile, m: Mitigation, world: int) -> tuple[list[int], np.ndarray, int]:
    """For a block offload / HSDP action: its blocks in execution order, the bytes each one is
    whole on the device inside its window, and the bytes the action takes off the resident floor
    (``prof`` is the unmitigated trace; HSDP keeps 1/world of each flattened block per rank)."""
    n = len(prof.block_paths)
    order = sorted(m.blocks) if m.blocks is not None else list(evenly_spread(m.intensity, n))
    if m.kind == "hsdp":
        w, flat = prof.block_weights, prof.block_flat_weights
        return order, flat, sum(int(w[b]) - int(flat[b]) // world for b in order)
    return order, prof.block_weights, sum(int(prof.block_weights[b]) for b in order)


def add_block_windows(curve: np.ndarray, windows: np.ndarray, order: list[int], weights: np.ndarray) -> None:
    """Add each offloaded / sharded block's whole weights while they are on the device: from when
    the previous chosen block starts (its hook issues this one's copy or all-gather) until this
    block ends (its hook frees them), in every transformer forward (in place)."""
    if not order:
        return
    # one pass over the span the windows cover: each event gets the (integer) sum of the
    # weights whole on the device then, from a difference array
    prev = [order[k - 1] if k else b for k, b in enumerate(order)]
    starts = windows[prev][:, :, 0].ravel()
    stops = windows[order][:, :, 1].ravel()
    w = np.repeat(np.asarray(weights, dtype=np.int64)[order], windows.shape[1])
    lo, hi = int(starts.min()), int(stops.max())
    delta = np.zeros(hi - lo + 1, dtype=np.int64)
    np.add.at(delta, starts - lo, w)
    np.add.at(delta, stops - lo, -w)
    curve[lo:hi] += np.cumsum(delta[:-1])


def _shrink_runs(curve: np.ndarray, base: np.ndarray, runs: list[tuple[int, int]], factor: float) -> None:
    """Inside each run, divide what lies above the run's entry level by ``factor`` (in place).
    ``base`` is the untransformed curve, whose entry level is what the unit starts from."""
    for s, e in runs:
        level = base[s - 1] if s > 0 else 0.0
        above = np.maximum(base[s:e] - level, 0.0)
        curve[s:e] -= above * (1.0 - 1.0 / factor)


class MemoryModel:
    """Reserved memory per GPU for candidate configurations of one template family."""

    def __init__(self, profile_for_batch, layout_overhead: float = LAYOUT_OVERHEAD,  # type: ignore[no-untyped-def]
                 dynamic_margin: float = DYNAMIC_FRACTION, vae_groups: VaeGroups | None = None) -> None:
        """``profile_for_batch(batch) -> TraceProfile`` supplies (cached) traces per batch size;
        ``vae_groups(modules, chunks)`` maps a VAE chunking action to its band groups (per-unit
        runs and chains with their effective band counts, ``planner.vae_bands``); without it
        each path is one mitigation unit divided by the chunk count."""
        self._profile_for_batch = profile_for_batch
        self._vae_groups = vae_groups
        self.layout_overhead = layout_overhead
        self.dynamic_margin = dynamic_margin

    def reserved_curve(self, cfg: ExecutionConfig) -> tuple[np.ndarray, TraceProfile]:
        prof: TraceProfile = self._profile_for_batch(cfg.batch)
        base = prof.curve
        curve = base.copy()
        if cfg.sp > 1:
            # token-proportional DiT activations split across the ranks; weights a mitigation
            # holds on the device for a while (a traced offload / HSDP window) do not
            held = prof.held_weights
            for s, e in prof.group_runs(Phase.DENOISE):
                kept = held[s:e] if held is not None else 0.0
                curve[s:e] = prof.floor + kept + (base[s:e] - prof.floor - kept) / cfg.sp
        floor = float(prof.floor)
        for m in cfg.mitigations:
            floor -= self._apply(curve, base, prof, cfg, m)
        # weights are placed once at load, outside the arena, so the layout's overhead and the
        # dynamic region (a fraction of the static region) only touch activations (and the weights
        # a mitigation holds for a while), not the resident floor: margins.reserved_with_layout
        arena = (curve - floor) * self.layout_overhead
        return floor + arena * (1.0 + self.dynamic_margin), prof

    def _apply(self, curve: np.ndarray, base: np.ndarray, prof: TraceProfile, cfg: ExecutionConfig, m: Mitigation) -> int:
        """Apply one mitigation to ``curve`` in place; returns the bytes it takes off the resident floor."""
        if m.kind in ("block_offload", "hsdp"):
            world = max(2, cfg.sp)  # HSDP shards across the SP group that runs the batch
            order, w, removed = weight_action_bytes(prof, m, world)
            if not order:
                return 0
            blocks = tuple(order)
            # off the device (or all but this rank's shard) outside the blocks' windows
            curve -= removed
            windows = prof.block_windows()
            if windows is None:  # block runs do not line up per forward: the library's phase-wide bound
                sizes = w.tolist()
                saving = (estimate_block_offload(sizes, BlockOffloadConfig(blocks=blocks)) if m.kind == "block_offload"
                          else estimate_hsdp(sizes, HSDPConfig(blocks=blocks), world))
                for s, e in prof.group_runs(Phase.DENOISE):
                    curve[s:e] += saving.at(Phase.DECODE) - max(0, saving.at(Phase.DENOISE))
                return removed
            add_block_windows(curve, windows, order, w)
            return removed
        elif m.kind == "dit_chunking":
            paths = [prof.block_paths[b] for b in m.blocks] if m.blocks is not None else list(m.modules or ())
            _shrink_runs(curve, base, prof.unit_runs(paths, Phase.DENOISE), m.intensity)
        elif m.kind == "vae_chunking":
            if self._vae_groups is None:
                _shrink_runs(curve, base, prof.unit_runs(list(m.modules or ()), Phase.DECODE), m.intensity)
            else:
                for g in self._vae_groups(tuple(m.modules or ()), m.intensity):
                    # only where the group's temporaries are not zero (elsewhere nothing changes)
                    lo, temp = prof.temporaries_span(g.paths, Phase.DECODE, g.glue)
                    curve[lo:lo + len(temp)] -= temp * (1.0 - 1.0 / g.divisor)
        elif m.kind == "temporary_serialization":
            group = Phase.DECODE if any(p.startswith("vae") for p in (m.modules or ())) else Phase.DENOISE
            _shrink_runs(curve, base, prof.group_runs(group), m.intensity)
        elif m.kind == "activation_offload":
            # event by event, the conv caches (the clones the targeted modules return) alive then
            # leave the device, except the largest: the one being read is back
            group = Phase.DENOISE if any(p.startswith("transformer") for p in (m.modules or ())) else Phase.DECODE
            live = prof.live_caches(tuple(m.modules or ()))
            for s, e in prof.group_runs(group):
                curve[s:e] -= live[s:e]
        return 0

    def view(self, cfg: ExecutionConfig, budget: int) -> tuple[int, tuple[PressureInterval, ...]]:
        curve, prof = self.reserved_curve(cfg)
        as_int = curve.astype(np.int64)
        # described when read: stage 3 reads the first few of a candidate's intervals
        ivs = prof.interval_index.intervals(budget, as_int, lazy=True)
        return int(as_int.max()), tuple(ivs)
