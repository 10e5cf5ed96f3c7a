"""Per-unit VAE chunking: each unit of an up-block (each resnet, each upsampler) or any spatially
local module runs over horizontal bands of its input, in passes for its group norms."""

from __future__ import annotations

from typing import Any

import torch
from diffusers.hooks import ModelHook
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from xema_ray.mitigation.vae_chunking.bands import (
    Bands,
    WholeOutput,
    cut_rows,
    map_shape,
    spatial_ratio,
)
from xema_ray.mitigation.vae_chunking.statistics import LOCAL, BandContext, StatsDone


class SpatialChunkHook(ModelHook):
    """Run a unit over horizontal bands with halos, in passes for its group norms."""

    def __init__(self, chunks: int, halo: int) -> None:
        super().__init__()
        self.chunks = chunks
        self.halo = halo

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward = self.fn_ref.original_forward
        if LOCAL.ctx is not None:
            return forward(*args, **kwargs)  # already inside a band (a chain, an outer unit)
        leaves, spec = tree_flatten((args, kwargs))
        x = next((t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 4), None)
        if x is None:
            return forward(*args, **kwargs)
        h, w = x.shape[-2], x.shape[-1]
        ratios = [spatial_ratio(t, h, w) for t in leaves]
        bands = Bands.plan(h, w, [r for r in ratios if r is not None], self.chunks, self.halo)
        if bands is None:
            return forward(*args, **kwargs)
        ctx = BandContext()
        while True:
            outs: list[WholeOutput | None] | None = None
            out_spec = None
            collecting = False
            for c0, c1, s0, s1 in bands.bands:
                # conv caches waiting on the host come over one band at a time
                sub = [cut_rows(t, r, s0, s1) if r is not None else t for t, r in zip(leaves, ratios, strict=True)]
                sub_args, sub_kwargs = tree_unflatten(sub, spec)
                ctx.enter(c0, c1, s0, s1)
                try:
                    part = forward(*sub_args, **sub_kwargs)
                except StatsDone:
                    collecting = True
                    continue
                finally:
                    LOCAL.ctx = None
                del sub, sub_args, sub_kwargs
                if collecting:
                    raise RuntimeError("vae_chunking: bands of one unit disagree on their group norms")
                part_leaves, out_spec = tree_flatten(part)
                del part
                if outs is None:
                    outs = [WholeOutput(t, s1 - s0, h) if map_shape(t) is not None else None for t in part_leaves]
                for o, t in zip(outs, part_leaves, strict=True):
                    if o is not None:
                        o.write(t, c0, c1, s0, s1)
                del part_leaves
            if collecting:
                ctx.close_pass()
                continue
            if outs is None or out_spec is None:
                raise RuntimeError("vae_chunking: no band produced an output")
            return tree_unflatten([o.result() if o is not None else None for o in outs], out_spec)



def chunk_units(root: nn.Module) -> list[nn.Module]:
    """An up-block's units (its resnets, then its upsamplers); any other module is one unit."""
    resnets = getattr(root, "resnets", None)
    if isinstance(resnets, nn.ModuleList):
        units = list(resnets)
        ups = getattr(root, "upsamplers", None)
        if isinstance(ups, nn.ModuleList):
            units += list(ups)
        elif isinstance(ups, nn.Module):
            units.append(ups)
        return units
    return [root]
