"""Type stub of the compiled layout solver (allocator_ext/src/solver_module.cpp)."""

from typing import TypedDict

import numpy as np
import numpy.typing as npt

class SolveOutput(TypedDict):
    offsets: npt.NDArray[np.int64]
    reserved: int
    lower_bound: int
    order: str
    candidates: dict[str, int]
    seconds: float
    reserved_greedy: int
    segments: int
    crossers: int
    refine_rounds: int

def solve(
    size: npt.ArrayLike,
    begin: npt.ArrayLike,
    end: npt.ArrayLike,
    alignment: int = 512,
    orders: list[str] = ...,
    hoist_universal: bool = True,
    compact: bool = True,
    segment_size: int = 4096,
    segment_max_crossing: float = 0.1,
    refine_iterations: int = 48,
    descent: bool = True,
) -> SolveOutput: ...
def lower_bound(size: npt.ArrayLike, begin: npt.ArrayLike, end: npt.ArrayLike, alignment: int = 512) -> int: ...
