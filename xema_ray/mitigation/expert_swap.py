"""The expert switch of a two-expert model (Wan2.2-A14B) executed as planned (``ExpertSwap``).

Wan2.2-A14B denoises with two transformers of one architecture that take turns: the high-noise
expert (``pipe.transformer``) for the first steps, the low-noise one (``pipe.transformer_2``)
after the boundary step. Holding both needs ~57 GB of bf16 weights; one at a time ~28.6 GB.

``swap_prefetched`` (``ExpertSwapper``, worker state made once at load, and ``apply_expert_swap``
for each batch): both experts' DiT blocks are homed on (pinned) host memory at load and the
high-noise expert is brought to the device then, so the device holds one expert at a time. The
device memory the load placed for one expert's blocks is one region the two experts take in
turn: block ``i`` of either expert lives in slot ``i`` (both experts share one architecture), so
what the departing expert gave up at the switch is what the arriving one is copied into, and no
request allocates an expert block except the prefetch (the static layout covers the request's
activations and the prefetch alone; the slots are weights placed at load):

1. during the last ``prefetch_steps`` high-noise steps the side stream copies the first
   ``prefetch_blocks`` low-noise blocks into memory allocated from what the high-noise steps
   leave free (their slots are still the high-noise expert's); it is freed when the decode starts;
2. at the switch (the low-noise expert's first forward) the high-noise blocks leave their slots
   (their pinned host copies stay: nothing is copied back) and the other low-noise blocks are
   issued on the side stream into those slots, each copy ordered after the compute that read the
   slot last; each block's pre-hook waits for its own copy, so the first low-noise forward runs
   the blocks already there while the rest arrive (block offload's overlap);
3. when the VAE decode starts, the low-noise blocks are released and the first ``decode_blocks``
   high-noise blocks come back into their slots under the decode; the rest are issued when the
   batch ends, and the next request's first forward waits for each just before it runs it.

Every copy goes through ``xema_ray.platforms.streams``: issued on the side stream, waited for by
the compute stream with its blocks marked used there (``TransferStream.wait`` -> ``mark_used``),
so a released block's memory is not handed to the next copy before the compute stream has
passed its last read (the deferred free of the caching and the static allocator; the emulated
asynchronous device in ``pytest -m streams`` checks it), and a copy into a slot is ordered after
the compute issued before it (``streams.copy_into``). On meta (``xema verify``) a prefetch is an
allocation at the moment it is issued and a copy into a slot allocates nothing, so the counted
peak is the load's one expert plus the prefetch on top of the last high-noise steps.

``split_blocks``: the first ``host_blocks`` blocks of each expert are homed on the host and
streamed in every forward: block offload (``xema_ray.mitigation.block_offload``) of both experts,
with no event at the switch.

Example:
    >>> from xema_ray.plan import ExpertSwap
    >>> expert_host_modules(ExpertSwap(strategy="split_blocks", host_blocks=2), ["blocks.0", "blocks.1", "blocks.2"])
    ('transformer.blocks.0', 'transformer.blocks.1', 'transformer_2.blocks.0', 'transformer_2.blocks.1')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks import ModelHook
from torch import nn

from xema_ray.mitigation.block_offload import BlockOffloadConfig, OffloadedBlock, apply_block_offload
from xema_ray.mitigation.hooks import HOOK_NAMES, MitigationHandle, hook_module
from xema_ray.placement import compute_device
from xema_ray.plan import ExpertSwap
from xema_ray.platforms import streams as _device

if TYPE_CHECKING:
    from xema_ray.models import ModelSpec
    from xema_ray.templates import RequestTemplate

EXPERTS = ("transformer", "transformer_2")


def expert_host_modules(swap: ExpertSwap, block_paths: list[str]) -> tuple[str, ...]:
    """``BuildOptions.host_modules`` paths the load homes on the host for ``swap``: every block of
    both experts for a swap, the first ``host_blocks`` of each for a split, none to hold both."""
    n = {"swap_prefetched": len(block_paths), "split_blocks": swap.host_blocks, "hold_both": 0}[swap.strategy]
    return tuple(f"{e}.{p}" for e in EXPERTS for p in block_paths[:n])


class ExpertSwapper:
    """Which expert's blocks are on the device, across batches (worker state, made at load).

    Args:
        pipe: the loaded pipeline, both experts' DiT blocks homed on the host
            (``expert_host_modules``).
        spec: its model spec.

    The high-noise expert is brought to the device here (the load waits for it).
    """

    def __init__(self, pipe: Any, spec: ModelSpec) -> None:
        self.device = compute_device(pipe.transformer)
        self.stream = _device.TransferStream(self.device)
        pin = not _device.host_is_device(self.device)
        self.blocks = {e: [OffloadedBlock(b, self.stream, pin, self.device) for _, b in spec.dit_blocks(getattr(pipe, e))]
                       for e in EXPERTS}
        #: host->device bytes copied, per expert (the planner's h2d_bytes, counted)
        self.copied: dict[str, int] = dict.fromkeys(EXPERTS, 0)
        self.switches = 0
        for i, (hi, lo) in enumerate(zip(*(self.blocks[e] for e in EXPERTS), strict=True)):
            if [(h.shape, h.dtype) for _, h in hi.tensors] != [(h.shape, h.dtype) for _, h in lo.tensors]:
                raise ValueError(f"expert swap: block {i} of {EXPERTS[0]} and of {EXPERTS[1]} differ in shape; the two "
                                 f"experts must share one architecture")
        #: the expert that runs next: its blocks are on the device or issued (a prefetch of the other
        #: adds blocks without changing it)
        self.active = "transformer"
        #: the load's device memory for one expert's blocks, one slot per block index, which the two
        #: experts' block ``i`` take in turn; the expert whose block ``i`` is in slot ``i`` (None: free)
        self.slots: list[list[torch.Tensor]] = []
        self.owner: list[str | None] = []
        for g in self.blocks["transformer"]:
            g.onload()
            self.copied["transformer"] += g.bytes
            g.wait()
            self.slots.append([t.data for t, _ in g.tensors])
            self.owner.append("transformer")

    @property
    def block_bytes(self) -> int:
        """Bytes of one expert's DiT blocks (the high-noise one's; both are alike)."""
        return sum(g.bytes for g in self.blocks["transformer"])

    def device_bytes(self) -> int:
        """Expert block bytes on the device now (issued copies included)."""
        return sum(g.bytes for e in EXPERTS for g in self.blocks[e] if g.onloaded)

    def bring(self, expert: str, count: int | None = None) -> None:
        """Issue the copies of ``expert``'s first ``count`` blocks (all: None) not yet on the device,
        in execution order, each with its own event (its block hook waits for it). Block ``i``
        goes into slot ``i`` when the other expert has left it (no allocation: the copy is ordered
        after the compute that read the slot last); while the other expert still holds it (a
        prefetch before the switch) into memory allocated now, which the release frees."""
        for i, g in enumerate(self.blocks[expert][:count]):
            if g.onloaded:
                continue
            if self.owner[i] is None:
                g.onload_into(self.slots[i])
                self.owner[i] = expert
            else:
                g.onload()
            self.copied[expert] += g.bytes

    def release(self, expert: str) -> None:
        """Drop ``expert``'s device blocks (the host copies stay): a block in its slot leaves the
        slot to the other expert's block, one in memory of its own frees it. The compute stream
        is marked as their user when it waited for them, and a copy into a slot is ordered after
        the compute issued before it, so neither is overwritten before compute passed its last read."""
        for i, g in enumerate(self.blocks[expert]):
            if g.onloaded:
                g.wait()  # a prefetched block never run: compute is ordered after its copy first
                g.release()
                if self.owner[i] == expert:
                    self.owner[i] = None

    def switch_to(self, expert: str, count: int | None = None) -> None:
        """``expert`` runs next: if the other was active it is released first, then ``expert``'s
        first ``count`` (all: None) missing blocks are issued."""
        if self.active != expert:
            self.release(EXPERTS[1 - EXPERTS.index(expert)])
            self.active = expert
            self.switches += 1
        self.bring(expert, count)


class _WaitHook(ModelHook):
    """On an expert's block: its weights must have landed before it runs (no release after)."""

    def __init__(self, group: OffloadedBlock) -> None:
        super().__init__()
        self.group = group

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.group.wait()
        return args, kwargs


