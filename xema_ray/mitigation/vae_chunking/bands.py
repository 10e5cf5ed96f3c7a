"""Horizontal bands of a map: planning them (halo, alignment to the latent), cutting inputs to
a band, assembling outputs from the bands' own rows, and the receptive radius a band needs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from xema_ray.placement import HostCopy, OffloadedTensor


def map_shape(t: Any) -> torch.Size | None:
    """Shape of a tensor or of a tensor waiting on the host; None for anything else."""
    if isinstance(t, torch.Tensor):
        return t.shape
    if isinstance(t, OffloadedTensor):
        return t.shape
    return None


def spatial_ratio(t: Any, h: int, w: int) -> float | None:
    """Rows of ``t`` per row of an ``h`` x ``w`` map if ``t`` is a map with the same aspect
    (e.g. a conv cache: 1, the latent: 1/8), else None. A 1x1 map is broadcast, not cut."""
    shape = map_shape(t)
    if shape is None or len(shape) < 4 or shape[-2] == 0:
        return None
    if shape[-2] == 1 and shape[-1] == 1:
        return None
    if shape[-2] * w != shape[-1] * h:
        return None
    return shape[-2] / h


def cut_rows(t: Any, ratio: float, s0: int, s1: int) -> Any:
    """Rows ``[s0, s1)`` (in input rows) of a whole map ``t`` at ``ratio``: a view on the
    device, or the band's slice of a host copy (brought over by whoever reads it)."""
    top, rows = s0 * ratio, (s1 - s0) * ratio
    if abs(top - round(top)) > 1e-9 or abs(rows - round(rows)) > 1e-9:
        raise ValueError(f"vae_chunking: band rows [{s0}, {s1}) do not cut a map at ratio {ratio} on whole rows")
    if isinstance(t, OffloadedTensor):
        return OffloadedTensor.from_host(t.host.narrow(-2, round(top), round(rows)), t.stream)
    return t.narrow(-2, round(top), round(rows))


@dataclass(frozen=True)
class Bands:
    """Horizontal bands of an ``h``-row map: own rows ``[c0, c1)``, computed rows ``[s0, s1)``."""

    h: int
    w: int
    halo: int
    bands: tuple[tuple[int, int, int, int], ...]

    @staticmethod
    def plan(h: int, w: int, ratios: list[float], chunks: int, halo: float) -> Bands | None:
        """Bands starting on multiples of the coarsest map's row ratio (so every map cuts on
        whole rows); None when the map is too small for more than one band."""
        align = max([round(1 / r) for r in ratios if r < 1] + [1])
        if h % align:
            raise ValueError(f"vae_chunking: map height {h} is not a multiple of the latent ratio {align}")
        units = h // align
        chunks = min(chunks, units)
        if chunks <= 1:
            return None
        rows = math.ceil(halo - 1e-9) if halo > 0 else 0
        rows = -(-rows // align) * align
        step = -(-units // chunks) * align
        bands = tuple((a, min(a + step, h), max(0, a - rows), min(h, a + step + rows)) for a in range(0, h, step))
        return Bands(h=h, w=w, halo=rows, bands=bands)


class WholeOutput:
    """One output assembled from its bands' own rows: on the device, or — for a tensor the
    bands left on the host (an offloaded conv cache) — in a host buffer, never whole on the device."""

    def __init__(self, part: Any, band_rows: int, h: int) -> None:
        shape = map_shape(part)
        assert shape is not None
        ratio = shape[-2] / band_rows
        rows = round(h * ratio)
        if abs(rows - h * ratio) > 1e-9:
            raise ValueError(f"vae_chunking: output rows {shape[-2]} are not a whole multiple of band rows {band_rows}")
        whole = (*shape[:-2], rows, shape[-1])
        if isinstance(part, OffloadedTensor):
            self.host: HostCopy | None = HostCopy.empty(whole, part.host.dtype, part.host.device)
            self.stream = part.stream
            self.t: torch.Tensor | None = None
        else:
            self.host, self.stream = None, None
            self.t = torch.empty(whole, dtype=part.dtype, device=part.device)

    def write(self, part: Any, c0: int, c1: int, s0: int, s1: int) -> None:
        shape = map_shape(part)
        assert shape is not None
        ratio = shape[-2] / (s1 - s0)
        top, rows, dst = round((c0 - s0) * ratio), round((c1 - c0) * ratio), round(c0 * ratio)
        if self.host is not None:
            if not isinstance(part, OffloadedTensor):
                raise RuntimeError("vae_chunking: bands disagree on whether an output is offloaded")
            self.host.copy_rows(-2, dst, part.host, top, rows)
        else:
            if isinstance(part, OffloadedTensor):
                part = part.load()
            assert self.t is not None
            self.t.narrow(-2, dst, rows).copy_(part.narrow(-2, top, rows))

    def result(self) -> Any:
        if self.host is not None:
            return OffloadedTensor.from_host(self.host, self.stream)
        return self.t


def receptive_radius(unit: nn.Module) -> int:
    """Sum of the vertical radii of the unit's convolutions, counted in input rows (an
    upsampler's convolution runs at twice the resolution, so this over-counts there: safe)."""
    r = 0
    for m in unit.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            if m.stride[-2] != 1:
                raise ValueError(f"vae_chunking: strided convolution {m} inside a chunked unit is not supported")
            r += m.dilation[-2] * (m.kernel_size[-2] // 2)
    return r
