"""Every primitive, at several locations and intensities, on every tiny model: the pipeline's
output equals the unmitigated output, and removing the primitive restores the pipeline.

Bitwise for offload and serialization; chunking within ``CHUNK_ATOL`` (it reorders reductions:
matmuls over fewer rows, group-norm statistics accumulated band by band).

oneDNN is switched off for the whole module (reference and mitigated runs alike): it picks a
convolution algorithm by batch size, so a sub-batch would take a different (equally correct)
kernel than the whole batch and the last bits would differ for reasons that are not ours.
With it off, every convolution runs the same kernel per sample.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.mitigation.conftest import TINY_MODELS, run_pipeline
from planner.estimates import evenly_spread
from xema_ray.mitigation import apply_mitigations
from xema_ray.models import get_model_spec
from xema_ray.plan import Mitigation

CHUNK_ATOL = 1e-4  # outputs are pixels in [0, 1]; observed differences are ~5e-6


pytestmark = pytest.mark.usefixtures("no_onednn")  # tests/mitigation/conftest.py


def _up_blocks(pipe: Any) -> list[str]:
    n = len(pipe.vae.decoder.up_blocks)
    return [f"vae.decoder.up_blocks.{i}" for i in range(n)]


def cases(model: str, pipe: Any) -> list[tuple[str, list[Mitigation], bool]]:
    """(id, mitigations, bitwise) for one model."""
    n = get_model_spec(model).num_dit_blocks
    ups = _up_blocks(pipe)
    return [
        ("offload-first", [Mitigation(kind="block_offload", blocks=(0,), intensity=1)], True),
        ("offload-spread", [Mitigation(kind="block_offload", blocks=evenly_spread(2, n), intensity=2)], True),
        ("offload-all", [Mitigation(kind="block_offload", blocks=tuple(range(n)), intensity=n)], True),
        ("act-offload-vae", [Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=64)], True),
        ("act-offload-vae-2", [Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=2)], True),
        ("act-offload-dit", [Mitigation(kind="activation_offload", modules=("transformer",), intensity=4)], True),
        ("dit-chunk-last-2", [Mitigation(kind="dit_chunking", blocks=(n - 1,), intensity=2)], False),
        ("dit-chunk-all-5", [Mitigation(kind="dit_chunking", blocks=tuple(range(n)), intensity=5)], False),
        ("vae-chunk-top-2", [Mitigation(kind="vae_chunking", modules=(ups[-1],), intensity=2)], False),
        ("vae-chunk-two-4", [Mitigation(kind="vae_chunking", modules=tuple(ups[-2:]), intensity=4)], False),
        (
            "vae-chunk+act-offload",
            [Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=64),
             Mitigation(kind="vae_chunking", modules=tuple(ups[-2:]), intensity=3)],
            False,
        ),
        # chains: the top up-blocks, output norm and conv_out banded as one
        ("vae-chain-top-3", [Mitigation(kind="vae_chunking", modules=(_chain(ups[-1]),), intensity=3)], False),
        ("vae-chain-two-4", [Mitigation(kind="vae_chunking", modules=(_chain(ups[-2]),), intensity=4)], False),
        (
            # the shape the Figure 11 benchmark uses at 4K: per-unit bands below, a chain from
            # the last upsampler on, conv caches offloaded (streamed to the host per band)
            "vae-chain-upsampler+act-offload",
            [Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=64),
             Mitigation(kind="vae_chunking", modules=(ups[-2], _chain(f"{ups[-2]}.upsamplers.0")), intensity=3)],
            False,
        ),
    ]


def _chain(path: str) -> str:
    """``vae.decoder.up_blocks.2`` -> ``vae.decoder[up_blocks.2:]``."""
    return "vae.decoder[" + path.removeprefix("vae.decoder.") + ":]"


CASE_IDS = [
    "offload-first", "offload-spread", "offload-all", "act-offload-vae", "act-offload-vae-2", "act-offload-dit",
    "dit-chunk-last-2", "dit-chunk-all-5", "vae-chunk-top-2", "vae-chunk-two-4", "vae-chunk+act-offload",
    "vae-chain-top-3", "vae-chain-two-4", "vae-chain-upsampler+act-offload",
]


@pytest.fixture(scope="module")
def references(pipelines: dict[str, Any]) -> dict[tuple[str, int], torch.Tensor]:
    with torch.backends.mkldnn.flags(enabled=False):
        return {(m, b): run_pipeline(pipelines[m], m, b) for m in TINY_MODELS for b in (1, 2)}


@pytest.mark.parametrize("case", CASE_IDS)
@pytest.mark.parametrize("model", TINY_MODELS)
def test_primitive_is_lossless(model: str, case: str, pipelines: dict[str, Any], references: dict) -> None:
    pipe = pipelines[model]
    spec = get_model_spec(model)
    _, mitigations, bitwise = next(c for c in cases(model, pipe) if c[0] == case)
    ref = references[(model, 1)]
    with apply_mitigations(pipe, spec, mitigations):
        out = run_pipeline(pipe, model)
    if bitwise:
        assert torch.equal(out, ref), f"max diff {(out - ref).abs().max().item()}"
    else:
        torch.testing.assert_close(out, ref, atol=CHUNK_ATOL, rtol=0)
    # removed: the pipeline is the original again
    assert torch.equal(run_pipeline(pipe, model), ref)


SERIAL_ATOL = 3e-5  # fp32 rounding of batch-size-dependent CPU kernels (seeded weights, tiny models)


@pytest.mark.parametrize("where", ["transformer", "block", "vae.decoder"])
@pytest.mark.parametrize("model", TINY_MODELS)
def test_temporary_serialization_matches_whole_batch(model: str, where: str, pipelines: dict[str, Any], references: dict) -> None:
    # Pipeline level, within SERIAL_ATOL: CPU kernels are chosen by batch size (MKL's GEMM for
    # a handful of rows, e.g. the timestep MLP; ATen's group_norm for batch > 1), so the same
    # math on a sub-batch can round differently in the last bit. What *our* code does is
    # checked bitwise below.
    pipe = pipelines[model]
    spec = get_model_spec(model)
    if where == "block":
        m = Mitigation(kind="temporary_serialization", blocks=(spec.num_dit_blocks - 1,), intensity=2)
    else:
        m = Mitigation(kind="temporary_serialization", modules=(where,), intensity=2)
    with apply_mitigations(pipe, spec, [m]):
        out = run_pipeline(pipe, model, batch=2)
    torch.testing.assert_close(out, references[(model, 2)], atol=SERIAL_ATOL, rtol=0)


@pytest.mark.parametrize("model", TINY_MODELS)
def test_temporary_serialization_is_bitwise_per_sub_batch(model: str, pipelines: dict[str, Any]) -> None:
    # The serialized transformer returns exactly the unmitigated transformer's outputs on each
    # sub-batch, rejoined: splitting (nested args, ids, caches) and joining lose nothing.
    pipe = pipelines[model]
    spec = get_model_spec(model)
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def grab(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not captured:
            captured.append((args, dict(kwargs)))

    handle = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        run_pipeline(pipe, model, batch=2)
    finally:
        handle.remove()
    args, kwargs = captured[0]
    from xema_ray.mitigation.serialization import _batch_of, _join, _split

    batch = _batch_of(args, kwargs)
    assert batch is not None and batch >= 2
    with torch.no_grad():
        halves = [pipe.transformer(*a, **k) for a, k in _split((args, kwargs), batch, [(0, batch // 2), (batch // 2, batch)])]
        expected = _join(halves)
        with apply_mitigations(pipe, spec, [Mitigation(kind="temporary_serialization", modules=("transformer",), intensity=2)]):
            got = pipe.transformer(*args, **kwargs)
    assert torch.equal(got[0], expected[0])


def test_everything_at_once_is_lossless(pipelines: dict[str, Any], references: dict) -> None:
    model = "tiny-cogvideox"
    pipe = pipelines[model]
    spec = get_model_spec(model)
    ups = _up_blocks(pipe)
    plan = [
        Mitigation(kind="block_offload", blocks=(1,), intensity=1),
        Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=64),
        Mitigation(kind="vae_chunking", modules=tuple(ups[-2:]), intensity=3),
        Mitigation(kind="dit_chunking", blocks=(0,), intensity=3),
        Mitigation(kind="temporary_serialization", modules=("transformer",), intensity=2),
    ]
    with apply_mitigations(pipe, spec, plan):
        out = run_pipeline(pipe, model, batch=2)
    torch.testing.assert_close(out, references[(model, 2)], atol=CHUNK_ATOL, rtol=0)