class _ExpertHook(ModelHook):
    """On an expert: switch to it if the other is on the device; on the high-noise expert,
    start the low-noise prefetch from step ``prefetch_from`` on."""

    def __init__(self, swapper: ExpertSwapper, expert: str, step_of: Callable[[], int], prefetch_from: int | None,
                 prefetch_blocks: int) -> None:
        super().__init__()
        self.swapper = swapper
        self.expert = expert
        self.step_of = step_of
        self.prefetch_from = prefetch_from
        self.prefetch_blocks = prefetch_blocks

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.swapper.switch_to(self.expert)
        if self.prefetch_from is not None and self.prefetch_blocks and self.step_of() >= self.prefetch_from:
            self.swapper.bring(EXPERTS[1], self.prefetch_blocks)
        return args, kwargs


def _step_of(pipe: Any) -> Callable[[], int]:
    """The denoising step the pipeline is in: its scheduler's step index (None before the first
    ``step``; the scheduler stays on the CPU, also on meta)."""
    return lambda: int(getattr(pipe.scheduler, "step_index", None) or 0)


def _on_decode(pipe: Any, handle: MitigationHandle, fn: Callable[[], None]) -> None:
    """Run ``fn`` when ``pipe.vae.decode`` is first called (an instance attribute shadowing the
    method, as the engine's phase clock does; a previous override is kept and restored)."""
    vae = pipe.vae
    previous = vars(vae).get("decode")
    inner = vae.decode

    def decode(*args: Any, **kwargs: Any) -> Any:
        fn()
        return inner(*args, **kwargs)

    vae.decode = decode

    def undo() -> None:
        if previous is not None:
            vae.decode = previous
        else:
            vars(vae).pop("decode", None)

    handle.add_undo(undo)


