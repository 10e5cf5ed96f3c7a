"""Shared by the tests of exact tracing shortcuts (meta-kernel memo, block replay): the tiny
templates they run and a column-by-column comparison of two traces."""

from __future__ import annotations

import numpy as np

from xema_ray.memory.trace import MemoryTrace
from xema_ray.templates import RequestTemplate

TEMPLATES = [
    RequestTemplate(model="tiny-flux2", height=64, width=64, steps=4),
    RequestTemplate(model="tiny-cogvideox", height=32, width=48, frames=5, steps=4, batch=2),
    RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=4),
]


def columns_equal(a: MemoryTrace, b: MemoryTrace) -> None:
    """Every column and string table equal (provenance ``meta`` aside)."""
    for name, va in vars(a).items():
        if name == "meta":
            continue
        vb = getattr(b, name)
        if isinstance(va, np.ndarray):
            np.testing.assert_array_equal(va, vb, err_msg=name)
        else:
            assert va == vb, name
