"""Pausing a running batch at a denoising-step boundary and resuming it later, bitwise unchanged.

A preemptible batch runs its pipeline call on a thread of its own (``PreemptibleRun``). When the
serving layer asks it to pause, the engine's step callback parks that thread at the next step
boundary (``PauseControl.park``): the batch's mitigations, sequence parallelism and static
layout are taken off the shared pipeline, the pipeline's per-call state (its scheduler and its
private attributes: guidance scale, interrupt flag, step counters) is set aside so another batch
can use the pipeline, and the between-step tensors — latents, prompt embeddings, rotary
embeddings, scheduler state, everything the paused call's frame and scheduler reference — either
stay where they are (the plan's memory allows it) or move to (pinned) host memory. Resuming puts
all of it back and lets the same Python frame continue: the remaining steps run the same code on
the same values, so the output is bitwise equal to an uninterrupted run.

Host moves work on storages, not tensors: every tensor viewing a moved storage is re-pointed at
the copy (``Tensor.set_``), so views stay views of one buffer and no extra device copy lingers.
Weights (parameters and buffers of the pipeline's modules) are never moved here: where they live
is the residency's business (``xema_ray.runtime.residency``).

An SP group pauses all its ranks at the same step: the step callback's agreement collective
(``xema_ray.runtime.progress``) carries the pause vote with the cancel vote.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from xema_ray.platforms import streams as _device

#: container depth searched for tensors in the paused frame (lists of lists of tensors, dicts...)
_MAX_DEPTH = 4


class PausedRun(BaseModel):
    """What a worker reports when a preemptible batch parked at a step boundary."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    step: int = Field(ge=0, description="denoising steps finished before the pause")
    total_steps: int = Field(ge=1)
    state_bytes: int = Field(ge=0, description="bytes of between-step state the paused batch holds")
    offloaded: bool = Field(description="the state moved to host memory (else it stayed on the device)")
    pause_s: float = Field(ge=0, description="seconds the pause itself took (state moves included)")


@dataclass
class _Moved:
    """One storage moved to the host, and the tensors that view it."""

    device: torch.device
    host: torch.UntypedStorage
    views: list[tuple[torch.Tensor, int, torch.Size, tuple[int, ...]]]


def _tensors_in(obj: Any, out: dict[int, torch.Tensor], depth: int = 0) -> None:
    if isinstance(obj, nn.Parameter | nn.Module):
        return
    if isinstance(obj, torch.Tensor):
        out.setdefault(id(obj), obj)
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(obj, dict):
        for v in obj.values():
            _tensors_in(v, out, depth + 1)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _tensors_in(v, out, depth + 1)


def _weight_storages(pipe: Any) -> set[int]:
    ptrs: set[int] = set()
    for comp in getattr(pipe, "components", {}).values():
        if isinstance(comp, nn.Module):
            for t in (*comp.parameters(), *comp.buffers()):
                if t.device.type != "meta":
                    ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


