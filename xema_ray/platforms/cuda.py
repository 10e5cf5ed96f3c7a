"""CUDA platform: NCCL for SP groups, the caching allocator's counters (or NVML) for memory,
nvidia-ml-py for the hardware fingerprint. The only module outside the allocator binding that
touches ``torch.cuda``."""

from __future__ import annotations

import torch

from xema_ray.platforms.base import MemoryStats, Platform


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _nvml_name(index: int) -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or no driver: fall back to torch's name
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def _nvml_used_bytes(index: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return int(info.used)


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"

    def device(self, local_index: int = 0) -> torch.device:
        return torch.device("cuda", local_index)

    def set_device(self, local_index: int) -> None:
        torch.cuda.set_device(local_index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def reset_peak_memory(self) -> None:
        try:
            torch.cuda.reset_peak_memory_stats()
        except RuntimeError:
            # under Xema's CUDAPluggableAllocator the caching allocator's stats do not exist
            # (ARCHITECTURE.md); memory_stats() then reports NVML's device usage instead
            pass

    def memory_stats(self) -> MemoryStats:
        try:
            return MemoryStats(
                source="torch.cuda",
                peak_bytes=int(torch.cuda.max_memory_allocated()),
                current_bytes=int(torch.cuda.memory_allocated()),
                reserved_bytes=int(torch.cuda.max_memory_reserved()),
            )
        except RuntimeError:
            used = _nvml_used_bytes(torch.cuda.current_device()) or 0
            return MemoryStats(source="nvml", peak_bytes=used, current_bytes=used)

    def hardware_name(self) -> str:
        index = torch.cuda.current_device()
        return _nvml_name(index) or torch.cuda.get_device_name(index)

    def device_count(self) -> int:
        return torch.cuda.device_count()
