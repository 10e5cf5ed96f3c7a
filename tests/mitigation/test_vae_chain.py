"""VAE chains (``vae_chunking`` with a path ``PARENT[START:]``): bands that really cut the map,
no whole intermediate map in the trace, conv caches streamed to the host per band, the
estimate, and input validation. Losslessness on every tiny model at the test size is in
test_lossless.py (``vae-chain-*`` cases)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.mitigation.conftest import run_pipeline
from xema_ray.memory.analysis import event_modules, event_phases, phase_peaks
from xema_ray.vocabulary import phase_of_trace
from xema_ray.analyzer.run import trace_template
from xema_ray.memory.trace import Category, MemoryTrace
from planner.estimates import estimate_saving
from xema_ray.analyzer.mitigated import trace_with_mitigations
from xema_ray.mitigation import apply_mitigations, vae_chunking
from xema_ray.mitigation.vae_chunking import VaeChunkingConfig, apply_vae_chunking, chain_paths, parse_chain
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate

CHUNK_ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("no_onednn")  # tests/mitigation/conftest.py


@pytest.fixture
def band_plans(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every band layout the chunking plans while the test runs."""
    seen: list[Any] = []
    plan = vae_chunking.Bands.plan

    def spy(*a: Any, **k: Any) -> Any:
        b = plan(*a, **k)
        seen.append(b)
        return b

    monkeypatch.setattr(vae_chunking.Bands, "plan", staticmethod(spy))
    return seen


def _vae_peak(trace: MemoryTrace) -> int:
    return max(p.peak_bytes for p in phase_peaks(trace) if phase_of_trace(p.phase) == "decode")


def _decode_allocations_under(trace: MemoryTrace, prefix: str) -> np.ndarray:
    ph = event_phases(trace)[trace.begin]
    vae = np.isin(ph, [i for i, n in enumerate(trace.phases) if phase_of_trace(n) == "decode"])
    under = np.array([n == prefix or n.startswith(prefix + ".") for n in trace.modules] + [False])[trace.module]
    return trace.size[vae & under & (trace.category == Category.ACTIVATION)]


def test_parse_chain() -> None:
    assert parse_chain("vae.decoder[up_blocks.2.upsamplers.0:]") == ("vae.decoder", "up_blocks.2.upsamplers.0")
    assert parse_chain("vae.decoder.up_blocks.2") is None


def test_chain_paths_follow_the_start() -> None:
    pipe = get_model_spec("tiny-cogvideox").build_pipeline(BuildOptions(device="meta"))
    assert chain_paths(pipe, "vae.decoder[up_blocks.2.upsamplers.0:]") == [
        "vae.decoder.up_blocks.2.upsamplers.0", "vae.decoder.up_blocks.3", "vae.decoder.norm_out",
        "vae.decoder.conv_act", "vae.decoder.conv_out",
    ]


def test_chain_cuts_real_bands_and_is_exact_on_ltx2(band_plans: list[Any]) -> None:
    # at the shared 64 px test size LTX-2's maps are smaller than a halo; at 256 px they are
    # cut for real. No group norms (per-pixel RMS norms): banding is bitwise here.
    model = "tiny-ltx2"
    spec = get_model_spec(model)
    pipe = spec.build_pipeline(BuildOptions())
    t = RequestTemplate(model=model, height=256, width=256, frames=9, steps=2)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return pipe(**spec.call_kwargs(t), **spec.prompt_embeddings(["p"], "cpu", torch.float32),
                        generator=torch.Generator("cpu").manual_seed(0), output_type="pt")[0]

    ref = run()
    with apply_mitigations(pipe, spec, [Mitigation(kind="vae_chunking", modules=("vae.decoder[up_blocks.1:]",), intensity=4)]):
        out = run()
    assert torch.equal(out, ref)
    layouts = [b for b in band_plans if b is not None]
    assert layouts and all(s1 - s0 < b.h for b in layouts for _, _, s0, s1 in b.bands)


def test_chain_bands_are_proper_cuts_at_the_test_size(band_plans: list[Any]) -> None:
    model = "tiny-cogvideox"
    spec = get_model_spec(model)
    pipe = spec.build_pipeline(BuildOptions())
    ref = run_pipeline(pipe, model)
    with apply_vae_chunking(pipe, VaeChunkingConfig(modules=("vae.decoder[up_blocks.2:]",), chunks=4)):
        out = run_pipeline(pipe, model)
    torch.testing.assert_close(out, ref, atol=CHUNK_ATOL, rtol=0)
    layouts = [b for b in band_plans if b is not None]
    assert layouts and all(s1 - s0 < b.h for b in layouts for _, _, s0, s1 in b.bands)