def state_tensors(pipe: Any, frame_locals: dict[str, Any], scheduler: Any, extra: dict[str, Any],
                  device: torch.device | None = None) -> list[torch.Tensor]:
    """Every non-weight tensor a paused pipeline call holds on ``device`` (None: on any device
    but meta): its frame's locals, its scheduler's attributes, the callback's tensors and the
    pipeline's own non-module attributes."""
    found: dict[int, torch.Tensor] = {}
    for source in (frame_locals, vars(scheduler) if scheduler is not None else {}, extra,
                   {k: v for k, v in vars(pipe).items() if not isinstance(v, nn.Module)}):
        _tensors_in(source, found)
    weights = _weight_storages(pipe)
    return [t for t in found.values() if t.device.type != "meta" and (device is None or t.device == device)
            and t.untyped_storage().nbytes() > 0 and t.untyped_storage().data_ptr() not in weights]


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts once, with its base)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _flat(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The whole storage as one byte tensor (what a move copies)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def move_to_host(tensors: list[torch.Tensor], pin: bool) -> list[_Moved]:
    """Re-point every tensor at a host copy of its storage (one copy per storage). The copies are
    synchronous (``platforms.streams.to_host`` without a side stream: the CPU waits for the device),
    so each device storage may be reused as soon as its tensors let go of it."""
    by_storage: dict[int, _Moved] = {}
    for t in tensors:
        s = t.untyped_storage()
        key = s.data_ptr()
        moved = by_storage.get(key)
        if moved is None:
            flat = _flat(s, t.device)
            # on a CPU box: a separate buffer (the clone stands for the copy)
            host = flat.clone() if _device.host_is_device(t.device) else _device.to_host(flat, pin=pin)[0]
            moved = by_storage[key] = _Moved(t.device, host.untyped_storage(), [])
        moved.views.append((t, t.storage_offset(), t.size(), t.stride()))
    for moved in by_storage.values():
        for t, offset, size, stride in moved.views:
            t.set_(moved.host, offset, size, stride)
    return list(by_storage.values())


def move_back(moved: list[_Moved]) -> None:
    """Undo ``move_to_host``: one device copy per storage (on the compute stream, which reads it
    next), every view re-pointed at it."""
    for m in moved:
        flat = _flat(m.host, torch.device("cpu"))
        dev = flat.clone() if _device.host_is_device(m.device) else _device.to_device(flat, m.device, None)
        for t, offset, size, stride in m.views:
            t.set_(dev.untyped_storage(), offset, size, stride)


@dataclass
class PauseControl:
    """Shared by the thread running a preemptible batch and the worker that controls it.

    The worker calls ``request`` (pause at the next step boundary, state on the device or the
    host) and ``resume``; the engine's step callback calls ``wants_pause`` and ``park``.
    """

    run_id: str
    device: torch.device | None = None  # where the state that counts lives (the worker's device)
    #: the batch ran with its static layout armed: its state lies in the layout's arena, which the
    #: next armed batch reuses, so a pause must move it to the host
    must_offload: bool = False
    _want: threading.Event = field(default_factory=threading.Event)
    _offload: bool = False
    _resume: threading.Event = field(default_factory=threading.Event)
    #: set by the run's thread when it parks or ends: the worker waits on it
    changed: threading.Event = field(default_factory=threading.Event)
    paused: PausedRun | None = None
    pauses: int = 0

    def request(self, offload: bool) -> None:
        self._offload = offload
        self._want.set()

    def wants_pause(self) -> bool:
        return self._want.is_set()

    def offload_requested(self) -> bool:
        return self._offload

    def resume(self) -> None:
        self.paused = None
        self.changed.clear()
        self._resume.set()

    def hold(self, step: int, total: int, state_bytes: int, offloaded: bool, pause_s: float) -> None:
        """On the run's thread, once its state is set aside: report the pause and wait for
        ``resume`` (``park`` for a real pipeline; the emulated worker calls it directly)."""
        self._want.clear()
        self.pauses += 1
        self.paused = PausedRun(run_id=self.run_id, step=step, total_steps=total, state_bytes=state_bytes,
                                offloaded=offloaded, pause_s=pause_s)
        self._resume.clear()
        self.changed.set()
        self._resume.wait()

    def park(self, pipe: Any, frame_locals: dict[str, Any], tensors: dict[str, Any], step: int, total: int,
             detach: Callable[[], None], attach: Callable[[], None], offload: bool = False) -> None:
        """Called on the run's thread inside the step callback: set the batch aside, wait for
        ``resume``, put it back. ``detach``/``attach`` take the batch's mitigations, SP and layout
        off the pipeline and back on; ``offload``: the state goes to the host (the group agreed)."""
        t0 = time.perf_counter()
        self._want.clear()
        detach()
        scheduler = pipe.scheduler
        own_attrs = {k: v for k, v in vars(pipe).items() if not isinstance(v, nn.Module)}
        held = state_tensors(pipe, frame_locals, scheduler, tensors, self.device)
        nbytes = storage_bytes(held)
        moved = move_to_host(held, pin=True) if offload or self.must_offload else []
        # other batches get a scheduler of their own; the paused call keeps this one (and its state)
        pipe.scheduler = copy.deepcopy(scheduler)
        self.hold(step, total, nbytes, bool(moved), time.perf_counter() - t0)
        move_back(moved)
        for k in [k for k, v in vars(pipe).items() if not isinstance(v, nn.Module) and k not in own_attrs]:
            delattr(pipe, k)  # a later batch's per-call attributes
        for k, v in own_attrs.items():
            setattr(pipe, k, v)
        pipe.scheduler = scheduler
        attach()


class PreemptibleRun:
    """One batch on a thread of its own, so the worker can pause it and run another batch.

    ``body`` is the whole batch (residency switch, engine call); ``start`` (and ``resume``) return
    its result, raise its error, or return the ``PausedRun`` when it parks.
    """

    def __init__(self, run_id: str, body: Callable[[PauseControl], Any], device: torch.device | None = None) -> None:
        self.control = PauseControl(run_id, device)
        self._result: Any = None
        self._error: BaseException | None = None
        self.done = False
        self.paused_s = 0.0
        self._paused_at: float | None = None

        def target() -> None:
            try:
                self._result = body(self.control)
            except BaseException as e:  # delivered to whoever waits
                self._error = e
            finally:
                self.done = True
                self.control.changed.set()

        self._thread = threading.Thread(target=target, name=f"xema-run-{run_id}", daemon=True)

    def start(self) -> Any:
        """Start the batch; returns as ``wait`` does."""
        self._thread.start()
        return self.wait()

    def wait(self) -> Any:
        self.control.changed.wait()
        if self.done:
            self._thread.join()
            if self._error is not None:
                raise self._error
            return self._result
        self._paused_at = time.perf_counter()
        return self.control.paused

    def resume(self) -> Any:
        if self._paused_at is not None:
            self.paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None
        self.control.resume()
        return self.wait()

