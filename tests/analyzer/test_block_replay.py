"""Replayed DiT blocks are exact: a trace with block replay equals the fully run trace event for
event (sizes, event times, modules, ops, phases), on the three tiny models and at real size, and
with every mitigation that hooks DiT blocks applied (their bodies replayed beneath the hooks);
a block carrying a hook replay knows nothing about runs."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from tests.analyzer.trace_equality import TEMPLATES, columns_equal
from xema_ray.analyzer.run import TraceOptions, trace_template
from xema_ray.analyzer.block_replay import transformer_blocks
from xema_ray.memory.trace import MemoryTrace
from xema_ray.mitigation.dit_chunking import DitChunkingConfig, QueryChunkedCogVideoXProcessor, apply_dit_chunking
from xema_ray.mitigation.hooks import MitigationHandle
from xema_ray.analyzer.mitigated import trace_with_mitigations
from xema_ray.models import BuildOptions
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate


def _equal(a: MemoryTrace, b: MemoryTrace) -> None:
    columns_equal(a, b)
    assert a.meta["trace_hash"] == b.meta["trace_hash"]


def _counts(trace: MemoryTrace) -> tuple[int, int]:
    replayed, recorded = (int(x.split()[0]) for x in trace.meta["block_replay"].split(" / "))
    return replayed, recorded


def _hooked_replays(trace: MemoryTrace) -> int:
    """Replayed calls of blocks carrying a mitigation's hook."""
    return int(trace.meta["block_replay"].split("(")[1].split()[0])


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.key)
def test_replayed_trace_equals_fully_run_trace(template: RequestTemplate) -> None:
    fast = trace_template(template, TraceOptions(replay_blocks=True))
    full = trace_template(template)
    _equal(fast, full)
    replayed, recorded = _counts(fast)
    assert replayed > recorded > 0  # later blocks really are replayed


@pytest.mark.slow
@pytest.mark.parametrize("template", [
    RequestTemplate(model="ltx2", width=864, height=480, frames=49, steps=4),
    RequestTemplate(model="flux2", width=256, height=256, steps=4, batch=2),
    RequestTemplate(model="cogvideox-5b", width=1280, height=720, frames=49, steps=4),
], ids=lambda t: t.key)
def test_replay_is_exact_at_real_size(template: RequestTemplate) -> None:
    fast = trace_template(template, TraceOptions(replay_blocks=True))
    _equal(fast, trace_template(template))
    replayed, _ = _counts(fast)
    assert replayed >= 3 * template.spec.transformer_config["num_layers"] // 2


def _block_calls(pipe: Any, run: Callable[[], MemoryTrace]) -> tuple[MemoryTrace, int]:
    """``run()``'s trace and how many times a DiT block of ``pipe`` was called in it."""
    blocks = {id(b) for _, b in transformer_blocks(pipe, {})}
    calls = 0

    def count(module: nn.Module, _args: object) -> None:
        nonlocal calls
        calls += id(module) in blocks

    handle = register_module_forward_pre_hook(count)
    try:
        return run(), calls
    finally:
        handle.remove()


def _deeper(t: RequestTemplate, layers: int) -> Any:
    """``t``'s tiny meta pipeline with ``layers`` DiT blocks of each kind: blocks after the first
    then see the same inputs, so only the signature keeps differently mitigated ones apart."""
    spec = copy.copy(t.spec)
    cfg = dict(spec.transformer_config)
    for k in ("num_layers", "num_single_layers"):
        if k in cfg:
            cfg[k] = layers
    spec.transformer_config = cfg
    return spec.build_pipeline(BuildOptions(device="meta"))


M = Mitigation


