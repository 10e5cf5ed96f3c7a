"""The seam between a model group and its workers (vLLM's executor, ``collective_rpc`` at its core).

A ``WorkerSet`` starts a group's workers (one per GPU, or per CPU slot), joins them into one
worker set (every SP process group created once), loads the model on each, calls a method on
some or all of its ranks (``collective_rpc``), pauses and resumes preemptible batches, rebuilds
the whole set after a worker died and reports its health. ``ModelGroup`` only sees this
interface; which implementation runs is a choice made at one place (``WORKER_KINDS`` and
``worker_set_for``):

- ``RayWorkerSet`` (``worker_set_ray``): one Ray actor per worker in the replica's placement
  group bundles — what the deployment runs (``device: cpu`` or ``cuda``).
- ``InProcessWorkerSet`` (``worker_set_local``): workers in this process, each call
  on a thread of its own worker — for tests of the group without a Ray cluster. It runs SP 1
  only (torch.distributed has one world per process) and says so when a plan needs more.

A new kind of worker (another device, an emulated accelerator) plugs in by adding a
``WorkerKind`` to ``WORKER_KINDS``: its class (a ``WorkerBase``: ``xema_ray.runtime.worker_base``),
the platform it is given, and the Ray resources one worker asks for.

A worker that dies (``WorkerDied``) breaks every SP group of its set: the caller rebuilds the
set (``rebuild``), once per failure however many batches saw it. The blocking part of a rebuild
(starting, joining, loading) runs off the event loop on a new generation that nothing else
reads; the loop swaps it in when it is ready, so the loop never sees a half-built set.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from xema_ray.runtime.engine import Batch, BatchResult
    from xema_ray.runtime.pause import PausedRun
    from xema_ray.runtime.progress import StepObserver
    from xema_ray.runtime.worker import LoadedModel
    from xema_ray.runtime.worker_base import WorkerBase

logger = logging.getLogger("xema_ray.serving")

WorkerSetBackend = Literal["ray", "inprocess"]
#: one worker as ``probe`` finds it: dead by fact (its process is gone), busy (no answer in time:
#: a worker running a batch answers late, which is not death), ok
WorkerState = Literal["ok", "busy", "dead"]


# The built-in kinds name their classes through functions that import them where the workers
# start: naming a kind (this module, the app builder) imports neither torch nor the worker modules.
def _worker() -> type[WorkerBase]:
    from xema_ray.runtime.worker import Worker

    return Worker


def _emulated_worker() -> type[WorkerBase]:
    from xema_ray.runtime.emulated import EmulatedWorker

    return EmulatedWorker


@dataclass(frozen=True)
class WorkerKind:
    """One kind of worker: its class (a ``WorkerBase``, given as the class or as a function that
    imports it where the workers start), the platform its constructor gets, the Ray resources of
    one worker, the default backend."""

    worker_class: type[WorkerBase] | Callable[[], type[WorkerBase]]
    platform: str
    num_gpus: float = 0.0
    ray_options: dict[str, Any] = field(default_factory=dict)
    backend: WorkerSetBackend = "ray"

    def bundle(self, worker_cpus: float) -> dict[str, float]:
        """The placement-group bundle one worker of this kind needs (its actor's resources)."""
        out = {"CPU": worker_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}
        out.update(self.ray_options.get("resources", {}))
        return out

    def load_class(self) -> type[WorkerBase]:
        """The worker class (what the in-process set constructs, what a Ray actor is made of)."""
        from xema_ray.runtime.worker_base import WorkerBase

        ref = self.worker_class
        cls = ref if isinstance(ref, type) else ref()
        if not (isinstance(cls, type) and issubclass(cls, WorkerBase)):
            raise TypeError(f"a worker kind's class must implement xema_ray.runtime.worker_base.WorkerBase, got {cls!r}")
        return cls


#: device (the deployment's ``device``) -> its kind of worker: the one place a new kind plugs in
WORKER_KINDS: dict[str, WorkerKind] = {
    "cpu": WorkerKind(_worker, platform="cpu"),
    "cuda": WorkerKind(_worker, platform="cuda", num_gpus=1.0),
    # no weights, no math: the plan's latencies / time_scale, one Ray GPU of a node that declares
    # GPUs (docs/emulated.md); its phases arrive with the load config
    "emulated": WorkerKind(_emulated_worker, platform="emulated", num_gpus=1.0),
}


class WorkerSetSpec(BaseModel):
    """What a group's worker set is made of (pydantic: it travels with the deployment)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(default="cpu", description=f"the kind of worker, a key of WORKER_KINDS ({', '.join(WORKER_KINDS)})")
    size: int = Field(ge=1, description="workers in the set (bundles of the replica's placement group)")
    load: Any = Field(description="the ModelLoadConfig every worker loads (typed there; Any keeps torch out of here)")
    layouts: tuple[tuple[int, int], ...] = Field(default=(), description="(ulysses, ring) of every SP > 1 layout the plans use")
    worker_cpus: float = Field(default=0.25, gt=0, description="CPUs one worker asks for")
    concurrency: int = Field(default=1, ge=1, description="calls a worker serves at once (>1: preemption reaches a busy worker)")
    static_allocator: bool = Field(default=False, description="CUDA workers install the static allocator; CPU "
                                   "workers mirror their batches into its host arena (xema_ray.allocator.host_tensors)")
    backend: WorkerSetBackend | None = Field(default=None, description="None: the kind's own (Ray actors for cpu and cuda)")

    def kind(self) -> WorkerKind:
        if self.device not in WORKER_KINDS:
            raise ValueError(f"unknown worker device {self.device!r}; known: {', '.join(sorted(WORKER_KINDS))}")
        return WORKER_KINDS[self.device]


class WorkerDied(RuntimeError):
    """A worker of the set is gone (its process died, it was killed): the set must be rebuilt."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(rank, reason)
        self.rank = rank
        self.reason = reason

    def __str__(self) -> str:
        return f"worker {self.rank} died: {self.reason}"


class RebuildFailed(RuntimeError):
    """The worker set could not be rebuilt (a worker of the new set died while it was built)."""


class WorkerSetHealth(BaseModel):
    """The set as its group reports it (``/healthz``)."""

    state: Literal["starting", "ok", "rebuilding", "failed"]
    generation: int = Field(description="sets built so far: 1 after start, +1 per rebuild")
    reason: str | None = Field(default=None, description="why it is not ok (the last failure)")
    size: int


H = TypeVar("H")  # one worker as an implementation holds it (an actor handle, a local worker)


@dataclass(frozen=True)
class Generation(Generic[H]):
    """One built worker set: its workers in rank order and what the lead worker loaded."""

    number: int
    workers: tuple[H, ...]
    loaded: Any  # LoadedModel of rank 0


class WorkerSet(ABC, Generic[H]):
    """A model group's workers. The async methods run on the group's event loop; ``start`` and
    the blocking part of ``rebuild`` run where blocking is allowed (the constructor, a thread)."""

    def __init__(self, spec: WorkerSetSpec) -> None:
        self.spec = spec
        self._current: Generation[H] | None = None
        self._state: Literal["starting", "ok", "rebuilding", "failed"] = "starting"
        self._reason: str | None = None
        self._lock = asyncio.Lock()
        #: called on the loop with each new generation's LoadedModel (the group's layout status)
        self.on_loaded: Callable[[LoadedModel], None] | None = None

    # ------------------------------------------------------------------ what an implementation provides
    @abstractmethod
    def _spawn(self) -> list[H]:
        """Start ``spec.size`` workers (constructed, not yet joined). Blocking."""

    @abstractmethod
    def _call_blocking(self, workers: Sequence[H], method: str, per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Call ``method`` on every worker with its own arguments and wait for all. Blocking."""

    @abstractmethod
    def _parallel(self, rank: int, port: int) -> Any:
        """The ``ParallelConfig`` rank ``rank`` joins the set with."""

    @abstractmethod
    def _order(self, workers: list[H]) -> list[H]:
        """The workers in rank order (NVLink pairs become aligned rank pairs on a GPU node)."""

    @abstractmethod
    async def _invoke(self, gen: Generation[H], method: str, ranks: Sequence[int], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> list[Any]:
        """``method`` on ``ranks`` of ``gen``, results in rank order; a dead worker raises ``WorkerDied``."""

    @abstractmethod
    def _send(self, gen: Generation[H], method: str, ranks: Sequence[int], args: tuple[Any, ...]) -> None:
        """``method`` on ``ranks`` without waiting for an answer (a pause reaching a busy worker)."""

    @abstractmethod
    def _discard(self, workers: Sequence[H]) -> None:
        """Stop these workers for good (they hold the group's bundles). Never raises."""

    @abstractmethod
    def _kill(self, gen: Generation[H], rank: int) -> None:
        """Kill one worker as a crash would (fault injection)."""

    @abstractmethod
    async def _probe(self, gen: Generation[H], rank: int, timeout_s: float) -> WorkerState:
        """One worker's state now (see ``WorkerState``)."""

    # ------------------------------------------------------------------ lifecycle
    def _build(self, number: int) -> Generation[H]:
        """Start, join and load a new set. Touches nothing the event loop reads: the caller
        installs the result. On failure the workers it started are stopped."""
        from xema_ray.net import free_port

        workers = self._spawn()
        try:
            workers = self._order(workers)
            port = free_port()
            self._call_blocking(workers, "init_device", [(self._parallel(i, port),) for i in range(len(workers))])
            loaded = self._call_blocking(workers, "load_model", [(self.spec.load,)] * len(workers))
        except BaseException:
            self._discard(workers)
            raise
        return Generation(number=number, workers=tuple(workers), loaded=loaded[0])

    def _install(self, gen: Generation[H]) -> None:
        self._current = gen
        self._state, self._reason = "ok", None
        if self.on_loaded is not None:
            self.on_loaded(gen.loaded)

    def start(self) -> Any:
        """Build the first set (blocking); returns the lead worker's ``LoadedModel``."""
        try:
            gen = self._build(1)
        except Exception as e:
            self._state, self._reason = "failed", f"start failed: {type(e).__name__}: {e}"
            raise
        self._install(gen)
        return gen.loaded

    @property
    def generation(self) -> int:
        return self._current.number if self._current is not None else 0

    @property
    def size(self) -> int:
        return self.spec.size

    async def rebuild(self, failed_generation: int) -> bool:
        """Replace the whole set after a failure seen at ``failed_generation`` (a dead rank breaks
        every SP group). Once per failure: False when another caller already rebuilt it. Raises
        ``RebuildFailed`` (the set stays at its generation; the next failure tries again)."""
        async with self._lock:
            if self.generation != failed_generation:
                return False
            logger.warning("worker set generation %d failed; restarting its workers and reloading weights", failed_generation)
            await self._rebuild_locked("rebuilding the worker set")
            return True

    async def replace(self, spec: WorkerSetSpec) -> None:
        """Replace the whole set by one made from ``spec`` (a new plan table's load config; the
        caller lets running batches finish first). The old workers stop first: their placement
        group bundles are what the new ones take. Raises ``RebuildFailed``; the set then keeps
        ``spec``, so the next failure's rebuild tries it again."""
        if spec.size != self.spec.size or spec.device != self.spec.device:
            raise ValueError(f"a replacement set must keep size and device ({self.spec.size} x {self.spec.device}), "
                             f"got {spec.size} x {spec.device}")
        async with self._lock:
            self.spec = spec
            logger.warning("worker set generation %d: replacing its workers for new plans", self.generation)
            await self._rebuild_locked("loading new plans")

    async def _rebuild_locked(self, why: str) -> None:
        number = self.generation + 1
        if self._current is not None:
            self._discard(self._current.workers)
        self._state, self._reason = "rebuilding", why
        try:
            gen = await asyncio.get_running_loop().run_in_executor(None, self._build, number)
        except Exception as e:
            self._state, self._reason = "failed", f"rebuild failed: {type(e).__name__}"
            raise RebuildFailed(f"the worker set's rebuild failed ({type(e).__name__}: {e})") from e
        self._install(gen)  # on the loop: readers see the old set or the new one, never half of one

    def shutdown(self) -> None:
        """Stop every worker."""
        if self._current is not None:
            self._discard(self._current.workers)
            self._current = None

    # ------------------------------------------------------------------ calls
    def _live(self) -> Generation[H]:
        if self._current is None:
            raise WorkerDied(-1, f"the worker set is {self._state} ({self._reason or 'not started'})")
        return self._current

    def _ranks(self, ranks: Sequence[int] | None) -> tuple[int, ...]:
        out = tuple(range(self.size)) if ranks is None else tuple(ranks)
        bad = [r for r in out if not 0 <= r < self.size]
        if bad:
            raise ValueError(f"worker ranks must be in [0, {self.size}), got {bad}")
        return out

    async def collective_rpc(self, method: str, ranks: Sequence[int] | None = None, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on ``ranks`` (all when None) of the current set and
        return their results in rank order. A worker that died raises ``WorkerDied``; an error
        the method raised is raised as it is (a ``BatchCancelled`` stays one)."""
        gen = self._live()
        try:
            return await self._invoke(gen, method, self._ranks(ranks), args, kwargs or {})
        except WorkerDied as e:
            if gen is self._current and self._state == "ok":  # degraded until the set is rebuilt
                self._state, self._reason = "failed", str(e)
            raise

    async def execute(self, ranks: Sequence[int], batch: Batch, observer: StepObserver | None = None,
                      run_id: str | None = None) -> list[BatchResult | PausedRun]:
        """One batch on its SP group's ranks: ``BatchResult`` or, when it parked, ``PausedRun`` per rank."""
        args = (batch, observer) if run_id is None else (batch, observer, run_id)
        return await self.collective_rpc("execute", ranks, args)

    def pause(self, ranks: Sequence[int], run_id: str, offload: bool) -> None:
        """Ask ``run_id`` to park at its next step boundary on ``ranks`` (answer not awaited: the
        batch's own ``execute`` returns a ``PausedRun`` when it has)."""
        if self._current is not None:
            self._send(self._current, "pause", self._ranks(ranks), (run_id, offload))

    async def resume(self, ranks: Sequence[int], run_id: str) -> list[BatchResult | PausedRun]:
        """Continue a parked batch on the ranks it paused on."""
        return await self.collective_rpc("resume", ranks, (run_id,))

    def kill(self, rank: int) -> None:
        """Fault injection for tests and drills: one worker dies as a crash would kill it."""
        self._kill(self._live(), self._ranks([rank])[0])

    async def probe(self, timeout_s: float = 1.0) -> list[WorkerState]:
        """Every worker's state now, asked at once: ``dead`` only when its process is gone,
        ``busy`` when it did not answer within ``timeout_s``."""
        gen = self._current
        if gen is None:
            return ["dead"] * self.size
        return list(await asyncio.gather(*(self._probe(gen, r, timeout_s) for r in range(self.size))))

    def health(self) -> WorkerSetHealth:
        return WorkerSetHealth(state=self._state, generation=self.generation, reason=self._reason, size=self.size)


#: what a ModelGroup is given to make its worker set (a class or a function of the spec)
WorkerSetFactory = Callable[[WorkerSetSpec], WorkerSet[Any]]


def worker_set_for(spec: WorkerSetSpec) -> WorkerSet[Any]:
    """The worker set ``spec`` asks for: its backend, else its kind's (Ray actors for cpu and cuda)."""
    backend = spec.backend or spec.kind().backend
    if backend == "ray":
        from xema_ray.serving.group.worker_set_ray import RayWorkerSet

        return RayWorkerSet(spec)
    from xema_ray.serving.group.worker_set_local import InProcessWorkerSet

    return InProcessWorkerSet(spec)