def high_noise_steps(pipe: Any, spec: ModelSpec, template: RequestTemplate) -> int:
    """The steps the high-noise expert runs in a batch of ``template`` (its step count: the
    batch's, as the API resolved it), on the scheduler ``pipe`` loaded (a checkpoint's own
    ``scheduler_config.json`` moves the switch: ``ModelSpec.expert_stages``)."""
    config = getattr(getattr(pipe, "scheduler", None), "config", None)
    stages = spec.expert_stages(template, dict(config) if config is not None else None)
    return stages[0].last_step + 1 if stages[0].component == EXPERTS[0] else 0


def apply_expert_swap(pipe: Any, spec: ModelSpec, template: RequestTemplate, swap: ExpertSwap,
                      swapper: ExpertSwapper | None) -> MitigationHandle:
    """Install ``swap`` on ``pipe`` for one batch of ``template``; the handle's ``remove()`` takes
    the hooks off (a swap then issues the rest of the high-noise expert's copies: the next batch
    starts with it).

    Args:
        pipe: the pipeline (both experts).
        spec: its spec (``dit_blocks``, ``expert_stages``).
        template: the batch's template at the batch's own step count (the engine passes the
            request's steps, not the plan's): with the loaded scheduler it places the prefetch,
            ``swap.prefetch_steps`` before the switch (``high_noise_steps``).
        swap: what the plan does at the switch.
        swapper: the worker's expert state (``swap_prefetched`` only; None otherwise).
    """
    handle = MitigationHandle("expert_swap")
    if swap.strategy == "hold_both":
        return handle
    if swap.strategy == "split_blocks":
        for e in EXPERTS:
            blocks = spec.dit_blocks(getattr(pipe, e))
            inner = apply_block_offload(getattr(pipe, e), blocks, BlockOffloadConfig(blocks=tuple(range(swap.host_blocks))))
            handle.add_undo(inner.remove)
        return handle
    if swapper is None:
        raise ValueError("expert_swap swap_prefetched: the worker loaded no expert swapper (its plans hold both experts)")
    high_steps = high_noise_steps(pipe, spec, template)
    for e in EXPERTS:
        for (_, block), group in zip(spec.dit_blocks(getattr(pipe, e)), swapper.blocks[e], strict=True):
            hook_module(handle, block, _WaitHook(group), HOOK_NAMES["expert_swap_block"])
    step_of = _step_of(pipe)
    hook_module(handle, pipe.transformer, _ExpertHook(swapper, EXPERTS[0], step_of, max(0, high_steps - swap.prefetch_steps),
                                                      swap.prefetch_blocks), HOOK_NAMES["expert_swap"])
    hook_module(handle, pipe.transformer_2, _ExpertHook(swapper, EXPERTS[1], step_of, None, 0), HOOK_NAMES["expert_swap"])

    _on_decode(pipe, handle, lambda: swapper.switch_to(EXPERTS[0], swap.decode_blocks))

    def after_batch() -> None:  # registered first: runs last, after the hooks are off
        swapper.switch_to(EXPERTS[0])

    handle._undo.insert(0, after_batch)
    return handle


def expert_device_tensors(swapper: ExpertSwapper) -> list[torch.Tensor]:
    """The expert weights on the device now beyond the slots the load placed (prefetched blocks)."""
    return [t for e in EXPERTS for i, g in enumerate(swapper.blocks[e]) if g.onloaded and swapper.owner[i] != e
            for t, _ in g.tensors]
