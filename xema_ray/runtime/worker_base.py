"""The worker interface (vLLM's ``WorkerBase`` shape): what a worker set calls on each of its workers.

A worker set (``xema_ray.serving.group.worker_set``) constructs every worker as
``cls(platform=..., static_allocator=...)`` — in this process, or as a Ray actor
(``ray.remote(cls)``, which is why arguments and results are pydantic) — and then calls:

- ``device_topology``: its device and direct-link peers (the set orders ranks by them);
- ``init_device``: bind the device, join the worker set (every SP process group, once);
- ``load_model``: place the model's weights as the group's plans say;
- ``execute``: one batch, to its end, or preemptible (``run_id``): ``pause`` parks it at its next
  step boundary and ``execute`` returns a ``PausedRun``; ``resume`` continues it;
- ``layout_reserved_bytes``, ``shutdown``.

Two workers implement it: ``Worker`` (``xema_ray.runtime.worker``: a real device, or CPU and meta)
and ``EmulatedWorker`` (``xema_ray.runtime.emulated``: a GPU that is not there). The preemptible
runs' bookkeeping is this class's, shared by both: which runs are running or parked, a pause
that overtook its batch, the runs that ended (so a late pause is answered False). A worker
provides the batch itself (``_run_batch``) and, where it has them, what a resume moves back
(``_before_resume``) and what a finished run adds to its result (``_finished``).
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from xema_ray.runtime.pause import PausedRun, PreemptibleRun

if TYPE_CHECKING:
    import torch

    from xema_ray.parallel.groups import ParallelConfig
    from xema_ray.runtime.engine import Batch, BatchResult
    from xema_ray.runtime.progress import StepObserver
    from xema_ray.runtime.worker import LoadedModel, ModelLoadConfig

#: recent finished run ids a worker remembers (a pause arriving after its batch ended says False)
ENDED_RUNS = 1024


class WorkerBase(ABC):
    """One worker of a worker set (see the module docstring). Subclasses call ``super().__init__()``."""

    def __init__(self) -> None:
        self._runs: dict[str, PreemptibleRun] = {}  # preemptible batches, running or paused
        self._early: dict[str, bool] = {}  # pauses asked for runs that have not started yet
        self._ended: collections.deque[str] = collections.deque(maxlen=ENDED_RUNS)  # recent finished run ids

    # ------------------------------------------------------------------ what a worker provides
    @abstractmethod
    def device_topology(self, local_index: int = 0) -> tuple[str, list[str]]:
        """This worker's device id and its direct-link peers (for NVLink-aware rank order)."""

    @abstractmethod
    def init_device(self, parallel: ParallelConfig, local_index: int = 0) -> None:
        """Bind this process's device and join the worker set (every SP process group)."""

    @abstractmethod
    def load_model(self, load: ModelLoadConfig) -> LoadedModel:
        """Load the model ``load`` names, its weights placed as the group's plans say."""

    @abstractmethod
    def _loaded(self) -> bool:
        """Whether a model is loaded (``execute`` refuses a batch before)."""

    @abstractmethod
    def _run_batch(self, batch: Batch, observer: StepObserver | None, control: Any) -> BatchResult:
        """Run ``batch`` to its end on the calling thread; ``control`` (a ``PauseControl``, None
        when the batch is not preemptible) parks it at a step boundary when a pause was asked."""

    @abstractmethod
    def layout_reserved_bytes(self) -> int:
        """Device bytes the static allocator holds now (0 when it holds none)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Drop the model and leave the worker set."""

    def _state_device(self) -> torch.device | None:
        """The device a parked batch's state lives on (None: none to move off)."""
        return None

    def _before_resume(self, run_id: str) -> None:
        """What a paused run needs back before it continues (a real worker: its residency)."""

    def _finished(self, run_id: str, result: BatchResult, run: PreemptibleRun) -> dict[str, Any]:
        """Fields of a finished preemptible run's result to update (its pauses; more in a subclass)."""
        return {"paused_s": run.paused_s, "pauses": run.control.pauses}

    def _forget(self, run_id: str) -> None:
        self._ended.append(run_id)
        self._early.pop(run_id, None)
        self._runs.pop(run_id, None)

    # ------------------------------------------------------------------ batches, preemptible ones
    def execute(self, batch: Batch, observer: StepObserver | None = None,
                run_id: str | None = None) -> BatchResult | PausedRun:
        """Run one batch (every rank of the batch's SP group must call this with the same batch).
        ``observer`` hears each finished step and may stop the batch (``xema_ray.runtime.progress``).
        ``run_id``: the batch is preemptible — it runs on a thread of its own and this returns its
        result, or a ``PausedRun`` once it parked (``pause``); None: it runs to its end."""
        if not self._loaded():
            raise ValueError("no model loaded: call load_model first")
        if run_id is None:
            return self._run_batch(batch, observer, None)
        if run_id in self._runs:
            raise ValueError(f"run {run_id!r} is already running or paused on this worker")
        run = PreemptibleRun(run_id, lambda control: self._run_batch(batch, observer, control), self._state_device())
        if run_id in self._early:  # the pause overtook the batch (a threaded actor keeps no call order)
            run.control.request(self._early.pop(run_id))
        self._runs[run_id] = run  # before it starts: the batch may be asked to pause at once
        return self._settle(run_id, run.start)

    def pause(self, run_id: str, offload: bool = False) -> bool:
        """Ask a preemptible batch to park at its next step boundary, its between-step state on the
        device (or on the host: ``offload``). False: no such run here (it already finished)."""
        run = self._runs.get(run_id)
        if run is None:
            if run_id not in self._ended:
                self._early[run_id] = offload  # not started yet: it pauses at its first boundary
                return True
            return False
        if run.done:
            return False
        run.control.request(offload)
        return True

    def resume(self, run_id: str) -> BatchResult | PausedRun:
        """Continue a paused batch; returns as ``execute`` does."""
        run = self._runs.get(run_id)
        if run is None or run.control.paused is None:
            raise ValueError(f"run {run_id!r} is not paused on this worker")
        self._before_resume(run_id)
        return self._settle(run_id, run.resume)

    def paused_runs(self) -> list[PausedRun]:
        """The batches parked on this worker."""
        return [r.control.paused for r in self._runs.values() if r.control.paused is not None]

    def _settle(self, run_id: str, step: Callable[[], Any]) -> BatchResult | PausedRun:
        try:
            out = step()
        except BaseException:
            self._forget(run_id)
            raise
        if isinstance(out, PausedRun):
            return out
        run = self._runs[run_id]
        update = self._finished(run_id, out, run)
        self._forget(run_id)
        return out.model_copy(update=update)
