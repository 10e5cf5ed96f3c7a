"""The profile store: latency measurements on disk (JSON), so nothing is profiled twice.

Two kinds of record, both keyed by the hardware fingerprint (``Platform.hardware_fingerprint``,
NVML's device name on GPUs, the CPU model on CPUs) and the model:

* ``SegmentRecord`` — the latency of one operator combination: a (unit, phase) run whose trace
  signature (the sequence of its segments' ``pattern`` hashes) is ``signature``, executed under
  an execution shape (``exec_key``: template shape, batch, SP layout). Any request whose trace
  contains the same signature under the same shape reuses it: identical DiT blocks, every
  steady denoising step, and unmitigated regions shared by different mitigation configs.
* ``RequestRecord`` — a whole request's latency under one config (``config_hash``), either
  measured end to end or estimated from segments by the profiler.

The file is rewritten atomically (write + rename), so a crash never leaves half a store. A store
written before phases had one vocabulary names the text phase "setup" (in ``per_phase`` and in the
profiler's ``unit:<unit>@<phase>`` / ``untraced:<phase>`` signatures); it is read as "text".
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xema_ray.plan import ExecutionConfig
from xema_ray.vocabulary import LatencySource, PhaseKeyed, TimedSource, read_stored_phase

logger = logging.getLogger(__name__)

STORE_SCHEMA_VERSION = 1


class SegmentRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    fingerprint: str
    model: str
    exec_key: str = Field(description="template shape + batch + SP layout the segment ran under")
    signature: str = Field(description="hash of the (unit, phase) run's segment patterns")
    unit: str = Field(description="the representative unit it was measured on, for reading the store")
    seconds: float = Field(ge=0, description="median exclusive wall time of the run")
    samples: int = Field(ge=1, description="runs with this signature the median is over")
    config_hash: str = Field(description="config of the measuring run (provenance)")
    measured_at: float


class RequestRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    fingerprint: str
    model: str
    template: str
    config_hash: str
    source: TimedSource = Field(description="measured: a whole request timed; profiled: composed from timed segments")
    total_s: float = Field(ge=0)
    per_phase: PhaseKeyed[float] = Field(default_factory=dict, description="seconds by phase (text, denoise, decode)")
    steps: int = Field(ge=1)
    measured_at: float
    config: ExecutionConfig | None = Field(default=None, description="the config itself, so the cost model can calibrate against it")


class ProfileStoreFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int
    segments: list[SegmentRecord] = Field(default_factory=list)
    requests: list[RequestRecord] = Field(default_factory=list)


class ProfileStore:
    """Profile measurements, optionally backed by a JSON file.

    Example:
        >>> store = ProfileStore()  # in memory; ProfileStore("profiles.json") persists
        >>> store.get_segment("cpu-x", "tiny-flux2", "k", "sig") is None
        True
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._segments: dict[tuple[str, str, str, str], SegmentRecord] = {}
        self._requests: dict[tuple[str, str, str, str], RequestRecord] = {}
        if self.path is not None and self.path.exists():
            self._load(self.path)

    # ------------------------------------------------------------------ segments
    def get_segment(self, fingerprint: str, model: str, exec_key: str, signature: str) -> SegmentRecord | None:
        return self._segments.get((fingerprint, model, exec_key, signature))

    def put_segment(self, record: SegmentRecord) -> None:
        self._segments[(record.fingerprint, record.model, record.exec_key, record.signature)] = record

    # ------------------------------------------------------------------ requests
    def get_request(self, fingerprint: str, model: str, config_hash: str, source: LatencySource) -> RequestRecord | None:
        return self._requests.get((fingerprint, model, config_hash, source))

    def put_request(self, record: RequestRecord) -> None:
        self._requests[(record.fingerprint, record.model, record.config_hash, record.source)] = record

    def requests(self, fingerprint: str | None = None) -> list[RequestRecord]:
        """Whole-request records, optionally of one hardware fingerprint (for calibration)."""
        return [r for r in self._requests.values() if fingerprint is None or r.fingerprint == fingerprint]

    def merge(self, other: ProfileStore) -> None:
        """Add ``other``'s records (``other`` wins where both hold the same key)."""
        self._segments.update(other._segments)
        self._requests.update(other._requests)

    def __len__(self) -> int:
        return len(self._segments) + len(self._requests)

    # ------------------------------------------------------------------ file
    def save(self) -> None:
        """Write the store to its file atomically (no-op for an in-memory store)."""
        if self.path is None:
            return
        data = ProfileStoreFile(
            schema_version=STORE_SCHEMA_VERSION,
            segments=sorted(self._segments.values(), key=lambda r: (r.fingerprint, r.model, r.exec_key, r.signature)),
            requests=sorted(self._requests.values(), key=lambda r: (r.fingerprint, r.model, r.config_hash, r.source)),
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(data.model_dump_json(indent=1))
        os.replace(tmp, self.path)

    def _load(self, path: Path) -> None:
        raw = _stored_phases(json.loads(path.read_text()))
        version = raw.get("schema_version") if isinstance(raw, dict) else None
        if version != STORE_SCHEMA_VERSION:
            raise ValueError(f"profile store {path} has schema version {version}; this build reads {STORE_SCHEMA_VERSION}")
        # record by record: one a newer or older build wrote (a template field this build does not
        # know) is left out with a warning, not a start-up refused over a cache entry
        skipped = 0
        for kind, put in ((SegmentRecord, self.put_segment), (RequestRecord, self.put_request)):
            for item in raw.get("segments" if kind is SegmentRecord else "requests", []):
                try:
                    put(kind.model_validate(item))
                except ValidationError:
                    skipped += 1
        if skipped:
            logger.warning("profile store %s: %d record(s) this build cannot read were left out (another version "
                           "wrote them); they are measured again and rewritten", path, skipped)


def _stored_signature(signature: str) -> str:
    """A segment signature naming a phase (``unit:<unit>@<phase>``, ``untraced:<phase>``) with the
    phase as it is called today; hashes are returned as they are."""
    head, at, phase = signature.rpartition("@")
    if at and head.startswith("unit:"):
        return f"{head}@{read_stored_phase(phase)}"
    if signature.startswith("untraced:"):
        return "untraced:" + read_stored_phase(signature.removeprefix("untraced:"))
    return signature


def _stored_phases(raw: Any) -> Any:
    """A store file as an earlier version wrote it, with its phase names as they are called today."""
    if not isinstance(raw, dict):
        return raw
    segments = [{**s, "signature": _stored_signature(s["signature"])} if isinstance(s, dict) and isinstance(s.get("signature"), str)
                else s for s in raw.get("segments", [])]
    requests = [{**r, "per_phase": {read_stored_phase(k): v for k, v in r["per_phase"].items()}}
                if isinstance(r, dict) and isinstance(r.get("per_phase"), dict) else r for r in raw.get("requests", [])]
    return {**raw, "segments": segments, "requests": requests}

def now() -> float:
    return time.time()
