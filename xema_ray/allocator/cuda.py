"""Installing libxema_alloc as torch's CUDA allocator, and the CUDA settings a layout relies on.

Nothing here runs at import: ``install_cuda_allocator`` is an explicit call (rmm's rule), made by a
CUDA worker's constructor before anything touches CUDA. With ``xema_ray/platforms/`` this is the
only code that calls ``torch.cuda``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from xema_ray.allocator.runtime import StaticAllocator


def pin_kernels() -> None:
    """The kernel choices a layout was solved and recorded under, the same in every process.

    ``cudnn.benchmark`` off: autotuning picks different algorithms (and workspaces) run to run and
    raises under a pluggable allocator (docs/measured-facts.md, "The pluggable allocator"). SDPA: flash
    and memory-efficient attention,
    whose allocations the analyzer models (output like q, fp32 logsumexp for flash), with cuDNN
    attention off so no torch version ranks it first on some GPU; math stays on as the last resort
    for shapes neither fused kernel takes (torch tries it only after them), so nothing fails.
    """
    import torch

    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


_INSTALLED: StaticAllocator | None = None
_INSTALL_LOCK = threading.Lock()


def install_cuda_allocator(*, library: Path | None = None, cudart: Path | None = None) -> StaticAllocator:
    """Make libxema_alloc torch's CUDA allocator for this process. Call before anything touches CUDA.

    torch only swaps allocators before its CUDA allocator is initialized, and the swap is
    process-wide; a second call returns the allocator already installed.

    Args:
        library: path of ``libxema_alloc.so``; defaults to the built one.
        cudart: libcudart to call; defaults to the one torch loaded.

    Example (GPU only):
        >>> alloc = install_cuda_allocator()          # doctest: +SKIP
        >>> alloc.reserve(layout.reserved_bytes)      # doctest: +SKIP
        >>> alloc.warm_up()                           # doctest: +SKIP
        >>> with alloc.armed(layout.replay_plan()):   # doctest: +SKIP
        ...     pipeline(**request)
    """
    global _INSTALLED
    import torch

    with _INSTALL_LOCK:
        if _INSTALLED is not None:
            return _INSTALLED
        if not torch.cuda.is_available():
            raise RuntimeError("install_cuda_allocator needs CUDA; use StaticAllocator('host') on a CPU")
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "CUDA is already initialized in this process; install the static allocator before the "
                "first CUDA tensor, stream or device query that initializes it"
            )
        alloc = StaticAllocator("cuda", library=library, cudart=cudart)
        # xema_torch_malloc, not xema_malloc: torch does not check alloc_fn's pointer, so a refusal must
        # throw (a RuntimeError in the op that asked) rather than hand torch a NULL (xema_alloc.h)
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(str(alloc.library_path), "xema_torch_malloc", "xema_free")
        torch.cuda.memory.change_current_allocator(pluggable)
        alloc._pluggable = pluggable
        # torch never forwards record_stream to a pluggable allocator: the transfers say it themselves
        from xema_ray.platforms import streams

        streams.set_mark_used_hook(lambda ptr, stream, device: alloc.mark_used(ptr, stream, device=device),
                                   lambda waiter, other, device: alloc.stream_ordered(waiter, other, device=device))
        _INSTALLED = alloc
        return alloc



def cuda_warm_up_fn(device: int) -> Callable[[], None]:
    def run() -> None:
        import torch
        import torch.nn.functional as F

        dev = torch.device("cuda", device)
        with torch.no_grad():
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                a = torch.randn(256, 256, device=dev, dtype=dtype)
                (a @ a).sum().item()
            q = torch.randn(1, 2, 128, 64, device=dev, dtype=torch.bfloat16)
            F.scaled_dot_product_attention(q, q, q).sum().item()
        # Every warm-up allocation must be done (and freed) before a plan is armed.
        torch.cuda.synchronize(dev)

    return run
