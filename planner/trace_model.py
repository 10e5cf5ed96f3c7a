"""The real ``PlannerModel``: analyzer traces for memory, the profiler / cost model for latency.

Memory comes from ``planner.memory_model`` (one meta-device trace per batch size, transformed per
candidate). Latency comes from a ``latency_fn(config) -> seconds`` — the latency profiler where a
profile store has the segments, the roofline cost model elsewhere. Mitigation options for an
interval are the primitives applicable to the operators inside it (§7.3 stage 3).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from xema_ray.memory.analysis import PressureInterval
from xema_ray.plan import ExecutionConfig, Mitigation
from xema_ray.templates import RequestTemplate
from xema_ray.vocabulary import Phase, phase_of_trace

from planner.estimates import evenly_spread
from planner.memory_model import MemoryModel, TraceProfile, add_block_windows, weight_action_bytes
from planner.model import MemoryView, MitigationOption, Rejection
from planner.traces import PLANNER_TRACE, TraceCache
from planner.vae_bands import VaeLayout

DIT_CHUNKS = (2, 4, 8, 16)  # sequence chunks tried for DiT chunking (feed-forward, norms, rotary, attention)
VAE_CHUNKS = (2, 4, 8, 16, 32, 64)  # bands tried for VAE chunking (4K needs 32 on a 48 GB card)
# Memory is searched on a 4-step trace: every step after the first repeats the same allocations
# exactly (the analyzer checks it), so 4 steps hold every distinct memory state of a 50-step
# request while the curve is ~12x shorter. Latency still comes from the full template.
PLANNER_STEPS = 4
ALL_TENSORS = 4096  # activation offload intensity meaning "every cache the modules produce"
_BLOCK_UNIT = re.compile(r"^transformer\.\w+\.(\d+)$")


class UnrunnableBatch(RuntimeError):
    """The pipeline cannot run the template at this batch size, whatever the memory."""


def block_paths(template: RequestTemplate) -> list[str]:
    """DiT block unit names in execution order, from the spec (no model needed)."""
    return [f"transformer.{p}" for p in template.spec.dit_block_paths()]


@dataclass
class TracePlannerModel:
    """Planner model for one template on one hardware configuration."""

    template: RequestTemplate
    latency_fn: Callable[[ExecutionConfig], float]
    traces: TraceCache
    _profiles: dict[int, TraceProfile] = field(default_factory=dict)
    _failed: dict[int, str] = field(default_factory=dict)
    _confirmations: dict[tuple[str, int], Rejection | None] = field(default_factory=dict)
    #: reserved peak of each confirmed configuration, traced with its mitigations applied
    traced_peaks: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._blocks = block_paths(self.template)
        self._memory = MemoryModel(self._profile, vae_groups=self._vae_groups)
        self._bands: dict[tuple[tuple[str, ...], int], list] = {}  # type: ignore[type-arg]

    @property
    def vae(self) -> VaeLayout:
        if not hasattr(self, "_vae"):
            self._vae = VaeLayout(self.template, self.traces.pipeline(self.template))
        return self._vae

    def _vae_groups(self, modules: tuple[str, ...], chunks: int) -> list:  # type: ignore[type-arg]
        key = (modules, chunks)
        if key not in self._bands:
            self._bands[key] = self.vae.groups(modules, chunks)
        return self._bands[key]

    def dit_batch(self, batch: int) -> int:
        """The batch one transformer forward runs for ``batch`` requests: the CFG pair (and
        LTX-2's guidance passes) multiply it; temporary serialization splits this batch."""
        return batch * self.template.spec.dit_batch_multiplier()

    def _profile(self, batch: int) -> TraceProfile:
        if batch in self._failed:
            raise UnrunnableBatch(self._failed[batch])
        if batch not in self._profiles:
            try:
                steps = min(self.template.steps, PLANNER_STEPS)
                trace = self.traces.get(self.template.with_(batch=batch, steps=steps))
            except RuntimeError as e:
                # the real pipeline cannot run this shape at all (e.g. diffusers' CogVideoX
                # SafeConv3d splits a large batch into pieces shorter than its kernel): no
                # mitigation makes it fit, so the planner must see it as infeasible
                self._failed[batch] = f"pipeline fails at batch {batch}: {str(e).splitlines()[0]}"
                raise UnrunnableBatch(self._failed[batch]) from e
            self._profiles[batch] = TraceProfile(trace, self._blocks)
        return self._profiles[batch]

    # ------------------------------------------------------------------ PlannerModel
    def memory(self, config: ExecutionConfig, budget: int) -> MemoryView:
        try:
            peak, ivs = self._memory.view(config, budget)
        except UnrunnableBatch as e:
            never = PressureInterval(start=0, stop=1, peak_bytes=2**62, excess_bytes=2**62 - budget, phases=[],
                                     units=[], ops=[str(e)])
            return MemoryView(peak_bytes=2**62, intervals=(never,))
        return MemoryView(peak_bytes=peak, intervals=ivs)

    def latency(self, config: ExecutionConfig) -> float:
        return self.latency_fn(config)

    def reserved_curve(self, config: ExecutionConfig) -> tuple[np.ndarray, TraceProfile]:
        """Reserved bytes per GPU at every event of the trace under ``config`` (what ``memory``
        reads its peak and pressure intervals from), and the trace's profile (the console plots it)."""
        return self._memory.reserved_curve(config)

    def full_mitigation(self, config: ExecutionConfig) -> tuple[Mitigation, ...]:
        n = len(self._blocks)
        strongest_vae = self.vae.shapes([])[-1][1]
        out = [
            Mitigation(kind="block_offload", blocks=tuple(range(n)), intensity=n),
            Mitigation(kind="dit_chunking", blocks=tuple(range(n)), intensity=max(DIT_CHUNKS)),
            Mitigation(kind="vae_chunking", modules=strongest_vae, intensity=max(VAE_CHUNKS)),
        ]
        if self.template.spec.offloadable_conv_caches:
            out.append(Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=ALL_TENSORS))
        if self.dit_batch(config.batch) > 1:  # the CFG pair too, at batch 1
            out.append(Mitigation(kind="temporary_serialization", modules=("transformer",),
                                  intensity=self.dit_batch(config.batch)))
        if config.batch > 1:
            out.append(Mitigation(kind="temporary_serialization", modules=("vae.decoder",), intensity=config.batch))
        return tuple(out)

    def options(self, config: ExecutionConfig, interval: PressureInterval) -> list[MitigationOption]:
        try:
            prof = self._profile(config.batch)
        except UnrunnableBatch:
            return []
        opts: list[MitigationOption] = []
        n = len(self._blocks)
        # weights: offload (or shard) the fewest blocks that could cover the excess, then more
        heaviest = prof.blocks_by_weight
        # fewest blocks that could cover the excess even if the heaviest are taken: no smaller K can
        cum = np.cumsum(prof.block_weights[heaviest]) - 2 * (prof.block_weights.max() if n else 0)
        k_min = min(n, int(np.searchsorted(cum, interval.excess_bytes)) + 1) if n else 0
        ladder = sorted({*range(max(1, k_min), n + 1, _ladder_step(n)), n}) if n else []
        current_k = max((m.intensity for m in config.mitigations if m.kind == "block_offload"), default=0)
        for k in ladder:
            if k > current_k:
                # evenly spaced blocks hide transfers best (§5.1); the heaviest blocks free the most
                # bytes per block (Flux.2's double-stream blocks are twice the single ones)
                for rule, blocks in (("even", evenly_spread(k, n)), ("heaviest", tuple(sorted(heaviest[:k])))):
                    opts.append(self._option(config, Mitigation(kind="block_offload", blocks=blocks, intensity=k),
                                             family=f"block_offload:{rule}"))
        if config.sp > 1:
            for k in ladder:
                opts.append(self._option(config, Mitigation(kind="hsdp", blocks=evenly_spread(k, n), intensity=k)))
        groups = {phase_of_trace(p) for p in interval.phases}
        if Phase.DENOISE in groups:
            opts += self._dit_options(config, interval)
        if Phase.DECODE in groups:
            opts += self._vae_options(config, interval)
        return opts

    def _dit_options(self, config: ExecutionConfig, interval: PressureInterval) -> list[MitigationOption]:
        """DiT chunking of the interval's blocks; serialization of the transformer's batch (the
        CFG pair at batch 1); and the two combined (each sub-batch chunked), per sub-batch count
        a family over the chunk counts."""
        opts: list[MitigationOption] = []
        idx = sorted({int(m.group(1)) + self._offset(u) for u in interval.units if (m := _BLOCK_UNIT.match(u))})
        chunked = [Mitigation(kind="dit_chunking", blocks=tuple(idx), intensity=c) for c in DIT_CHUNKS] if idx else []
        opts += [self._option(config, a) for a in chunked]
        for k in _divisors(self.dit_batch(config.batch)):
            serial = Mitigation(kind="temporary_serialization", modules=("transformer",), intensity=k)
            opts.append(self._option(config, serial))
            opts += [MitigationOption((serial, a), label=f"serialization×{k}+dit_chunking×{a.intensity}",
                                      family=f"serialize{k}+dit_chunking") for a in chunked]
        return opts

    def _vae_options(self, config: ExecutionConfig, interval: PressureInterval) -> list[MitigationOption]:
        """Per VAE chunking shape (per unit, chain from the last upsampler, chain from its
        up-block: ``planner.vae_bands``) a family over the band counts; for CogVideoX's causal
        VAE also conv-cache offload, alone and with each shape; serialization of the decoder's
        batch."""
        opts: list[MitigationOption] = []
        ups = [u for u in interval.units if u.startswith("vae.decoder.up_blocks")]
        # a configuration holds one VAE chunking action and a new one replaces it: propose only
        # ones that keep what it covers (its up-blocks, its bands, its shape), so that clearing
        # this interval never reopens an earlier one
        held = next((m for m in config.mitigations if m.kind == "vae_chunking"), None)
        least_shape, least_chunks = 0, 1
        if held is not None:
            ups = sorted({*ups, *(u for u in held.modules or () if u.startswith("vae.decoder.up_blocks"))})
            least_chunks = held.intensity
            least_shape = 2 if any("[" in u and "upsamplers" not in u for u in held.modules or ()) else (
                1 if any("[" in u for u in held.modules or ()) else 0)
        counts = [c for c in VAE_CHUNKS if c >= least_chunks]
        offload = Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=ALL_TENSORS)
        causal = self.template.spec.offloadable_conv_caches  # its conv caches can move to the host
        if causal:
            opts.append(self._option(config, offload))
        for label, mods in self.vae.shapes(ups)[least_shape:]:
            for c in counts:
                opts.append(self._option(config, Mitigation(kind="vae_chunking", modules=mods, intensity=c),
                                         family=f"vae:{label}"))
            if causal:
                opts += [MitigationOption((offload, Mitigation(kind="vae_chunking", modules=mods, intensity=c)),
                                          label=f"offload+vae:{label}×{c}", family=f"offload+vae:{label}")
                         for c in counts]
        if config.batch > 1:
            for k in _divisors(config.batch):
                opts.append(self._option(config, Mitigation(kind="temporary_serialization", modules=("vae.decoder",), intensity=k)))
        return opts

    def milder(self, config: ExecutionConfig, action: Mitigation) -> list[Mitigation]:
        """``action`` (block offload or HSDP) on 1, 2, ... fewer blocks, down to the rung below it
        on ``options``' ladder, picked by the same rule (evenly spread or heaviest first)."""
        n = len(self._blocks)
        if action.kind not in ("block_offload", "hsdp") or n == 0:
            return []
        k = action.intensity
        even = action.blocks is None or tuple(action.blocks) == evenly_spread(k, n)
        heaviest = [] if even else self._profile(config.batch).blocks_by_weight
        out = []
        for j in range(k - 1, max(0, k - _ladder_step(n)), -1):
            blocks = evenly_spread(j, n) if even else tuple(sorted(heaviest[:j]))
            out.append(Mitigation(kind=action.kind, blocks=blocks, intensity=j))
        return out

    def confirm(self, config: ExecutionConfig, budget: int) -> Rejection | None:
        """Trace ``config`` with its mitigations really applied (the mitigation library on the
        meta device) and check it fits; None if it does, else why not. The search uses the fast
        analytic transform; this is the analyzer's word on the configuration the planner picks.
        Results are kept: several planners often pick the same configuration."""
        if not config.mitigations:
            return None  # the search already used this exact trace
        key = (config.model_dump_json(), budget)
        if key not in self._confirmations:
            self._confirmations[key] = self._confirm(config, budget)
        return self._confirmations[key]

    def _confirm(self, config: ExecutionConfig, budget: int) -> Rejection | None:
        try:
            prof = self.traced_profile(config)
        except (RuntimeError, ValueError) as e:
            # the pipeline fails at this shape, or the library cannot combine these primitives
            # (e.g. serialization cannot rejoin offloaded conv caches): not a runnable plan
            return Rejection(f"cannot run with these mitigations: {str(e).splitlines()[0]}")
        # the traced curve already holds the mitigations; SP and the layout margins still apply
        peak, ivs = MemoryModel(lambda _batch: prof).view(config.model_copy(update={"mitigations": ()}), budget)
        self.traced_peaks[config.model_dump_json()] = peak
        if ivs:
            return Rejection(f"traced with its mitigations it peaks at {peak / 1e9:.2f} GB, over the {budget / 1e9:.2f} GB budget",
                             overshoot_bytes=peak - budget)
        return None

    def traced_profile(self, config: ExecutionConfig) -> TraceProfile:
        """The trace of ``config``'s batch with its mitigations really applied (meta device)."""
        from xema_ray.analyzer.mitigated import trace_with_mitigations

        t = self.template.with_(batch=config.batch, steps=min(self.template.steps, PLANNER_STEPS))
        trace = trace_with_mitigations(t, list(config.mitigations), options=PLANNER_TRACE,
                                       world_size=max(2, config.sp), pipeline=self.traces.pipeline(t))
        prof = TraceProfile(trace, self._blocks)
        prof.held_weights = self._held_weights(prof, config)
        return prof

    def _held_weights(self, traced: TraceProfile, config: ExecutionConfig) -> np.ndarray | None:
        """Per event of a mitigated trace, the offloaded / sharded blocks' weights held whole."""
        weight_actions = [m for m in config.mitigations if m.kind in ("block_offload", "hsdp")]
        windows = traced.block_windows()
        if not weight_actions or windows is None:
            return None
        held = np.zeros(traced.trace.n_events, dtype=np.float64)
        base = self._profile(config.batch)  # unmitigated: every block's full weights
        for m in weight_actions:
            order, whole, _ = weight_action_bytes(base, m, max(2, config.sp))
            add_block_windows(held, windows, order, whole)
        return held

    # ------------------------------------------------------------------ helpers
    def _offset(self, unit: str) -> int:
        """Flux.2's single-stream blocks come after its double-stream ones in block order."""
        return self.template.spec.transformer_config["num_layers"] if ".single_transformer_blocks." in unit else 0

    def _option(self, config: ExecutionConfig, action: Mitigation, family: str = "") -> MitigationOption:
        # None is marked zero-overhead up front: telling would take a latency estimate of every
        # option's configuration. Stage 3 profiles only each family's mildest option that clears,
        # and a free one then wins on latency.
        return MitigationOption((action,), label=f"{action.kind}×{action.intensity}", family=family)


def _ladder_step(n_blocks: int) -> int:
    """Block counts tried for offload / HSDP go up in steps of ~1/12 of the blocks (stage 3 then
    takes the chosen one down block by block, ``milder``)."""
    return max(1, n_blocks // 12)


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]
