"""Shape-only allocation tracer: a ``TorchDispatchMode`` that records every device allocation.

Shaped like PyTorch's ``MemTracker``: live memory is keyed by ``untyped_storage()`` (views share
a storage and cost nothing), frees are seen through ``weakref`` callbacks on the storage object
(PyTorch keeps one Python object per live storage, so the callback fires exactly when the
storage is released), sizes are rounded as the CUDA caching allocator rounds requests, and the
innermost running ``nn.Module`` is attributed through global forward hooks.

On the meta device nothing is computed, so a real-size pipeline (32 B parameters) traces on a
CPU in seconds. Attention is the exception the tracer must correct: on meta and CPU,
``scaled_dot_product_attention`` takes the math path and would materialise S×S score matrices
that CUDA's flash / memory-efficient kernels never allocate; ``cuda_like_sdpa`` replaces it
while tracing with what the CUDA kernels allocate.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from xema_ray.analyzer.meta_memo import MetaKernelMemo
from xema_ray.memory.trace import Category

# c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize = 512 and round_size() rounds every request
# up to a multiple of it; a zero-byte request allocates nothing.
MIN_BLOCK_SIZE = 512

ALLOC, FREE = 0, 1
_UNSEEN = object()
_TO_COPY = torch.ops.aten._to_copy.default


def round_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator reserves for an ``nbytes`` request."""
    if nbytes <= 0:
        return 0
    return ((nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


@dataclass(slots=True)
class _Record:
    nbytes: int
    category: int
    module: int
    op: int
    begin: int
    end: int = -1
    free_module: int = -1
    holders: int = 1  # storages standing for this allocation (>1 only for host→device aliases)


@dataclass
class RawTrace:
    """The tracer's log before any replication: events in order plus one record per allocation."""

    records: list[_Record]
    event_kind: list[int]
    event_alloc: list[int]
    markers: list[tuple[int, str]]
    modules: list[str]
    ops: list[str]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def n_events(self) -> int:
        return len(self.event_kind)


class AllocationTracer(TorchDispatchMode):
    """Record allocations and frees of tensors on ``device`` in event order.

    Args:
        device: device type whose memory is traced ("meta" for analysis, "cpu" for the
            reference run that checks the meta trace).
        module_names: ``id(module) -> dotted path`` for attribution; modules not in it are
            named by class.
        count_host: also count CPU tensors when tracing meta. Only for the correctness test
            that compares a meta trace with a CPU run (where host and device are the same
            memory): a same-dtype host→device copy is then the same allocation, not a new one.
        memoise: run each distinct meta kernel signature once (``meta_memo``); exact, and
            several times faster on real pipelines. False only to check that claim.

    Example:
        >>> tracer = AllocationTracer("meta", {})
        >>> with torch.no_grad(), tracer:
        ...     x = torch.empty(1000, device="meta"); del x
        >>> tracer.raw().event_kind
        [0, 1]
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in a dynamo-disabling wrapper
        # (two extra Python frames per operator); nothing here is ever compiled
        return False

    def __init__(self, device: str, module_names: dict[int, str], count_host: bool = False, memoise: bool = True) -> None:
        super().__init__()
        self.memo = MetaKernelMemo() if memoise else None
        self.device = torch.device(device).type
        self.count_host = count_host and self.device != "cpu"
        self._module_names = module_names
        self._records: list[_Record] = []
        self._event_kind: list[int] = []
        self._event_alloc: list[int] = []
        self._markers: list[tuple[int, str]] = []
        self._modules: list[str] = []
        self._module_index: dict[str, int] = {}
        self._ops: list[str] = []
        self._op_index: dict[str, int] = {}
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (ref, record index)
        self._module_stack: list[nn.Module] = []
        self._hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._paused = 0
        self._closed = False
        self._category = int(Category.ACTIVATION)
        # per operator: its name for the ops table, None when it never allocates (views, in-place)
        self._op_names: dict[Any, str | None] = {}
        # id(module) -> (module, interned name index); holds the module, so ids are never reused
        self._module_ids: dict[int, tuple[nn.Module, int]] = {}
        self._meta_only = self.device == "meta" and not self.count_host

    # ------------------------------------------------------------------ registration
    def _intern(self, table: list[str], index: dict[str, int], name: str) -> int:
        i = index.get(name)
        if i is None:
            i = index[name] = len(table)
            table.append(name)
        return i

    def _current_module(self) -> int:
        """The innermost running module's name index, interned on its first allocation."""
        if not self._module_stack:
            return -1
        m = self._module_stack[-1]
        hit = self._module_ids.get(id(m))
        if hit is not None:
            return hit[1]
        i = self._intern(self._modules, self._module_index, self._module_names.get(id(m)) or type(m).__name__)
        self._module_ids[id(m)] = (m, i)
        return i

    def _counts(self, t: torch.Tensor) -> bool:
        dev = t.device.type
        return dev == self.device or (self.count_host and dev == "cpu")

    def register_resident(self, tensors: dict[str, torch.Tensor], category: Category) -> None:
        """Record tensors that exist before the request runs (weights, inputs) as allocated now."""
        from xema_ray.mitigation.weight_quant import tensor_leaves

        for name, tensor in tensors.items():
            for t in tensor_leaves(tensor):  # a quantized weight's values and scales, each its own storage
                if self._counts(t):
                    self._track(t, module=self._intern(self._modules, self._module_index, name), op=-1,
                                category=int(category))

    def register_module(self, prefix: str, module: nn.Module) -> None:
        """Register a module's parameters and buffers as resident weights."""
        tensors = {f"{prefix}.{n}" if prefix else n: p for n, p in module.named_parameters()}
        tensors.update({f"{prefix}.{n}" if prefix else n: b for n, b in module.named_buffers()})
        self.register_resident(tensors, Category.WEIGHT)

    def mark(self, label: str) -> None:
        """Insert a named marker at the current event position (step ends, phase changes)."""
        self._markers.append((len(self._event_kind), label))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run ops without recording them (their storages are never tracked)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ------------------------------------------------------------------ storage tracking
    def _track(self, t: torch.Tensor, module: int, op: int, category: int, alias_of: torch.Tensor | None = None) -> None:
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse / nested layouts own no plain storage
            return
        key = id(storage)
        hit = self._live.get(key)
        if hit is not None and hit[0]() is storage:
            return
        if alias_of is not None:
            src = self._live.get(id(alias_of.untyped_storage()))
            if src is None:
                return  # the host tensor was never tracked (e.g. torch.from_numpy), nor is its copy
            rec_idx = src[1]
            self._records[rec_idx].holders += 1
            self._live[key] = (weakref.ref(storage, self._make_free_cb(key, rec_idx)), rec_idx)
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        rec_idx = len(self._records)
        self._records.append(_Record(nbytes, category, module, op, len(self._event_kind)))
        self._event_kind.append(ALLOC)
        self._event_alloc.append(rec_idx)
        self._live[key] = (weakref.ref(storage, self._make_free_cb(key, rec_idx)), rec_idx)

    def adopt(self, t: torch.Tensor, rec_idx: int) -> torch.UntypedStorage:
        """Track ``t``'s storage as the allocation ``rec_idx`` already recorded (block replay
        appends its records itself); its free is seen as usual. Returns the storage."""
        storage = t.untyped_storage()
        key = id(storage)
        self._live[key] = (weakref.ref(storage, self._make_free_cb(key, rec_idx)), rec_idx)
        return storage

    def _make_free_cb(self, key: int, rec_idx: int) -> Callable[[weakref.ref], None]:
        def on_free(ref: weakref.ref) -> None:
            entry = self._live.get(key)
            if entry is not None and entry[0] is ref:
                del self._live[key]
            if self._closed:
                return
            rec = self._records[rec_idx]
            rec.holders -= 1
            if rec.holders == 0:
                rec.end = len(self._event_kind)
                rec.free_module = self._current_module()
                self._event_kind.append(FREE)
                self._event_alloc.append(rec_idx)

        return on_free

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs) if self.memo is None else self.memo.call(func, args, kwargs)
        if self._paused:
            return out
        op_name = self._op_names.get(func, _UNSEEN)
        if op_name is _UNSEEN:
            name = str(func.overloadpacket.__name__)
            # views and in-place ops never allocate; their storage is either tracked already or
            # predates tracing (a scheduler's table), and a first touch is not an allocation
            op_name = self._op_names[func] = None if func.is_view or name.endswith("_") else name
        if op_name is None:
            return out
        alias_of = None
        if self.count_host and func is _TO_COPY:
            src = args[0]
            # host→device copy with the same dtype: in a CPU run this is the same tensor
            if src.device.type == "cpu" and out.device.type == self.device and src.dtype == out.dtype:
                alias_of = src
        module = -1
        op = -1
        meta_only = self._meta_only
        for t in (out,) if type(out) is torch.Tensor else tree_leaves(out):
            if isinstance(t, torch.Tensor) and (t.is_meta if meta_only else self._counts(t)):
                if op < 0:
                    module = self._current_module()
                    op = self._intern(self._ops, self._op_index, op_name)
                self._track(t, module, op, self._category, alias_of)
        return out

    # ------------------------------------------------------------------ module attribution
    def __enter__(self) -> AllocationTracer:
        # the dispatch mode is thread-local, the module hooks global: a module another thread runs
        # meanwhile (a batch on a worker's thread) is neither this trace's nor on its stack
        owner = threading.get_ident()

        def pre(module: nn.Module, _inputs: object) -> None:
            if threading.get_ident() == owner:
                self._module_stack.append(module)

        def post(module: nn.Module, _inputs: object, _output: object) -> None:
            if threading.get_ident() != owner:
                return
            # pop back to this module: a forward that raised left its children on the stack
            while self._module_stack:
                if self._module_stack.pop() is module:
                    break

        self._hook_handles = [
            nn.modules.module.register_module_forward_pre_hook(pre),
            nn.modules.module.register_module_forward_hook(post, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        self._module_stack.clear()
        return super().__exit__(*exc)

    # ------------------------------------------------------------------ result
    def raw(self) -> RawTrace:
        """Close the trace (storages alive now stay allocated to the end) and return the log."""
        self._closed = True
        return RawTrace(
            records=self._records,
            event_kind=self._event_kind,
            event_alloc=self._event_alloc,
            markers=self._markers,
            modules=self._modules,
            ops=self._ops,
        )


# ---------------------------------------------------------------------------- attention
_ORIGINAL_SDPA = F.scaled_dot_product_attention


def make_cuda_like_sdpa(tracer: AllocationTracer | None) -> Callable[..., torch.Tensor]:
    """An SDPA that allocates what CUDA's fused kernels allocate (docs/measured-facts.md, "Fused
    attention's allocations"):

    - output: ``[B, Sq, H, Dv]`` contiguous, returned transposed to ``[B, H, Sq, Dv]`` (the fused
      kernels write BSHD, so a later ``transpose(1, 2).flatten(2)`` is a free view, not a copy);
    - without a mask (flash): an fp32 logsumexp ``[B, H, Sq]``, freed as soon as the op returns;
    - with a mask (memory-efficient kernel): no logsumexp under ``no_grad``.

    Off the meta device the real values are computed with the tracer paused and copied into the
    recorded output, so a CPU reference run produces correct pixels with the same accounting.
    """

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        *batch, heads, sq, _ = query.shape
        dv = value.shape[-1]
        out = torch.empty((*batch, sq, heads, dv), dtype=query.dtype, device=query.device).transpose(-3, -2)
        if query.device.type != "meta":
            with tracer.paused() if tracer is not None else contextlib.nullcontext():
                ref = _ORIGINAL_SDPA(
                    query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa,
                )
            out.copy_(ref)
            del ref
        if attn_mask is None:
            lse = torch.empty((*batch, heads, sq), dtype=torch.float32, device=query.device)
            del lse
        return out

    return sdpa


@contextlib.contextmanager
def cuda_like_attention(tracer: AllocationTracer | None) -> Iterator[None]:
    """Swap ``F.scaled_dot_product_attention`` for ``make_cuda_like_sdpa`` while tracing.

    diffusers looks the function up on ``torch.nn.functional`` at call time, so patching the
    module attribute reaches every attention processor and dispatch backend. The attribute is the
    whole process's: only the thread that entered gets the traced attention; any other thread (a
    batch running beside the trace) gets what was there before, and never pauses the tracer."""
    owner = threading.get_ident()
    before = F.scaled_dot_product_attention
    traced = make_cuda_like_sdpa(tracer)

    def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        return (traced if threading.get_ident() == owner else before)(*args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = before


_RECORD_FIELDS = operator.attrgetter("nbytes", "begin", "end", "category", "module", "op", "free_module")


def raw_to_arrays(raw: RawTrace) -> dict[str, np.ndarray]:
    """Per-allocation columns of a raw trace (end = n_events where never freed)."""
    recs = raw.records
    # one pass over the records at C speed: 7 fields each, in _RECORD_FIELDS order
    table = np.fromiter(itertools.chain.from_iterable(map(_RECORD_FIELDS, recs)), dtype=np.int64,
                        count=7 * len(recs)).reshape(len(recs), 7)
    end = table[:, 2].copy()
    end[end < 0] = raw.n_events
    return {
        "nbytes": table[:, 0].copy(),
        "begin": table[:, 1].copy(),
        "end": end,
        "category": table[:, 3].astype(np.int8),
        "module": table[:, 4].astype(np.int32),
        "op": table[:, 5].astype(np.int32),
        "free_module": table[:, 6].astype(np.int32),
    }
