"""Exact spatially chunked VAE decoding (paper §5.2): halo convolutions, group norm with
whole-tensor statistics, upsampling fused with the following convolution.

The high-resolution up-blocks of a VAE decoder make the decode peak: every resnet keeps a few
full-resolution maps alive, and an upsampler materialises a 4x map only to convolve it. Two
modes run parts of the decoder over horizontal bands of the map instead of the whole map.

**Per unit** (a path naming an up-block, or any spatially local module): each *unit* of the
block (each resnet, each upsampler) runs over ``chunks`` bands of its input. The unit's whole
input and output stay on the device; everything in between exists one band at a time.

**Chain** (a path ``PARENT[START:]``, e.g. ``vae.decoder[up_blocks.2:]``): ``START`` and
everything ``PARENT``'s forward runs after it — later up-blocks, the output norm, the output
convolution, any glue between them — run band by band as *one* chain, so no map inside the
chain ever exists whole: only the chain's input (the map ``START`` receives) and ``PARENT``'s
final output (for a decoder: the decoded frames) are whole. Conv caches stream per band: the
band's slice of each incoming cache is brought to the device (or cut from the device cache),
and each band's new caches are written straight into whole host buffers when activation
offload moved them there (device buffers otherwise). ``PARENT``'s forward is re-run once per
band (and per statistics pass); the calls it makes before ``START`` are replayed from their
first results, not recomputed, and results the first run had already freed before ``START``
are not kept (a stand-in that refuses any computation takes their place).

Common to both:

- **Halo convolutions.** A band is cut with ``halo`` extra rows on each side, at least the
  receptive radius of the convolutions it passes through (for a chain: summed along the
  chain, each divided by the resolution gained from upsamplers before it), so the band's own
  rows see exactly the neighbours they see in the whole map; the halo rows (wrong near the
  cut, where the convolution padded) are cropped away. At the true image border the band
  *is* the border, so the model's own padding (zeros, reflect) applies as usual. A chain
  measures the radius its convolutions actually need on the first band and fails loudly if
  the halo was too small.
- **Upsample fused with the next convolution.** An upsampler runs the module's own forward
  (interpolate, then convolve) on a band, so the upsampled map exists one band at a time.
- **Group norm with whole-tensor statistics.** A ``GroupNorm`` normalises with the mean and
  variance of the *whole* map, which a band cannot see. The unit (or chain) therefore runs in
  passes: pass k runs every band up to the k-th group norm, accumulates that norm's
  statistics over the bands' own rows (Chan's parallel mean/variance in fp64) and stops the
  band there; the last pass runs every band to the end with all statistics known. Pass k
  recomputes what lies before the k-th norm: a chain with N group norms costs about (N+1)/2
  times its plain compute (plus halos). Statistics are applied with ``batch_norm`` on the
  band (one output allocation, fp32 inside). Units without group norms (LTX-2's per-pixel RMS
  norms) need one pass.

Other spatial tensors are cut to the same band: conv caches (same rows) and CogVideoX's
latent ``zq`` (fewer rows; bands are aligned to the ratio so nearest-neighbour interpolation
of a band equals the band of the interpolation). 1x1 maps (broadcast conditioning) pass whole.

Lossless, no blending: the result equals the unchunked decode up to the reduction order of
the statistics (fp32 on CPU: max abs difference below 1e-4 on outputs in [-1, 1]).

One file per concern: ``config`` (the action and chain paths), ``bands`` (planning bands,
cutting inputs, assembling outputs, receptive radius), ``statistics`` (group norm over the whole
map), ``per_unit``, ``chain_run`` (the chain interpreter; its modes are ``ChainMode`` and
``ModuleRole`` enums), ``chain`` (the hook on the chain's parent) and ``install`` (``apply``, the entry point every
primitive has, and ``apply_vae_chunking``).

Example:
    >>> from xema_ray.models import BuildOptions, get_model_spec
    >>> spec = get_model_spec("tiny-flux2")
    >>> pipe = spec.build_pipeline(BuildOptions())
    >>> h = apply_vae_chunking(pipe, VaeChunkingConfig(modules=("vae.decoder.up_blocks.3",), chunks=2))
    >>> h.remove()
    >>> h = apply_vae_chunking(pipe, VaeChunkingConfig(modules=("vae.decoder[up_blocks.2:]",), chunks=2))
    >>> h.remove()
"""

from xema_ray.mitigation.vae_chunking.install import apply, apply_vae_chunking, band_rows
from xema_ray.mitigation.vae_chunking.bands import Bands, receptive_radius
from xema_ray.mitigation.vae_chunking.chain import (
    ChainChunkHook,
    chain_modules,
    chain_paths,
    chain_radius,
)
from xema_ray.mitigation.vae_chunking.config import (
    CHAIN_RE,
    VaeChunkingConfig,
    parse_chain,
)
from xema_ray.mitigation.vae_chunking.per_unit import SpatialChunkHook, chunk_units
from xema_ray.mitigation.vae_chunking.statistics import GlobalGroupNormHook

__all__ = [
    "CHAIN_RE",
    "Bands",
    "ChainChunkHook",
    "GlobalGroupNormHook",
    "SpatialChunkHook",
    "VaeChunkingConfig",
    "apply",
    "apply_vae_chunking",
    "band_rows",
    "chain_modules",
    "chain_paths",
    "chain_radius",
    "chunk_units",
    "parse_chain",
    "receptive_radius",
]
