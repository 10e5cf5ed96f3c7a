"""Sequence parallelism (Ulysses x ring USP) for the three paper models, over torch.distributed.

- ``groups``: process groups for every SP layout, created once per worker set.
- ``attention``: Ulysses all-to-all, ring attention with LSE merging, split/gather collectives.
- ``plans``: which inputs of each model's transformer are per-token, and how to split them.
- ``sp``: ``apply_sequence_parallel`` — the removable hooks that tie them together.
- ``_xfuser``: the xDiT import shim (CUDA only).
"""

from xema_ray.parallel.groups import ParallelConfig, ProcessGroups, SPGroup, SPLayout, init_process_groups
from xema_ray.parallel.sp import SequenceParallelHandle, apply_sequence_parallel

__all__ = [
    "ParallelConfig",
    "ProcessGroups",
    "SPGroup",
    "SPLayout",
    "SequenceParallelHandle",
    "apply_sequence_parallel",
    "init_process_groups",
]
