"""Emulated GPUs: a worker slot that holds one Ray ``GPU`` resource on a node started with a
declared GPU count (``ray start --num-gpus 8``) but computes nothing (``xema_ray.runtime.emulated``).

Collectives (the per-step agreement of an SP group) run over gloo on the host, as on the CPU
platform. The topology is the emulated box's: Ray hands each worker one GPU id through
``CUDA_VISIBLE_DEVICES`` and the devices of one NVLink domain (pairs on the 8x A6000 box) are
linked, so the rank order the model group derives is the real box's.
"""

from __future__ import annotations

import os

from xema_ray.platforms.cpu import CpuPlatform


def visible_gpu_ids() -> list[str]:
    """The GPU ids Ray gave this process (``CUDA_VISIBLE_DEVICES``; empty outside a GPU actor)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [x.strip() for x in raw.split(",") if x.strip()]


def _node_id() -> str:
    """The Ray node this process runs on (several emulated nodes may share one machine), else the pid's host."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()[:12]
    except Exception:  # outside Ray: the devices are this process's own
        pass
    import socket

    return socket.gethostname()


class EmulatedPlatform(CpuPlatform):
    """One emulated GPU of ``hardware_name`` (e.g. 'NVIDIA RTX A6000'), NVLink domains of
    ``nvlink_domain`` devices.

    Example:
        >>> p = EmulatedPlatform("NVIDIA RTX A6000", nvlink_domain=2)
        >>> p.name, p.dist_backend
        ('emulated', 'gloo')
    """

    name = "emulated"  # type: ignore[assignment]
    dist_backend = "gloo"

    def __init__(self, hardware_name: str = "emulated GPU", nvlink_domain: int = 1) -> None:
        if nvlink_domain < 1:
            raise ValueError(f"nvlink_domain must be >= 1, got {nvlink_domain}")
        self._hardware = hardware_name
        self.nvlink_domain = nvlink_domain

    def hardware_name(self) -> str:
        return f"{self._hardware} (emulated)"

    def device_count(self) -> int:
        return len(visible_gpu_ids())

    def device_topology(self, local_index: int = 0) -> tuple[str, set[str]]:
        """``emulated:<node>:<gpu id>`` and the other GPUs of its NVLink domain on this node.
        Without a Ray GPU (a test's in-process worker) it is unlinked, like a CPU slot."""
        ids = visible_gpu_ids()
        host = _node_id()
        if local_index >= len(ids) or not ids[local_index].isdigit():
            return f"emulated:{host}:pid{os.getpid()}:{local_index}", set()
        gpu = int(ids[local_index])
        first = gpu - gpu % self.nvlink_domain
        peers = {f"emulated:{host}:{g}" for g in range(first, first + self.nvlink_domain) if g != gpu}
        return f"emulated:{host}:{gpu}", peers
