"""CUDA platform: NCCL for SP groups, the caching allocator's counters (or NVML) for memory,
nvidia-ml-py for the hardware fingerprint. The only module outside the allocator binding that
touches ``torch.cuda``."""

from __future__ import annotations

import ctypes
import functools

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


def _nvml_index(local_index: int) -> int:
    """The NVML index of this process's ``local_index``-th visible GPU (CUDA_VISIBLE_DEVICES maps them)."""
    import os

    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and local_index < len(visible) and visible[local_index].isdigit():
        return int(visible[local_index])
    return local_index


def _nvml_bus_id(local_index: int) -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            info = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(_nvml_index(local_index)))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or no driver
        return None
    bus = info.busId
    return bus.decode() if isinstance(bus, bytes) else str(bus)


def _norm_bus_id(bus_id: str | bytes) -> str:
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    return text.strip().lower()[-12:]  # NVML and torch pad the PCI domain differently


def _nvlink_peers(bus_id: str) -> set[str]:
    """PCI bus ids this GPU reaches over an active NVLink (empty without NVML or NVLink)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode() if isinstance(bus_id, str) else bus_id)
            peers = set()
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    peers.add(_norm_bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
                except pynvml.NVMLError:  # link index not present on this GPU
                    continue
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML / driver: treat as no NVLink, ordering falls back to bundle order
        return set()
    return peers


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    allocator_backend = "cuda"

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
            # (docs/measured-facts.md, "The pluggable allocator"); memory_stats() then reports
            # NVML's device usage instead
            pass

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    def register_host(self, ptr: int, nbytes: int) -> bool:
        """``cudaHostRegister`` (flags 0: the current device's context): the memory becomes
        page-locked at its exact size, where torch's pinned allocator would round each block up
        to a power of two. Several processes may register the same shared pages."""
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err != 0:
            clear_last_cuda_error()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err} (host memory "
                               "locked-page limits: ulimit -l, or not enough RAM)")
        return True

    def unregister_host(self, ptr: int) -> None:
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            clear_last_cuda_error()  # not registered (a failed register): nothing to undo

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

    def device_topology(self, local_index: int = 0) -> tuple[str, set[str]]:
        """(this GPU's PCI bus id, bus ids of its NVLink peers), read through NVML: asking torch
        (``get_device_properties``) would initialise CUDA, after which the static allocator can no
        longer be installed in this process."""
        bus = _nvml_bus_id(local_index)
        if bus is None:  # no NVML: torch's view (initialises CUDA; the static allocator is then not installable)
            props = torch.cuda.get_device_properties(local_index)
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return _norm_bus_id(bus), _nvlink_peers(bus)


@functools.cache
def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (its last error is per thread and per library), found
    among this process's mappings; None where torch links it statically."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(None, 1)[-1]
            if "/libcudart.so" in path:
                return ctypes.CDLL(path)
    return None


def clear_last_cuda_error() -> None:
    """Reset the thread's last CUDA error after a runtime call whose failure was handled here.
    torch's bindings of ``cudaHostRegister``/``cudaHostUnregister`` return the error and leave it
    set (``C10_CUDA_ERROR_HANDLED``); left set, torch's next kernel-launch check raises it as the
    kernel's own failure. The allocator's backend does the same for the calls it makes."""
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()
