"""The SQLite backend of the job store (the embedded default): one file shared by the processes
of one node (WAL) and a results folder next to it."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from pathlib import Path

from xema_ray.serving.jobs.store import JobRecord, JobStore, JobStoreConfig, TenantBusy, Update, new_epoch, read_record

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (name TEXT PRIMARY KEY, media_type TEXT NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS owners (owner TEXT PRIMARY KEY, alive_until REAL NOT NULL);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class SQLiteJobStore(JobStore):
    """One SQLite file (WAL; several processes of one node share it) and a results folder."""

    def __init__(self, cfg: JobStoreConfig) -> None:
        super().__init__(cfg)
        cfg.path.mkdir(parents=True, exist_ok=True)
        self.results = cfg.path / "results"
        self.results.mkdir(exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(cfg.path / "jobs.sqlite3", timeout=5 * cfg.timeout_s, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def _insert(self, rec: JobRecord, max_active: int | None) -> JobRecord:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if max_active is not None:
                    (active,) = self._db.execute(
                        "SELECT COUNT(*) FROM jobs WHERE json_valid(doc) AND json_extract(doc, '$.tenant') IS ? AND "
                        "json_extract(doc, '$.deleted') = 0 AND json_extract(doc, '$.status') IN ('queued', 'in_progress')",
                        (rec.tenant,)).fetchone()
                    if active >= max_active:
                        raise TenantBusy(rec.tenant, int(active))
                cur = self._db.execute("INSERT INTO jobs (id, doc) VALUES (?, ?)", (rec.id, "{}"))
                rec = rec.model_copy(update={"seq": int(cur.lastrowid or 0)})
                self._db.execute("UPDATE jobs SET doc = ? WHERE id = ?", (rec.model_dump_json(), rec.id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return rec

    def _load(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return read_record(row[0], job_id) if row else None

    def _update(self, job_id: str, fn: Update) -> JobRecord | None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # the write lock first: read-modify-write is atomic across processes
            try:
                row = self._db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
                rec = read_record(row[0], job_id) if row else None
                new = fn(rec) if rec is not None else None
                if new is not None:
                    self._db.execute("UPDATE jobs SET doc = ? WHERE id = ?", (new.model_dump_json(), job_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return new

    def _scan(self, after_seq: int | None, limit: int, descending: bool) -> list[JobRecord]:
        while True:  # past pages of nothing but unreadable records
            if descending:
                q, arg = ("SELECT seq, id, doc FROM jobs WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                          after_seq if after_seq is not None else 2**62)
            else:
                q, arg = ("SELECT seq, id, doc FROM jobs WHERE seq > ? ORDER BY seq ASC LIMIT ?",
                          after_seq if after_seq is not None else -1)
            with self._lock:
                rows = self._db.execute(q, (arg, limit)).fetchall()
            out = [rec for _, job_id, doc in rows if (rec := read_record(doc, job_id)) is not None]
            if out or not rows:
                return out
            after_seq = rows[-1][0]

    def _remove(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def _file(self, name: str) -> Path:
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad result file name {name!r}")
        return self.results / name

    def epoch(self) -> str:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('epoch', ?)", (new_epoch(),))
            (value,) = self._db.execute("SELECT value FROM meta WHERE name = 'epoch'").fetchone()
        return str(value)

    def restore(self, rec: JobRecord) -> bool:
        with self._lock:
            cur = self._db.execute("INSERT OR IGNORE INTO jobs (id, doc) VALUES (?, ?)", (rec.id, rec.model_dump_json()))
            return cur.rowcount == 1

    def delete_files_of(self, job_id: str) -> None:
        with self._lock:
            names = [r[0] for r in self._db.execute("SELECT name FROM files WHERE name LIKE ? ESCAPE '\\'",
                                                    (job_id.replace("_", "\\_") + ".%",)).fetchall()]
        for path in self.results.glob(f"{job_id}.*"):
            if not path.name.endswith(".part"):  # a writer's temporary file: the writer removes its own
                names.append(path.name)
        for name in set(names):
            self.delete_file(name)

    def put_file(self, name: str, data: bytes, media_type: str, expires_at: float) -> None:
        # one temporary file per writer: concurrent writers of one name never share (or remove)
        # each other's, and the rename makes one whole file win
        tmp = self.results / f"{name}.{uuid.uuid4().hex[:12]}.part"
        try:
            tmp.write_bytes(data)
            tmp.replace(self._file(name))  # readers never see half a file
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO files (name, media_type, expires_at) VALUES (?, ?, ?)",
                             (name, media_type, expires_at))

    def get_file(self, name: str) -> tuple[bytes, str] | None:
        with self._lock:
            row = self._db.execute("SELECT media_type, expires_at FROM files WHERE name = ?", (name,)).fetchone()
        if row is None or row[1] <= time.time():
            return None
        try:
            return self._file(name).read_bytes(), str(row[0])
        except FileNotFoundError:
            return None

    def delete_file(self, name: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM files WHERE name = ?", (name,))
        self._file(name).unlink(missing_ok=True)

    def heartbeat(self, owner: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO owners (owner, alive_until) VALUES (?, ?)",
                             (owner, time.time() + self.cfg.lease_s))

    def owner_alive(self, owner: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT alive_until FROM owners WHERE owner = ?", (owner,)).fetchone()
        return row is not None and row[0] > time.time()

    def _purge_files(self, now: float) -> None:
        with self._lock:
            names = [r[0] for r in self._db.execute("SELECT name FROM files WHERE expires_at <= ?", (now,)).fetchall()]
            self._db.execute("DELETE FROM owners WHERE alive_until <= ?", (now - 3600,))
        for n in names:
            self.delete_file(n)
