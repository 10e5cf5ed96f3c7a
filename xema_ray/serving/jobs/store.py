"""The job store: video jobs and result files shared by every router replica and model group.

Long requests run as jobs: a router replica writes the job, a model group runs it and writes
progress after every denoising step and the result at the end, and any router replica answers
polls and downloads from the store. Nothing about a job lives only in a process's memory, so a
router replica restart loses nothing, and a model group that dies leaves its jobs to be
re-dispatched (its lease lapses).

Two backends with the same semantics, both with atomic read-modify-write on one record:

- ``sqlite`` (embedded default): one SQLite file (WAL, shared by the processes of one node) and a
  results folder next to it;
- ``redis``: for router replicas or model groups on several nodes (``xema_ray.serving.jobs.redis_store``).

Records and files expire ``ttl_s`` after a job finishes (``expires_at``); a deleted job leaves a
tombstone (``deleted``) until then, which is how a running batch learns it was cancelled.

Every store call is short: it gives up after ``timeout_s`` (a store fault: the endpoints that
need the store answer 503 with Retry-After, nothing else waits on it). Each store has an
*epoch* (a random id written once into an empty store, ``epoch()``), and every job id carries
the epoch it was created in: a store that comes back empty (Redis restarted without
persistence) has a new epoch, so a job it no longer knows is told apart from one that never
existed (``lost_in_epoch``), and the model groups write back the jobs they hold.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from xema_ray.lora_pool import LoraUse
from xema_ray.vocabulary import QualityTier

JobStatus = Literal["queued", "in_progress", "completed", "failed"]
TERMINAL: tuple[JobStatus, ...] = ("completed", "failed")


class JobStoreConfig(BaseModel):
    """Where jobs and results live (``jobs:`` in the deployment YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["sqlite", "redis"] = Field(default="sqlite", description="sqlite: one node; redis: several")
    path: Path = Field(default=Path.home() / ".cache" / "xema-ray" / "jobs",
                       description="sqlite: folder of jobs.sqlite3 and results/")
    redis_url: str | None = Field(default=None, description="redis: e.g. redis://127.0.0.1:6379/0")
    prefix: str = Field(default="xema", min_length=1, description="redis key prefix (one per deployment)")
    ttl_s: float = Field(default=86_400.0, gt=0, description="results (and their jobs) expire this long after finishing")
    lease_s: float = Field(default=10.0, gt=0, description="a model group silent this long has died: its jobs are re-dispatched")
    poll_min_ms: int = Field(default=100, ge=1, description="smallest openai-poll-after-ms hint")
    poll_max_ms: int = Field(default=10_000, ge=1, description="largest openai-poll-after-ms hint")
    timeout_s: float = Field(default=2.0, gt=0, le=60,
                             description="one store call gives up after this long (a store fault: 503 on the store's "
                                         "endpoints); SQLite waits for a busy lock up to 5x this")

    @model_validator(mode="after")
    def _check(self) -> JobStoreConfig:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("jobs.backend 'redis' needs jobs.redis_url (e.g. redis://127.0.0.1:6379/0)")
        if self.poll_min_ms > self.poll_max_ms:
            raise ValueError(f"poll_min_ms {self.poll_min_ms} > poll_max_ms {self.poll_max_ms}")
        return self


class JobRecord(BaseModel):
    """One video job, as stored (JSON)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    seq: int = Field(default=0, description="creation order (the store assigns it)")
    tenant: str | None = Field(default=None, description="the API key's tenant that owns it (None: open API)")
    model: str
    template: str = Field(description="shape key of the served template it maps to")
    prompt: str
    seed: int
    guidance_scale: float | None = None
    guidance_scale_2: float | None = Field(default=None, description="a two-expert model's low-noise expert "
                                                                     "guidance (None: guidance_scale's)")
    negative_prompt: str | None = Field(default=None, description="None: the model's default")
    steps: int = Field(ge=1, description="the denoising steps it runs (resolved by the API: its own or its template's)")
    quality: QualityTier = Field(default=QualityTier.LOSSLESS, description="the quality tier it runs at (resolved "
                                                                           "by the API; auto: by its group)")
    lora: tuple[LoraUse, ...] = Field(default=(), description="LoRA adapters and scales (checked by the group)")
    references: int = Field(default=0, ge=0, description="input images, stored as files (``reference_name``) "
                            "beside the record")
    size: str = Field(description="served WIDTHxHEIGHT")
    seconds: str = Field(description="served duration")
    frames: int
    status: JobStatus = "queued"
    progress: float = Field(default=0.0, ge=0, le=1, description="fraction of the predicted time done")
    step: int = Field(default=0, ge=0, description="denoising steps finished")
    stage: Literal["denoise", "decode"] | None = Field(
        default=None, description="while in progress: denoise (the DiT workers' steps), or decode (its latents on "
                                  "the group's decode pool, docs/decode-stage.md); None: not started or finished")
    predicted_s: float = Field(gt=0, description="predicted run time (plan, refined by measured batches)")
    created_at: float
    started_at: float | None = None
    progress_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None
    error_code: str | None = None
    error_message: str | None = None
    owner: str | None = Field(default=None, description="model group replica that accepted it")
    attempts: int = Field(default=0, ge=0, description="times it was dispatched")
    deleted: bool = False
    cancel_step: int | None = Field(default=None, description="steps done when DELETE arrived")
    stopped_step: int | None = Field(default=None, description="steps done when the batch stopped")

    def remaining_s(self) -> float:
        return max(0.0, self.predicted_s * (1.0 - self.progress))


class TenantBusy(RuntimeError):
    """The tenant already has its limit of jobs queued or running (HTTP 429)."""

    def __init__(self, tenant: str | None, active: int) -> None:
        super().__init__(tenant, active)
        self.tenant, self.active = tenant, active


def reference_name(job_id: str, index: int) -> str:
    """The stored file of a job's ``index``-th input image (a ``<job_id>.*`` file: it goes with the job)."""
    return f"{job_id}.reference.{index}.png"


def result_name(job_id: str, variant: Literal["video", "thumbnail"]) -> str:
    """The stored file of a job's result: its video, or the thumbnail the Router cuts from it
    (``<job_id>.*`` files, like its input images: they go with the job)."""
    return f"{job_id}.mp4" if variant == "video" else f"{job_id}.thumbnail.png"


def new_job_id(epoch: str | None = None) -> str:
    """A job id: ``video_<uuid4 hex>``, and ``_<epoch>`` when made in a store's epoch."""
    return f"video_{uuid.uuid4().hex}" + (f"_{epoch}" if epoch else "")


def epoch_of(job_id: str) -> str | None:
    """The store epoch a job id was made in (None for ids without one)."""
    head, sep, tail = job_id.rpartition("_")
    return tail if sep and head.startswith("video_") and len(tail) == EPOCH_CHARS else None


#: hex digits of a store epoch
EPOCH_CHARS = 8


def new_epoch() -> str:
    return uuid.uuid4().hex[:EPOCH_CHARS]


logger = logging.getLogger("xema_ray.serving")
_UNREADABLE: set[str] = set()


def read_record(raw: str | bytes, job_id: str) -> JobRecord | None:
    """A stored record, or None when it does not validate (written by another version of the app
    into a shared store, or damaged): that one job is left alone, as if absent, with one warning per
    job, and every scan over the store (orphans, expiry, listings) goes on past it."""
    try:
        return JobRecord.model_validate_json(raw)
    except ValidationError as e:
        if job_id not in _UNREADABLE:
            _UNREADABLE.add(job_id)
            logger.warning("job %s: its stored record is not one this version reads; left alone (%s)", job_id,
                           "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:3]))
        return None


def _active(r: JobRecord | None) -> bool:
    return r is not None and not r.deleted and r.status not in TERMINAL


T = TypeVar("T")
Update = Callable[[JobRecord], JobRecord | None]  # None: leave the record as it is


class JobStore(ABC):
    """Backend-independent operations, built on one atomic primitive (``_update``)."""

    def __init__(self, cfg: JobStoreConfig) -> None:
        self.cfg = cfg

    # ---------------------------------------------------------------- primitives
    @abstractmethod
    def _insert(self, rec: JobRecord, max_active: int | None) -> JobRecord:
        """Insert ``rec``; with ``max_active``, atomically refuse it (TenantBusy) when its tenant
        has that many active jobs already."""

    @abstractmethod
    def epoch(self) -> str:
        """The store's epoch: written once into an empty store, read afterwards."""

    @abstractmethod
    def restore(self, rec: JobRecord) -> bool:
        """Write back a record the store lost (only where it has no record of that id)."""

    @abstractmethod
    def delete_files_of(self, job_id: str) -> None:
        """Every file derived from the job (``<job_id>.*``)."""

    @abstractmethod
    def _load(self, job_id: str) -> JobRecord | None: ...

    @abstractmethod
    def _update(self, job_id: str, fn: Update) -> JobRecord | None:
        """Apply ``fn`` atomically; return the record written (None: missing or unchanged)."""

    @abstractmethod
    def _scan(self, after_seq: int | None, limit: int, descending: bool) -> list[JobRecord]:
        """Live and deleted records in creation order, after ``after_seq``."""

    @abstractmethod
    def _remove(self, job_id: str) -> None: ...

    @abstractmethod
    def put_file(self, name: str, data: bytes, media_type: str, expires_at: float) -> None: ...

    @abstractmethod
    def get_file(self, name: str) -> tuple[bytes, str] | None: ...

    @abstractmethod
    def delete_file(self, name: str) -> None: ...

    @abstractmethod
    def heartbeat(self, owner: str) -> None:
        """The model group replica ``owner`` is alive for another ``lease_s``."""

    @abstractmethod
    def owner_alive(self, owner: str) -> bool: ...

    @abstractmethod
    def _purge_files(self, now: float) -> None: ...

    # ---------------------------------------------------------------- reads
    def _visible(self, rec: JobRecord | None, now: float) -> bool:
        return rec is not None and not rec.deleted and (rec.expires_at is None or rec.expires_at > now)

    def get(self, job_id: str, include_deleted: bool = False) -> JobRecord | None:
        rec = self._load(job_id)
        if include_deleted:
            return rec
        return rec if self._visible(rec, time.time()) else None

    def list(self, after: str | None = None, limit: int = 20, order: Literal["asc", "desc"] = "desc",
             tenant: str | None = None) -> tuple[list[JobRecord], bool]:
        """A page of ``tenant``'s live jobs (``has_more`` as the second value); ``after`` is a job
        id cursor (one of the tenant's).

        Raises:
            KeyError: ``after`` names no job.
        """
        after_seq = None
        if after is not None:
            cursor = self._load(after)
            if cursor is None or cursor.tenant != tenant:
                raise KeyError(after)
            after_seq = cursor.seq
        now, out, desc = time.time(), [], order == "desc"
        while len(out) <= limit:
            batch = self._scan(after_seq, 4 * (limit + 1), desc)
            if not batch:
                break
            out.extend(r for r in batch if self._visible(r, now) and r.tenant == tenant)
            after_seq = batch[-1].seq
        return out[:limit], len(out) > limit

    def cancelled(self, job_ids: list[str]) -> set[str]:
        """The ids among ``job_ids`` that were deleted (or no longer exist)."""
        out = set()
        for j in job_ids:
            rec = self._load(j)
            if rec is None or rec.deleted:
                out.add(j)
        return out

    # ---------------------------------------------------------------- writes
    def create(self, rec: JobRecord, max_active: int | None = None) -> JobRecord:
        """Store a new job (TenantBusy: its tenant has ``max_active`` active jobs already)."""
        return self._insert(rec, max_active)

    def discard(self, job_id: str) -> None:
        """Remove a job that was never accepted (a refused create) without a trace."""
        self._remove(job_id)
        self.delete_files_of(job_id)

    def accept(self, job_id: str, owner: str) -> JobRecord | None:
        """``owner`` queues the job: it must be live and not finished. Returns the record. An owner
        re-claiming a job it holds already does not count another attempt."""
        def fn(r: JobRecord) -> JobRecord | None:
            if r.deleted or r.status in TERMINAL:
                return None
            if r.owner == owner:
                return r
            return r.model_copy(update={"owner": owner, "attempts": r.attempts + 1})
        return self._update(job_id, fn)

    def start(self, job_id: str, owner: str, predicted_s: float) -> bool:
        """The job's batch starts on ``owner``'s workers (False: deleted, finished or taken)."""
        def fn(r: JobRecord) -> JobRecord | None:
            if r.deleted or r.status in TERMINAL or r.owner != owner:
                return None
            now = time.time()
            return r.model_copy(update={"status": "in_progress", "started_at": now, "progress_at": now, "step": 0,
                                        "progress": 0.0, "predicted_s": predicted_s, "stage": "denoise"})
        return self._update(job_id, fn) is not None

    def rerun(self, job_id: str, owner: str, remaining_s: float) -> float | None:
        """The job's batch runs again without a request that failed it (the group's isolation): its
        progress stays (it never goes back) and its prediction is stretched so that what remains is
        the re-run's ``remaining_s``. Returns the progress the re-run counts on from (None: deleted,
        finished or taken)."""
        def fn(r: JobRecord) -> JobRecord | None:
            if r.deleted or r.status != "in_progress" or r.owner != owner:
                return None
            return r.model_copy(update={"predicted_s": max(remaining_s, 1e-3) / (1.0 - min(r.progress, 0.999)),
                                        "progress_at": time.time()})
        rec = self._update(job_id, fn)
        return None if rec is None else rec.progress

    def set_progress(self, job_id: str, progress: float, step: int) -> None:
        def fn(r: JobRecord) -> JobRecord | None:
            if r.deleted or r.status != "in_progress":
                return None
            return r.model_copy(update={"progress": min(max(progress, r.progress), 0.999), "step": step,
                                        "progress_at": time.time()})
        self._update(job_id, fn)

    def set_stage(self, job_id: str, stage: Literal["denoise", "decode"]) -> None:
        """The job's stage while in progress (its latents handed to the decode pool: decode)."""
        def fn(r: JobRecord) -> JobRecord | None:
            if r.deleted or r.status != "in_progress":
                return None
            return r.model_copy(update={"stage": stage, "progress_at": time.time()})
        self._update(job_id, fn)

    def complete(self, job_id: str, files: dict[str, tuple[bytes, str]]) -> bool:
        """Store the result files and mark the job completed (False: it was deleted meanwhile)."""
        rec = self._load(job_id)
        if rec is None or rec.deleted:
            return False
        now = time.time()
        expires = now + self.cfg.ttl_s
        for name, (data, media_type) in files.items():
            self.put_file(name, data, media_type, expires)

        def fn(r: JobRecord) -> JobRecord | None:
            if r.deleted:
                return None
            return r.model_copy(update={"status": "completed", "progress": 1.0, "completed_at": now, "expires_at": expires,
                                        "stage": None})
        done = self._update(job_id, fn) is not None
        if not done:
            for name in files:
                self.delete_file(name)
        return done

    def fail(self, job_id: str, code: str, message: str) -> None:
        now = time.time()

        def fn(r: JobRecord) -> JobRecord | None:
            if r.deleted or r.status in TERMINAL:
                return None
            return r.model_copy(update={"status": "failed", "stage": None, "completed_at": now, "expires_at": now + self.cfg.ttl_s,
                                        "error_code": code, "error_message": message})
        self._update(job_id, fn)

    def requeue(self, job_id: str, expected_owner: str | None) -> JobRecord | None:
        """Take the job back from a dead owner (compare-and-set on the owner)."""
        def fn(r: JobRecord) -> JobRecord | None:
            if r.deleted or r.status in TERMINAL or r.owner != expected_owner:
                return None
            return r.model_copy(update={"status": "queued", "owner": None, "progress": 0.0, "step": 0, "stage": None,
                                        "started_at": None, "progress_at": None})
        return self._update(job_id, fn)

    def delete(self, job_id: str, result_names: tuple[str, ...] = ()) -> JobRecord | None:
        """Delete a live job (a tombstone until it expires); its files go at once. Returns the
        record as it was, or None if there was no live job."""
        now = time.time()
        before: list[JobRecord] = []

        def fn(r: JobRecord) -> JobRecord | None:
            if not self._visible(r, now):
                return None
            before.append(r)
            return r.model_copy(update={"deleted": True, "cancel_step": r.step,
                                        "expires_at": r.expires_at or now + self.cfg.ttl_s})
        if self._update(job_id, fn) is None:
            return None
        for name in result_names:
            self.delete_file(name)
        self.delete_files_of(job_id)
        return before[0]

    def stopped(self, job_id: str, step: int) -> None:
        """Record at which step a cancelled job's batch stopped (for operators and tests)."""
        self._update(job_id, lambda r: r.model_copy(update={"stopped_step": step}))

    def orphans(self, grace_s: float) -> list[JobRecord]:
        """Unfinished live jobs nobody runs: never accepted (``grace_s`` after creation) or whose
        owner's lease lapsed."""
        now, out, alive = time.time(), [], {}
        after: int | None = None
        while True:
            batch = self._scan(after, 500, False)
            if not batch:
                return out
            after = batch[-1].seq
            for r in batch:
                if r.deleted or r.status in TERMINAL:
                    continue
                if r.owner is None:
                    if now - r.created_at >= grace_s:
                        out.append(r)
                    continue
                if r.owner not in alive:
                    alive[r.owner] = self.owner_alive(r.owner)
                if not alive[r.owner]:
                    out.append(r)

    def purge_expired(self) -> int:
        """Drop records (and files) past ``expires_at``; returns how many records went."""
        now, n, after = time.time(), 0, None
        while True:
            batch = self._scan(after, 500, False)
            if not batch:
                break
            after = batch[-1].seq
            for r in batch:
                if r.expires_at is not None and r.expires_at <= now:
                    self._remove(r.id)
                    n += 1
        self._purge_files(now)
        return n


def store_faults() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the store is unreachable or busy (a 503 with Retry-After, not a bug)."""
    faults: tuple[type[BaseException], ...] = (sqlite3.OperationalError, OSError)
    try:
        import redis

        faults += (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
    except ImportError:
        pass
    return faults


@functools.lru_cache(maxsize=8)
def _open(cfg_json: str) -> JobStore:
    cfg = JobStoreConfig.model_validate_json(cfg_json)
    if cfg.backend == "redis":
        from xema_ray.serving.jobs.redis_store import RedisJobStore

        return RedisJobStore(cfg)
    from xema_ray.serving.jobs.sqlite_store import SQLiteJobStore

    return SQLiteJobStore(cfg)


def open_store(cfg: JobStoreConfig) -> JobStore:
    """The store for ``cfg`` (one client per process and config).

    Example:
        >>> import tempfile
        >>> store = open_store(JobStoreConfig(path=Path(tempfile.mkdtemp())))
        >>> store.get("video_missing") is None
        True
    """
    return _open(cfg.model_dump_json())



@functools.cache
def _store_executor() -> ThreadPoolExecutor:
    # store calls get threads of their own: a stalled store never takes the event loop's default
    # executor (which transcoding and other to_thread work share) with it
    return ThreadPoolExecutor(max_workers=8, thread_name_prefix="xema-store")


async def store_call(cfg: JobStoreConfig, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (a store method) on the store's threads, given up after a few of the store's
    ``timeout_s`` (a ``TimeoutError``: a store fault) even if the client library hangs."""
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(_store_executor(), functools.partial(fn, *args))
    try:
        return await asyncio.wait_for(fut, timeout=3 * cfg.timeout_s + 1.0)
    except TimeoutError:
        raise TimeoutError(f"the job store did not answer within {3 * cfg.timeout_s + 1.0:.0f} s") from None
