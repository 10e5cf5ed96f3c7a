"""The analyzer sees mitigations: traces of mitigated pipelines on meta (tiny and real size),
estimates without running, and input validation."""

from __future__ import annotations

import pytest

from xema_ray.memory.analysis import phase_peaks
from xema_ray.vocabulary import phase_of_trace
from xema_ray.analyzer.run import trace_template
from planner.estimates import estimate_saving, evenly_spread
from xema_ray.analyzer.mitigated import trace_with_mitigations
from xema_ray.mitigation import primitive_for
from xema_ray.mitigation.hooks import resolve_module
from planner.estimates import dit_block_bytes
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import Mitigation
from xema_ray.templates import RequestTemplate

GIB = 2**30


def group_peaks(trace) -> dict[str, int]:  # type: ignore[no-untyped-def]
    out: dict[str, int] = {}
    for p in phase_peaks(trace):
        g = phase_of_trace(p.phase)
        out[g] = max(out.get(g, 0), p.peak_bytes)
    return out


@pytest.mark.parametrize("model", ["tiny-flux2", "tiny-cogvideox", "tiny-ltx2"])
def test_block_offload_trace_matches_estimate_exactly(model: str) -> None:
    spec = get_model_spec(model)
    t = RequestTemplate(model=model, height=64, width=64, frames=1 if spec.kind == "image" else 9, steps=3)
    n = spec.num_dit_blocks
    m = Mitigation(kind="block_offload", blocks=tuple(range(n)), intensity=n)
    base, mitigated = trace_template(t), trace_with_mitigations(t, [m])
    saved = estimate_saving(m, t)
    # offloaded weights are not resident; outside the DiT the saving is exactly their bytes
    # (each block is rounded to 512 B per tensor by the allocator model, hence the bound)
    assert base.resident_bytes() - mitigated.resident_bytes() >= saved.at("decode")
    before, after = group_peaks(base), group_peaks(mitigated)
    # (less the one shared 512 B scalar the offloaded parameters point to while on the host)
    assert before["decode"] - after["decode"] >= saved.at("decode") - 512
    assert before["denoise"] - after["denoise"] >= saved.at("denoise") - 512


def test_hsdp_trace_keeps_a_shard_resident() -> None:
    t = RequestTemplate(model="tiny-cogvideox", height=64, width=64, frames=9, steps=3)
    m = Mitigation(kind="hsdp", blocks=(0, 1), intensity=2)
    base, mitigated = trace_template(t), trace_with_mitigations(t, [m], world_size=2)
    sizes = dit_block_bytes("tiny-cogvideox")
    dropped = base.resident_bytes() - mitigated.resident_bytes()
    # per-parameter 512 B rounding of the unsharded weights vs one flat shard per dtype: a few %
    assert abs(dropped - (sizes[0] + sizes[1]) / 2) < 0.15 * (sizes[0] + sizes[1]) / 2


def test_activation_primitives_lower_the_vae_peak_on_meta() -> None:
    t = RequestTemplate(model="tiny-cogvideox", height=96, width=128, frames=17, steps=3)
    base = group_peaks(trace_template(t))
    offload = Mitigation(kind="activation_offload", modules=("vae.decoder",), intensity=64)
    chunk = Mitigation(kind="vae_chunking", modules=("vae.decoder.up_blocks.3", "vae.decoder.up_blocks.2"), intensity=4)
    # each alone lowers the decode peak (together they help at real sizes, see bench; at this
    # tiny size the 8-row band alignment makes bands nearly as tall as the map)
    assert group_peaks(trace_with_mitigations(t, [offload]))["decode"] < base["decode"]
    assert group_peaks(trace_with_mitigations(t, [chunk]))["decode"] < base["decode"]


def test_events_location_maps_to_blocks() -> None:
    t = RequestTemplate(model="tiny-flux2", height=64, width=64, steps=3)
    spec = t.spec
    base = trace_template(t)
    start = base.modules.index("transformer.single_transformer_blocks.1")
    rows = [i for i in range(len(base)) if base.module[i] == start]
    ev = (int(base.begin[rows[0]]), int(base.begin[rows[0]]) + 1)
    pipe = spec.build_pipeline(BuildOptions(device="meta"))
    cfg = primitive_for(Mitigation(kind="dit_chunking", events=ev, intensity=2), spec, pipe, trace=base)
    assert cfg.blocks == (spec.num_dit_blocks - 1,)


def test_error_raised_if_block_out_of_range() -> None:
    spec = get_model_spec("tiny-flux2")
    pipe = spec.build_pipeline(BuildOptions(device="meta"))
    from xema_ray.mitigation import apply_mitigations

    with pytest.raises(ValueError, match="out of range"):
        apply_mitigations(pipe, spec, [Mitigation(kind="block_offload", blocks=(7,), intensity=1)])


def test_error_raised_if_module_path_is_wrong() -> None:
    pipe = get_model_spec("tiny-flux2").build_pipeline(BuildOptions(device="meta"))
    with pytest.raises(ValueError, match="has no 'up_blockz'"):
        resolve_module(pipe, "vae.decoder.up_blockz.3")


def test_error_raised_if_events_without_trace() -> None:
    spec = get_model_spec("tiny-flux2")
    pipe = spec.build_pipeline(BuildOptions(device="meta"))
    with pytest.raises(ValueError, match="baseline trace"):
        primitive_for(Mitigation(kind="vae_chunking", events=(0, 10), intensity=2), spec, pipe)


def test_error_raised_if_hsdp_has_no_group() -> None:
    spec = get_model_spec("tiny-flux2")
    pipe = spec.build_pipeline(BuildOptions(device="meta"))
    from xema_ray.mitigation import apply_mitigations

    with pytest.raises(ValueError, match="process group"):
        apply_mitigations(pipe, spec, [Mitigation(kind="hsdp", blocks=(0,), intensity=1)])


def test_error_raised_if_too_many_blocks_spread() -> None:
    with pytest.raises(ValueError, match="cannot choose 9 of 8"):
        evenly_spread(9, 8)


@pytest.mark.slow
def test_flux2_minimal_selective_offload_fits_48_gib() -> None:
    # Paper §5.1 / Figure 4: Flux.2 1024^2 fits a 48 GB A6000 (48 GiB) with 16 of 56 blocks offloaded.
    t = RequestTemplate(model="flux2", height=1024, width=1024, steps=3)
    base = trace_template(t).peak()
    fits = trace_with_mitigations(t, [Mitigation(kind="block_offload", blocks=evenly_spread(16, 56), intensity=16)]).peak()
    short = trace_with_mitigations(t, [Mitigation(kind="block_offload", blocks=evenly_spread(15, 56), intensity=15)]).peak()
    assert base > 48 * GIB
    assert fits <= 48 * GIB < short