@pytest.mark.parametrize(("model", "mitigations"), [
    ("tiny-flux2", [M(kind="block_offload", blocks=(0, 2), intensity=2)]),
    # sharded and chunked blocks (rotary, q/k norm, feed-forward and attention chunks)
    ("tiny-flux2", [M(kind="hsdp", blocks=(1, 2), intensity=2), M(kind="dit_chunking", blocks=(0, 1), intensity=2)]),
    # CogVideoX's query-chunked attention processor, two chunk counts on the two blocks
    ("tiny-cogvideox", [M(kind="dit_chunking", blocks=(0,), intensity=2), M(kind="dit_chunking", blocks=(1,), intensity=3),
                        M(kind="temporary_serialization", modules=("transformer",), intensity=2)]),
    ("tiny-cogvideox", [M(kind="hsdp", blocks=(0,), intensity=1), M(kind="block_offload", blocks=(1,), intensity=1),
                        M(kind="activation_offload", modules=("vae.decoder",), intensity=4)]),
    ("tiny-ltx2", [M(kind="hsdp", blocks=(0,), intensity=1)]),
    # a serialized block (its body replayed per sub-batch) next to an offloaded, chunked one
    ("tiny-ltx2", [M(kind="block_offload", blocks=(0, 1), intensity=2), M(kind="dit_chunking", blocks=(1,), intensity=2),
                   M(kind="temporary_serialization", blocks=(0,), intensity=2)]),
    ("tiny-ltx2", [M(kind="activation_offload", modules=("transformer.transformer_blocks.1",), intensity=2)]),
], ids=lambda x: x if isinstance(x, str) else "+".join(m.kind for m in x))
def test_mitigated_traces_stay_exact(model: str, mitigations: list[Mitigation]) -> None:
    # the bodies of blocks carrying a mitigation's hook are replayed beneath it; the hooks run
    t = next(x for x in TEMPLATES if x.model == model).with_(steps=3)
    pipe = _deeper(t, 3)
    fast, calls = _block_calls(pipe, lambda: trace_with_mitigations(t, mitigations, options=TraceOptions(replay_blocks=True),
                                                                    pipeline=pipe))
    _equal(fast, trace_with_mitigations(t, mitigations, pipeline=pipe))
    replayed, recorded = _counts(fast)
    assert replayed + recorded >= calls  # no block call ran outside replay (a serialized block: 2 bodies a call)
    assert _hooked_replays(fast) > 0


class _Probe(ModelHook):
    """A hook block replay knows nothing about."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.calls += 1
        return args, kwargs


def test_a_block_with_an_unknown_hook_runs_and_removed_hooks_replay_again() -> None:
    t = TEMPLATES[0]
    pipe = t.spec.build_pipeline(BuildOptions(device="meta"))
    plain, calls = _block_calls(pipe, lambda: trace_template(t, TraceOptions(replay_blocks=True), pipeline=pipe))
    assert sum(_counts(plain)) == calls
    block = transformer_blocks(pipe, {})[1][1]
    probe = _Probe()
    HookRegistry.check_if_exists_or_initialize(block).register_hook(probe, "probe")
    probed = trace_template(t, TraceOptions(replay_blocks=True), pipeline=pipe)
    _equal(probed, plain)
    assert sum(_counts(probed)) == calls - probe.calls and probe.calls > 0  # that block ran every time
    assert _hooked_replays(probed) == 0
    block._diffusers_hook.remove_hook("probe")  # an empty registry is left behind
    again = trace_template(t, TraceOptions(replay_blocks=True), pipeline=pipe)
    assert _counts(again) == _counts(plain)


def _ff(block: int, chunks: int) -> DitChunkingConfig:
    return DitChunkingConfig(blocks=(block,), chunks=chunks, parts=("ff",))


def _query_chunked(blocks: list[tuple[str, nn.Module]], chunks: dict[int, int]) -> MitigationHandle:
    """Only the attention processors swapped (no hook): the processor's chunk count alone tells
    the two blocks apart."""
    handle = MitigationHandle("query_chunked")
    for i, c in chunks.items():
        for sub in blocks[i][1].modules():
            if type(getattr(sub, "processor", None)) is CogVideoXAttnProcessor2_0:
                original = sub.processor
                sub.processor = QueryChunkedCogVideoXProcessor(original, c)
                handle.add_undo(lambda m=sub, p=original: setattr(m, "processor", p))
    return handle


@pytest.mark.parametrize("setup", [
    # only the state the block's hook sets differs between the two blocks (rotary chunks)
    lambda blocks: [apply_dit_chunking(blocks, DitChunkingConfig(blocks=(1,), chunks=2, parts=("rotary",))),
                    apply_dit_chunking(blocks, DitChunkingConfig(blocks=(2,), chunks=3, parts=("rotary",)))],
    # only the inner hooks' chunk counts differ (feed-forwards chunked 2 and 3 ways)
    lambda blocks: [apply_dit_chunking(blocks, _ff(1, 2)), apply_dit_chunking(blocks, _ff(2, 3))],
    lambda blocks: [_query_chunked(blocks, {1: 2, 2: 3})],
], ids=["block-state", "inner-hooks", "processor-attributes"])
def test_replay_tells_apart_blocks_that_differ_only_in_chunking(setup: Callable[..., list[MitigationHandle]]) -> None:
    # tiny CogVideoX with 4 blocks: blocks 1-3 see the same inputs, so only the signature keeps
    # the chunked ones (1, 2) apart from each other and from the plain one (3)
    t = TEMPLATES[1].with_(steps=3)
    pipe = _deeper(t, 4)
    handles = setup(t.spec.dit_blocks(pipe.transformer))
    try:
        fast = trace_template(t, TraceOptions(replay_blocks=True), pipeline=pipe)
        _equal(fast, trace_template(t, pipeline=pipe))
    finally:
        for h in handles:
            h.remove()
    assert _counts(fast)[0] > 0