def test_chain_never_materialises_a_whole_map_on_meta() -> None:
    # the baseline allocates whole full-resolution maps in up_blocks.3; inside a chain from
    # up_blocks.2 every allocation there is a band (8 bands + halos: well under half a map),
    # and the streamed conv caches never appear whole on the device either
    t = RequestTemplate(model="tiny-cogvideox", height=256, width=256, frames=9, steps=3)
    base = trace_template(t)
    offload = Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=64)
    chain = Mitigation(kind="vae_chunking", modules=("vae.decoder[up_blocks.2:]",), intensity=8)
    traced = trace_with_mitigations(t, [offload, chain])
    whole = _decode_allocations_under(base, "vae.decoder.up_blocks.3").max()
    banded = _decode_allocations_under(traced, "vae.decoder.up_blocks.3").max()
    assert banded < whole / 2
    assert _vae_peak(traced) < _vae_peak(trace_with_mitigations(t, [offload]))
    # the estimate predicts a saving (the analyzer confirms by tracing, as above)
    assert estimate_saving(chain, t, baseline=base).at("decode") > 0


def test_chain_keeps_no_freed_result_alive() -> None:
    # the parent's calls before the chain are replayed in each band's re-run, but results the
    # first run had freed before the chain (mid_block's, up_blocks.0/1's outputs) are not
    # kept for that: at the chain's peak nothing they allocated is live (the chain's input,
    # up_blocks.2's output, is)
    t = RequestTemplate(model="tiny-cogvideox", height=256, width=256, frames=9, steps=3)
    offload = Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=64)
    chain = Mitigation(kind="vae_chunking", modules=("vae.decoder[up_blocks.3:]",), intensity=8)
    trace = trace_with_mitigations(t, [offload, chain])
    in_chain = np.array([n.startswith("vae.decoder.up_blocks.3") for n in trace.modules] + [False])
    events = np.flatnonzero(in_chain[event_modules(trace)])
    curve = trace.active_curve()
    e = int(events[np.argmax(curve[events])])
    live = (trace.begin <= e) & (trace.end > e) & (trace.category == Category.ACTIVATION)
    early = ("vae.decoder.conv_in", "vae.decoder.mid_block", "vae.decoder.up_blocks.0", "vae.decoder.up_blocks.1")
    names = np.array([any(n == p or n.startswith(p + ".") for p in early) for n in trace.modules] + [False])
    assert trace.size[live & names[trace.module]].sum() == 0


def test_error_raised_if_chain_halo_is_too_small() -> None:
    model = "tiny-cogvideox"
    spec = get_model_spec(model)
    pipe = spec.build_pipeline(BuildOptions())
    with apply_vae_chunking(pipe, VaeChunkingConfig(modules=("vae.decoder[up_blocks.2:]",), chunks=4, halo=0)):
        with pytest.raises(RuntimeError, match="rows of halo"):
            run_pipeline(pipe, model)


def test_error_raised_if_chain_path_is_malformed() -> None:
    pipe = get_model_spec("tiny-cogvideox").build_pipeline(BuildOptions(device="meta"))
    with pytest.raises(ValueError, match="neither a module path nor a chain"):
        apply_vae_chunking(pipe, VaeChunkingConfig(modules=("vae.decoder[up_blocks.2]",), chunks=2))


def test_error_raised_if_chain_starts_at_a_container() -> None:
    pipe = get_model_spec("tiny-cogvideox").build_pipeline(BuildOptions(device="meta"))
    with pytest.raises(ValueError, match="is a container"):
        apply_vae_chunking(pipe, VaeChunkingConfig(modules=("vae.decoder[up_blocks:]",), chunks=2))


def test_error_raised_if_chains_overlap() -> None:
    pipe = get_model_spec("tiny-cogvideox").build_pipeline(BuildOptions(device="meta"))
    with pytest.raises(ValueError, match="overlap"):
        apply_vae_chunking(pipe, VaeChunkingConfig(
            modules=("vae.decoder[up_blocks.2:]", "vae.decoder.up_blocks.3[resnets.1:]"), chunks=2))
